"""The distillation loss's block operations on the native CPU kernel (``csrc/distill.cpp``):
``torch.ops.infcl.distill_forward_block`` / ``distill_backward_block`` (contract: :mod:`infcl.contract`; math:
:mod:`infcl.losses.distill`). The scales go in as host floats (CPU)."""

from ...contract import Block, Teacher, Tensor
from .build import torch_ops


class NativeDistill:
    """The distillation loss's block operations on the custom ops."""

    def distill_forward_block(self, block: Block, teacher: Teacher, symmetric: bool):
        rows, cols = torch_ops().distill_forward_block(
            block.q, block.k, float(block.scale), teacher.q, teacher.k, float(teacher.scale), symmetric
        )
        return rows, (cols if symmetric else None)

    def distill_backward_block(self, block: Block, teacher: Teacher, dq: Tensor, dk: Tensor) -> Tensor:
        return torch_ops().distill_backward_block(
            block.q,
            block.k,
            float(block.scale),
            teacher.q,
            teacher.k,
            float(teacher.scale),
            *block.upstream,
            dq,
            dk,
        )
