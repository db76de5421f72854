"""The sigmoid (SigLIP) loss on the chunked route (contract: :mod:`infcl.contract`).

The sigmoid loss's entries are independent: no statistic of a row is needed before its gradient. So one walk of a
block's query rows in chunks of C rows (:mod:`.plan`) can take the loss and the gradient at once:

    raw    = q_c @ k.T                    float32 [C, Bk], cuBLAS (:mod:`.products`)
    pass over raw                         each row's loss; dL = g * -z * sigmoid(t) * factor in the operand dtype;
                                          the scale and bias gradients' parts (:mod:`infcl.kernels.chunked_sigmoid`)
    dq_c  += ds @ k,  dk += ds.T @ q_c    cuBLAS, accumulated in float32 (inside the GEMM where it runs)

- :meth:`ChunkedSigmoid.sigmoid_loss_and_grad_block`: both, for a unit upstream gradient: **3 GEMM-equivalents
  per block** (S once, dq, dk). The API's reduced loss ("mean", "sum") with a gradient to take runs it in its
  forward and keeps dq, dk and the parameters' gradients (float32, O(B * D)); the backward scales them by the
  upstream gradient, which is exact for a reduction whose rows share one weight (:mod:`infcl.function`).
- :meth:`~ChunkedSigmoid.sigmoid_forward_block`: the loss alone (a forward that takes no gradient, or
  ``reduction="none"``), 1 GEMM-equivalent; :meth:`~ChunkedSigmoid.sigmoid_backward_block`: the gradient for
  per-row upstream gradients (``reduction="none"``), 3 more: 4 in all, as the fused kernels' count at best.

The ring, labels, Bk > Bq, the bias and the scale gradient run unchanged through the contract. Hand-offs as for
the softmax loss (:func:`.plan.plan_block`): float64, a budget too small, a torch without float32 products.
"""

from dataclasses import replace
from typing import Optional, Tuple

import torch

from ...contract import Block, Tensor
from . import torch_passes
from .options import ChunkedOptions, fused
from .plan import ChunkPlan, HandOff
from .products import Products
from .workspace import Workspace


class ChunkedSigmoid(ChunkedOptions):
    """The sigmoid loss's block operations on the chunked route (blocks it hands off: the fused kernels')."""

    @staticmethod
    def _sigmoid_pass(plan: ChunkPlan):
        if plan.triton_passes:
            from ...kernels.chunked_sigmoid import sigmoid_chunk

            return sigmoid_chunk
        return torch_passes.sigmoid_chunk

    def _walk(
        self, block: Block, plan: ChunkPlan, loss: bool, g_row: Optional[Tensor], dq=None, dk=None
    ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(row losses [Bq] or None, the (scale, bias) gradients [2] or None) of one block: the loss where ``loss``,
        the gradient for the upstream ``g_row`` [Bq] (accumulated into ``dq``, ``dk``) where one is given."""
        sigmoid_pass, products = self._sigmoid_pass(plan), Products(block, plan)
        (n_q, dim), n_k, dev = block.q.shape, block.k.shape[0], block.q.device
        grad = g_row is not None
        work = Workspace(plan, n_k, dim, dev, grad=grad)
        params = torch.stack((block.scale, block.bias)).to(torch.float32)
        rows = torch.empty(n_q, device=dev) if loss else None
        dparams = torch.zeros(2, device=dev) if grad else None
        for c in plan.chunks(n_q):
            n = c.stop - c.start
            raw = products.scores(c, work.scores(n))
            ds, factor, gamma = None, None, None
            if grad:
                ds = work.grad(n)
                factor, gamma = products.row_factor(block, c, None, g_row)
            extra = () if plan.triton_passes else (work.scratch_views(n),)
            part = sigmoid_pass(
                raw,
                params,
                block.pos[c],
                rows[c] if loss else None,
                ds,
                factor,
                g_row[c] if grad else None,
                plan.operand,
                *extra,
            )
            if grad:
                dparams += part
                products.accumulate(ds, c, block, gamma, dq, dk, work)
        return rows, dparams

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        plan = self.plan(block)
        if isinstance(plan, HandOff):
            return fused(block.q.device).sigmoid_forward_block(block)
        return self._walk(block, plan, True, None)[0]

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        plan = self.plan(block)
        if isinstance(plan, HandOff):
            return fused(block.q.device).sigmoid_backward_block(block, dq, dk)
        return self._walk(block, plan, False, block.g_row, dq, dk)[1]

    def sigmoid_loss_and_grad_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tuple[Tensor, Tensor]:
        """(rows [Bq], dparams [2]): :meth:`sigmoid_forward_block`'s rows and :meth:`sigmoid_backward_block`'s
        gradient for a unit upstream gradient (g_row = 1), from one walk (see the module docstring)."""
        ones = torch.ones(block.q.shape[0], dtype=block.scale.dtype, device=block.q.device)
        plan = self.plan(block)
        if isinstance(plan, HandOff):
            backend = fused(block.q.device)
            rows = backend.sigmoid_forward_block(block)
            return rows, backend.sigmoid_backward_block(replace(block, g_row=ones), dq, dk)
        return self._walk(block, plan, True, ones, dq, dk)
