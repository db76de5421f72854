"""The materializing reference: plain autograd over the full logits, for tests and debugging.

This is the vanilla loss (``F.cross_entropy`` on ``scale * q @ k.T``; for the sigmoid loss
``-F.logsigmoid`` on ``±(scale * q @ k.T + bias)``) and deliberately shares no
compute with the tiled backends, so ``INFCL_BACKEND=reference`` is an independent A/B check. It uses
O(Bq * Bk) memory. Under a ring it all-gathers the features with gradient (as open_clip's
``gather_with_grad=True`` does), so it also checks the ring's gradient convention.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .backends.base import accum_dtype
from .ring.layout import RingLayout


class _GatherRows(torch.autograd.Function):
    """All-gather rows of every rank (uneven sizes allowed); backward sums every rank's gradient."""

    @staticmethod
    def forward(ctx, x, layout: RingLayout, sizes):
        width = max(sizes)
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(layout.world)]
        dist.all_gather(parts, padded, group=layout.group)
        ctx.layout, ctx.sizes = layout, sizes
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.layout.group)
        start = sum(ctx.sizes[: ctx.layout.rank])
        return grad[start : start + ctx.sizes[ctx.layout.rank]], None, None


def _gather(x: torch.Tensor, layout: RingLayout, sizes) -> torch.Tensor:
    return x if layout.world == 1 else _GatherRows.apply(x, layout, sizes)


def reference_losses(q, k, scale, labels, symmetric: bool, layout: RingLayout):
    """Per-row (and per-column) losses of this rank, computed on materialized logits."""
    acc = accum_dtype(q.dtype)
    qa, ka, s = q.to(acc), k.to(acc), scale.to(acc)
    k_all = _gather(ka, layout, layout.k_sizes)
    row_loss = F.cross_entropy(s * qa @ k_all.T, labels, reduction="none")
    if not symmetric:
        return row_loss, row_loss.new_empty(0)
    q_all = _gather(qa, layout, layout.q_sizes)
    all_labels = _gather(labels, layout, layout.q_sizes) if layout.world > 1 else labels
    inverse = torch.argsort(all_labels)  # inverse[c] = the row whose positive is column c
    off = layout.k_offsets[layout.rank]
    col_loss = F.cross_entropy(s * ka @ q_all.T, inverse[off : off + k.shape[0]], reduction="none")
    return row_loss, col_loss


def sigmoid_reference_losses(q, k, scale, bias, labels, layout: RingLayout):
    """Per-row sigmoid (SigLIP) losses of this rank on materialized logits, as open_clip's SigLipLoss
    writes them: ``-logsigmoid(z * (scale * q @ k_all.T + bias)).sum(1)``, z = +1 at the label, -1 elsewhere."""
    acc = accum_dtype(q.dtype)
    k_all = _gather(k.to(acc), layout, layout.k_sizes)
    logits = scale.to(acc) * q.to(acc) @ k_all.T + bias.to(acc)
    signs = torch.full_like(logits, -1.0).scatter_(1, labels[:, None], 1.0)
    return -F.logsigmoid(signs * logits).sum(dim=1)

