"""The distillation loss on the Triton kernels (:mod:`infcl.kernels.distill`; contract: :mod:`infcl.contract`; the
math: :mod:`infcl.losses.distill`), through the custom ops ``torch.ops.infcl.triton_distill_forward_block`` /
``triton_distill_backward_block``. The scales stay 0-d device tensors (no host sync)."""

from ...contract import Block, Teacher, Tensor
from ...kernels.distill import backward_op, forward_op
from .options import FALLBACK, TritonOptions, on_torch_tiles


class TritonDistill(TritonOptions):
    """The distillation loss's block operations on the kernels (``precision``: tl.dot's for float32, None: torch's
    float32 matmul precision, read by the launcher)."""

    def distill_forward_block(self, block: Block, teacher: Teacher, symmetric: bool):
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.distill_forward_block(block, teacher, symmetric)
        rows, cols = forward_op(
            block.q, block.k, block.scale, teacher.q, teacher.k, teacher.scale, symmetric, self.precision or ""
        )
        return rows, (cols if symmetric else None)

    def distill_backward_block(self, block: Block, teacher: Teacher, dq: Tensor, dk: Tensor) -> Tensor:
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.distill_backward_block(block, teacher, dq, dk)
        return backward_op(
            block.q,
            block.k,
            block.scale,
            teacher.q,
            teacher.k,
            teacher.scale,
            *block.upstream,
            dq,
            dk,
            self.precision or "",
        )
