"""The distillation loss's block operations on the native CPU kernel (``csrc/distill.cpp``): the interface of
:class:`infcl.backends.distill_tiles.DistillTiles` on ``torch.ops.infcl.distill_forward_block`` /
``distill_backward_block`` (math: :mod:`infcl.losses.distill`). The scales go in as host floats (CPU)."""

from typing import Optional

import torch

from ..losses.distill import DistillPartials, DistillUpstream, Teacher
from .base import Block, Tensor
from .rank_native import torch_ops


def partials(packed: Tensor) -> DistillPartials:
    """[5, n] (m, r, mT, rT, cross) as :class:`DistillPartials` (views)."""
    return DistillPartials(packed[0:2], packed[2:4], packed[4])


class NativeDistill:
    name = "cpu"

    def distill_forward_block(self, block: Block, teacher: Teacher, symmetric: bool):
        rows, cols = torch_ops().distill_forward_block(
            block.q, block.k, float(block.scale), teacher.q, teacher.k, float(teacher.scale), symmetric
        )
        return partials(rows), (partials(cols) if symmetric else None)

    def distill_backward_block(
        self,
        block: Block,
        teacher: Teacher,
        rows: DistillUpstream,
        cols: Optional[DistillUpstream],
        dq: Tensor,
        dk: Tensor,
    ) -> Tensor:
        col_stats = None if cols is None else torch.cat((cols.student, cols.teacher))
        return torch_ops().distill_backward_block(
            block.q,
            block.k,
            float(block.scale),
            teacher.q,
            teacher.k,
            float(teacher.scale),
            torch.cat((rows.student, rows.teacher)),
            rows.grad,
            col_stats,
            None if cols is None else cols.grad,
            dq,
            dk,
        )


NATIVE_DISTILL = NativeDistill()
