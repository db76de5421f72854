"""The one autograd Function behind ``cal_inf_loss`` for every non-reference backend.

Forward runs the ring driver and returns per-row (and, for the symmetric loss, per-column) losses
``lse - positive``; it saves only q, k, the labels and the log-sum-exp vectors. Backward hands the
upstream per-row / per-column gradients to the driver, which recomputes the tiles.
"""

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .backends.base import BlockBackend
from .ring.driver import ring_backward, ring_forward
from .ring.layout import RingLayout


@dataclass(frozen=True)
class LossPlan:
    """Everything about a call that is not a tensor: handed to the Function as one argument."""

    backend: BlockBackend
    symmetric: bool
    layout: RingLayout


def _losses(lse: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """lse - pos, with NaN wherever the log-sum-exp is not finite.

    An infinite log-sum-exp means an infinite logit in that row (or column); F.cross_entropy turns
    every such row into NaN (inf - inf inside its log-softmax), and so do we: never a silent inf or
    finite number from non-finite features.
    """
    return torch.where(torch.isfinite(lse), lse - pos, float("nan"))


class InfLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, scale, labels, plan: LossPlan):
        scale_value = float(scale)
        fwd = ring_forward(q, k, scale_value, labels, plan.symmetric, plan.backend, plan.layout)
        row_loss = _losses(fwd.row_lse, fwd.row_pos)
        if plan.symmetric:
            col_loss = _losses(fwd.col_lse, fwd.col_pos)
            ctx.save_for_backward(q, k, labels, fwd.row_lse, fwd.col_lse)
        else:
            col_loss = row_loss.new_empty(0)
            ctx.save_for_backward(q, k, labels, fwd.row_lse)
        ctx.plan = plan
        ctx.scale_value = scale_value
        ctx.scale_meta = (scale.dtype, scale.shape)
        ctx.mark_non_differentiable(labels)
        return row_loss, col_loss

    @staticmethod
    @once_differentiable  # the backward is itself a tiled loop: no double backward
    def backward(ctx, g_row, g_col):
        plan: LossPlan = ctx.plan
        q, k, labels, row_lse, *rest = ctx.saved_tensors
        col_lse = rest[0] if plan.symmetric else None
        g_col = g_col.to(row_lse.dtype) if plan.symmetric else None
        dq, dk, dscale = ring_backward(
            q, k, ctx.scale_value, labels, plan.backend, plan.layout, row_lse, g_row.to(row_lse.dtype), col_lse, g_col
        )
        scale_grad = None
        if ctx.needs_input_grad[2]:
            dtype, shape = ctx.scale_meta
            scale_grad = dscale.to(dtype).reshape(shape)
        return dq.to(q.dtype), dk.to(k.dtype), scale_grad, None, None
