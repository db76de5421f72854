"""The chunked route's three products per chunk: the scores, dq's and dk's, always with float32 results.

On CUDA they are cuBLAS calls: ``torch.mm(q_c, k.T, out_dtype=torch.float32)`` for bfloat16/float16 operands
(``aten::mm.dtype``: the tensor cores' float32 sums written without rounding to the operand dtype), and plain
``torch.mm`` for float32 operands, which follows torch's TF32 setting (``torch.backends.cuda.matmul``), as the
fused kernels do. Elsewhere (CPU tensors: the tests) they are float32 products of float32 copies of q and k, made
once per block: exact products of bfloat16/float16 operands summed in float32, which is what the tensor cores
compute up to the order of the sums.

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


class Products:
    """One block's operands and its products (see the module docstring)."""

    def __init__(self, block: Block, plan: ChunkPlan):
        self.plan = plan
        if plan.cublas:
            self.q, self.k = block.q, block.k
        else:
            self.q, self.k = block.q.to(F32), block.k.to(F32)  # no copy for float32
        self.out_dtype = {"out_dtype": F32} if plan.cublas and block.q.dtype != F32 else {}

    def _mm(self, a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
        if self.out_dtype:
            return torch.mm(a, b, **self.out_dtype)  # a float32 result; the caching allocator reuses its block
        return torch.mm(a, b, out=out)

    def scores(self, rows: slice, out: Tensor) -> Tensor:
        """raw = q[rows] @ k.T, float32 [C, Bk] (unscaled: the passes multiply by the scale themselves)."""
        return self._mm(self.q[rows], self.k.T, out)

    def row_factor(self, block: Block, rows: slice, g_col_max: Optional[Tensor]):
        """(factor, gamma): what the backward pass multiplies each dS row by before rounding (the scale, or
        1 / gamma for float16) and the float16 rows' gamma (None otherwise)."""
        if not self.plan.row_scaled:
            return block.scale, None
        gamma = block.g_row[rows].abs()
        if g_col_max is not None:
            gamma = torch.maximum(gamma, g_col_max)
        gamma = torch.where(gamma > 0, gamma, torch.ones_like(gamma))
        return gamma.reciprocal(), gamma

    def accumulate(self, ds: Tensor, rows: slice, block: Block, gamma: Optional[Tensor], dq: Tensor, dk: Tensor):
        """dq[rows] += scale * dS @ k and dk += scale * dS.T @ q[rows] from ``ds`` (dS * factor, rounded)."""
        q_c = self.q[rows]
        dq_c = self._mm(ds, self.k)
        if gamma is None:
            dq[rows] += dq_c
            dk += self._mm(ds.T, q_c)
            return
        gamma_max = gamma.max()
        dq[rows].addcmul_(dq_c, (gamma * block.scale)[:, None])
        q_scaled = (q_c.to(F32) * (gamma / gamma_max)[:, None]).to(self.plan.operand).to(q_c.dtype)
        dk.addcmul_(self._mm(ds.T, q_scaled), gamma_max * block.scale)
