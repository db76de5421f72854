"""The chunked route's three products per chunk: the scores, dq's and dk's, always with float32 results, written
where they belong.

On CUDA they are cuBLAS calls. The scores: ``torch.mm(q_c, k.T, out_dtype=torch.float32, out=S)`` for
bfloat16/float16 operands (``aten::mm.dtype_out``: the tensor cores' float32 sums written into the workspace,
never rounded to the operand dtype), plain ``torch.mm(..., out=S)`` for float32 operands, which follows torch's
TF32 setting (``torch.backends.cuda.matmul``), as the fused kernels do. dq and dk accumulate inside the GEMM,
beta = 1: ``torch.addmm(dq_c, dS, k, out_dtype=torch.float32, out=dq_c)`` and the same for
``dk += dS.T @ q_c`` (``aten::addmm.dtype_out``; ``addmm_`` for float32), where :func:`.probes.accumulates_in_gemm`
says it runs; elsewhere, and for float16, each product is written into a float32 buffer of the workspace and added
(:mod:`.plan` counts the buffers). Elsewhere (CPU tensors: the tests) they are float32 products of float32 copies
of q and k, made once per block: exact products of bfloat16/float16 operands summed in float32, which is what the
tensor cores compute up to the order of the sums; they accumulate with ``addmm_``.

**The same scores in both phases.** The backward recomputes each chunk's scores by the same call on the same
shapes, strides and dtypes as the forward: the chunk starts, lengths and output layout are the plan's, so cuBLAS
picks the same kernel, and cuBLAS guarantees bit-wise identical results run to run for one toolkit, one GPU
architecture and SM count (its "Results reproducibility" note; not across multiple streams sharing one handle's
workspace). The A/B command (``bench.gpu_ab``) checks the bits on the GPU.

**float16's dS.** dS = g * (P - Y) with a mean's g = 1 / B reaches 1e-10 and below, where float16 flushes to zero.
Each row i is therefore divided by gamma_i = max(|g_row[i]|, max |g_col|) (the largest upstream gradient that
reaches it) before rounding, and the products scale back in float32: ``dq_c = (dS' @ k) * gamma * scale`` and
``dk += (dS'.T @ q~) * gamma_max * scale`` with ``q~ = q_c * gamma / gamma_max`` rounded to float16 (rows whose
gamma is below 2**-24 of the chunk's largest fall out of dk, as they would of any float16 sum). bfloat16 and
float32 store ``dS * scale`` as they are.
"""

from typing import Optional

import torch

from ...contract import Block, Tensor
from .plan import ChunkPlan

F32 = torch.float32


def mm_f32(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """out = a @ b, float32, from bfloat16/float16 ``a``, ``b`` on cuBLAS (``aten::mm.dtype_out``)."""
    return torch.mm(a, b, out_dtype=F32, out=out)


def addmm_f32(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """acc += a @ b inside the GEMM (beta = 1), float32 ``acc``, bfloat16 ``a``, ``b`` (``aten::addmm.dtype_out``)."""
    return torch.addmm(acc, a, b, out_dtype=F32, out=acc)


class Products:
    """One block's operands and its products (see the module docstring)."""

    def __init__(self, block: Block, plan: ChunkPlan):
        self.plan = plan
        if plan.cublas:
            self.q, self.k = block.q, block.k
        else:
            self.q, self.k = block.q.to(F32), block.k.to(F32)  # no copy for float32
        self.widening = plan.cublas and block.q.dtype != F32  # float32 results from narrower operands

    def _mm(self, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
        return mm_f32(a, b, out) if self.widening else torch.mm(a, b, out=out)

    def _addmm(self, acc: Tensor, a: Tensor, b: Tensor) -> None:
        if self.widening:
            addmm_f32(acc, a, b)
        else:
            acc.addmm_(a, b)

    def scores(self, rows: slice, out: Tensor) -> Tensor:
        """raw = q[rows] @ k.T written into ``out``, float32 [C, Bk] (unscaled: the passes multiply by the scale)."""
        return self._mm(self.q[rows], self.k.T, out)

    def row_factor(self, block: Block, rows: slice, g_col_max: Optional[Tensor], g_row: Optional[Tensor] = None):
        """(factor, gamma): what the backward pass multiplies each dS row by before rounding (the scale, or
        1 / gamma for float16) and the float16 rows' gamma (None otherwise). ``g_row``: the rows' upstream
        gradients (default ``block.g_row``)."""
        if not self.plan.row_scaled:
            return block.scale, None
        gamma = (block.g_row if g_row is None else g_row)[rows].abs()
        if g_col_max is not None:
            gamma = torch.maximum(gamma, g_col_max)
        gamma = torch.where(gamma > 0, gamma, torch.ones_like(gamma))
        return gamma.reciprocal(), gamma

    def accumulate(
        self, ds: Tensor, rows: slice, block: Block, gamma: Optional[Tensor], dq: Tensor, dk: Tensor, work=None
    ):
        """dq[rows] += scale * dS @ k and dk += scale * dS.T @ q[rows] from ``ds`` (dS * factor, rounded): inside
        the GEMMs where the plan says so, else through ``work``'s float32 product buffers (a
        :class:`.workspace.Workspace`; None: buffers of its own, for a caller outside the route's loop)."""
        q_c, dq_c = self.q[rows], dq[rows]
        if self.plan.in_gemm:
            self._addmm(dq_c, ds, self.k)
            self._addmm(dk, ds.T, q_c)
            return
        n = rows.stop - rows.start
        if work is None:
            dq_prod, dk_prod = torch.empty_like(dq_c), torch.empty_like(dk)
        else:
            dq_prod, dk_prod = work.dq_product(n), work.dk_product
        self._mm(ds, self.k, dq_prod)
        if gamma is None:
            dq_c += dq_prod
            dk += self._mm(ds.T, q_c, dk_prod)
            return
        gamma_max = gamma.max()
        dq_c.addcmul_(dq_prod, (gamma * block.scale)[:, None])
        q_scaled = (q_c.to(F32) * (gamma / gamma_max)[:, None]).to(self.plan.operand).to(q_c.dtype)
        dk.addcmul_(self._mm(ds.T, q_scaled, dk_prod), gamma_max * block.scale)
