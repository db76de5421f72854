"""The chunked route's block steps for the softmax loss (contract: :mod:`infcl.contract`).

One block's forward walks its query rows in chunks of C rows (:mod:`.plan`), in order:

    raw    = q_c @ k.T                  float32 [C, Bk], cuBLAS (:mod:`.products`)
    rows_c = stats pass over raw        (max, r, positive) of each of the chunk's rows, over all Bk columns
    cols  <- lse_merge(cols, the chunk's column stats)     symmetric: in chunk order

Each row's stats are complete after its chunk; only the columns' are merged across chunks, by
:func:`infcl.lse.lse_merge` in chunk order. The backward recomputes ``raw`` by the same call, and per chunk:

    ds     = grad pass over raw         dS * factor in the operand dtype, and the scale gradient's parts
    dq_c  += ds @ k,  dk += ds.T @ q_c   cuBLAS, accumulated into the float32 dq and dk inside the GEMM
                                         (beta = 1) in chunk order, where this torch has it (:mod:`.products`)

GEMM-equivalents per block (2 * Bq * Bk * D flops each): forward 1, backward 3 (the scores again, dq, dk), so 4
against the fused kernels' 5 at D <= 256 and 7 at D = 512. HBM beyond the products' own operands: per S entry 4
bytes written and 4 read in the forward, 4 + 4 + 2 (the scores, dS written) and 2 x 2 (dS read by both products)
in the backward; the scores are written into the workspace by the product itself, and the workspace is
allocated once per block and phase (:mod:`.workspace`; the forward has no dS). No float atomics anywhere; every
sum has a fixed order, so reruns are bit-identical.

Where the route does not fit a block it hands it to the fused kernels (:func:`infcl.backends.chunked.plan.plan_block`
says when). The SigLIP loss: :mod:`.sigmoid`.
"""

from typing import Optional, Tuple

import torch

from ...contract import Block, Tensor
from ...lse import empty_stats, lse_merge
from . import torch_passes
from .options import ChunkedOptions, fused
from .plan import ChunkPlan, HandOff
from .products import Products
from .workspace import Workspace


class ChunkedSoftmax(ChunkedOptions):
    """The softmax loss's block operations on the chunked route (masked blocks: the fused kernels')."""

    # Label smoothing's uniform part over the kept entries: every masked block is handed off (plan_block) to the
    # fused backend (the Triton kernels or the torch tiles), whose masked tiles sum the kept logits.
    kept_sums = True

    @staticmethod
    def _passes(plan: ChunkPlan):
        if plan.triton_passes:
            from ...kernels import chunked_softmax

            return chunked_softmax
        return torch_passes

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        plan = self.plan(block)
        if isinstance(plan, HandOff):
            return fused(block.q.device).forward_block(block, symmetric)
        passes, products = self._passes(plan), Products(block, plan)
        (n_q, dim), n_k, dev = block.q.shape, block.k.shape[0], block.q.device
        work = Workspace(plan, n_k, dim, dev, grad=False)
        rows = torch.empty(3, n_q, device=dev)
        cols = empty_stats(n_k, torch.float32, dev) if symmetric else None
        for c in plan.chunks(n_q):
            n = c.stop - c.start
            raw = products.scores(c, work.scores(n))
            # the Triton pass merges the chunk's column stats into cols itself; the torch pass returns them
            extra = (cols,) if plan.triton_passes else (work.scratch_views(n),)
            part = passes.chunk_stats(raw, block.scale, block.pos[c], symmetric, rows[:, c], *extra)
            if symmetric and part is not cols:
                lse_merge(cols, part)
        return rows, cols

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        plan = self.plan(block)
        if isinstance(plan, HandOff):
            return fused(block.q.device).backward_block(block, dq, dk)
        passes, products = self._passes(plan), Products(block, plan)
        (n_q, dim), n_k, dev = block.q.shape, block.k.shape[0], block.q.device
        symmetric = block.symmetric
        work = Workspace(plan, n_k, dim, dev, grad=True)
        g_col_max = block.g_col.abs().max() if symmetric and plan.row_scaled else None
        dscale = torch.zeros(2, device=dev)
        for c in plan.chunks(n_q):
            n = c.stop - c.start
            raw = products.scores(c, work.scores(n))
            ds = work.grad(n)
            factor, gamma = products.row_factor(block, c, g_col_max)
            extra = () if plan.triton_passes else (work.scratch_views(n),)
            dscale += passes.chunk_grad(
                raw,
                ds,
                block.scale,
                factor,
                block.pos[c],
                block.row_stats[:, c],
                block.g_row[c],
                block.col_stats,
                block.g_col,
                plan.operand,
                *extra,
            )
            products.accumulate(ds, c, block, gamma, dq, dk, work)
        return dscale

    def guide_label_scores(self, guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype) -> Tensor:
        """The guide pass of a masked loss, whose blocks the fused kernels run: their own guide arithmetic, so a
        threshold and the scores compared with it still come from one product."""
        return fused(guide_q.device).guide_label_scores(guide_q, guide_k, pos, feature_dtype)
