"""The one autograd Function behind ``cal_inf_loss`` for every non-reference backend.

Forward runs the ring driver with the softmax loss's block steps and returns per-row (and, for the
symmetric loss, per-column) losses ``(max - positive) + rel``; it saves only q, k, the labels and the
``[2, n]`` log-sum-exp stats. Backward hands the upstream per-row / per-column gradients to the driver,
which recomputes the tiles.
"""

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .backends.base import BlockBackend, accum_dtype
from .losses.softmax import SoftmaxRing, backward_rows, split
from .ring.driver import ring_backward, ring_forward
from .ring.layout import RingLayout


@dataclass(frozen=True)
class LossPlan:
    """Everything about a call that is not a tensor: handed to the Function as one argument."""

    backend: BlockBackend
    symmetric: bool
    layout: RingLayout


def device_scale(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The scale as a 0-d tensor in the accumulation dtype on the features' device (no host sync)."""
    return scale.detach().to(device=like.device, dtype=accum_dtype(like.dtype)).reshape(())


class InfLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, scale, labels, plan: LossPlan):
        ring = SoftmaxRing(plan.symmetric)
        scale_t = device_scale(scale, q)
        rows, cols = ring_forward(q, k, scale_t, labels, ring, plan.backend, plan.layout)
        row_loss, col_loss = split(rows, cols)
        if plan.symmetric:
            ctx.save_for_backward(q, k, scale_t, labels, rows[:2], cols[:2])
        else:
            col_loss = row_loss.new_empty(0)
            ctx.save_for_backward(q, k, scale_t, labels, rows[:2])
        ctx.plan = plan
        ctx.scale_meta = (scale.dtype, scale.shape, scale.device)
        ctx.mark_non_differentiable(labels)
        return row_loss, col_loss

    @staticmethod
    @once_differentiable  # the backward is itself a tiled loop: no double backward
    def backward(ctx, g_row, g_col):
        plan: LossPlan = ctx.plan
        q, k, scale_t, labels, row_stats, *rest = ctx.saved_tensors
        ahead = backward_rows(rest[0], g_col) if plan.symmetric else None
        rows = backward_rows(row_stats, g_row)
        dq, dk, dparams = ring_backward(q, k, scale_t, labels, SoftmaxRing(plan.symmetric), plan.backend, plan.layout, rows, ahead)
        scale_grad = None
        if ctx.needs_input_grad[2]:
            dtype, shape, device = ctx.scale_meta
            scale_grad = dparams[0].to(device=device, dtype=dtype).reshape(shape)
        return dq.to(q.dtype), dk.to(k.dtype), scale_grad, None, None
