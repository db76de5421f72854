"""The materializing reference: plain autograd over the full logits, for tests and debugging.

This is the vanilla loss (``F.cross_entropy`` on ``scale * q @ k.T``; for the sigmoid loss
``-F.logsigmoid`` on ``±(scale * q @ k.T + bias)``) and deliberately shares no
compute with the tiled backends, so ``INFCL_BACKEND=reference`` is an independent A/B check. It uses
O(Bq * Bk) memory. Under a ring it all-gathers the features with gradient (as open_clip's
``gather_with_grad=True`` does), so it also checks the ring's gradient convention.
"""

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .contract import accum_dtype
from .masks import MaskOptions, guide_dtype, guide_threshold
from .ring.layout import RingLayout
from .stats import row_info


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


def reference_losses(q, k, scale, labels, symmetric: bool, layout: RingLayout, label_smoothing: float = 0.0):
    """Per-row (and per-column) losses of this rank, computed on materialized logits (``label_smoothing``:
    ``F.cross_entropy``'s)."""
    acc = accum_dtype(q.dtype)
    qa, ka, s = q.to(acc), k.to(acc), scale.to(acc)
    k_all = _gather(ka, layout, layout.k_sizes)
    row_loss = F.cross_entropy(s * qa @ k_all.T, labels, reduction="none", label_smoothing=label_smoothing)
    if not symmetric:
        return row_loss, row_loss.new_empty(0)
    q_all = _gather(qa, layout, layout.q_sizes)
    all_labels = _gather(labels, layout, layout.q_sizes) if layout.world > 1 else labels
    inverse = torch.argsort(all_labels)  # inverse[c] = the row whose positive is column c
    off = layout.k_offsets[layout.rank]
    col_labels = inverse[off : off + k.shape[0]]
    col_loss = F.cross_entropy(s * ka @ q_all.T, col_labels, reduction="none", label_smoothing=label_smoothing)
    return row_loss, col_loss


def _gather_plain(x: torch.Tensor, layout: RingLayout, sizes) -> torch.Tensor:
    """All-gather rows that carry no gradient (ids, labels, guide features)."""
    return x if layout.world == 1 else _GatherRows.apply(x.detach(), layout, sizes)


def masked_reference_losses(
    q, k, scale, labels, symmetric: bool, layout: RingLayout, masks: Optional[MaskOptions], label_smoothing=0.0
):
    """Per-row (and per-column) losses and ``[3, n]`` infos (:mod:`infcl.stats`) of this rank, on
    materialized logits, for any mask options (:mod:`infcl.masks`; None: the plain loss's positives).

    Losses are NaN for rows without a positive. Under a ring the features are gathered with gradient,
    the ids, labels and guide features without.
    """
    acc = accum_dtype(q.dtype)
    qa, ka, s = q.to(acc), k.to(acc), scale.to(acc)
    masks = masks or MaskOptions()
    k_all = _gather(ka, layout, layout.k_sizes)
    k_ids_all = None if masks.k_ids is None else _gather_plain(masks.k_ids, layout, layout.k_sizes)
    gk_all = None if masks.guide_k is None else _gather_plain(masks.guide_k, layout, layout.k_sizes)
    rows = _masked_direction(
        s * qa @ k_all.T, labels, masks.q_ids, k_ids_all, masks.guide_q, gk_all, masks, label_smoothing
    )
    if not symmetric:
        return rows, (None, None)
    q_all = _gather(qa, layout, layout.q_sizes)
    labels_all = _gather_plain(labels, layout, layout.q_sizes)
    q_ids_all = None if masks.q_ids is None else _gather_plain(masks.q_ids, layout, layout.q_sizes)
    gq_all = None if masks.guide_q is None else _gather_plain(masks.guide_q, layout, layout.q_sizes)
    off = layout.k_offsets[layout.rank]
    col_labels = torch.argsort(labels_all)[off : off + k.shape[0]]  # the row whose positive is each column
    cols = _masked_direction(
        s * ka @ q_all.T, col_labels, masks.k_ids, q_ids_all, masks.guide_k, gq_all, masks, label_smoothing
    )
    return rows, cols


def _masked_direction(logits, labels, ids, other_ids, guide, other_guide, masks: MaskOptions, label_smoothing=0.0):
    """(loss [n], info [3, n]) of one direction: rows of ``logits`` [n, m] against its m columns; with
    ``label_smoothing`` eps, (1 - eps) * the loss + eps * (lse - the mean logit over the columns kept)."""
    n, m = logits.shape
    neg_inf = float("-inf")
    one_hot = torch.zeros(n, m, dtype=torch.bool, device=logits.device).scatter_(1, labels[:, None], True)
    same = None if ids is None else ids[:, None] == other_ids[None, :]
    positive = one_hot if masks.multi_positive is None else same
    excluded = torch.zeros_like(positive) if same is None else same.clone()
    if guide is not None:
        gdt = guide_dtype(guide)
        scores = guide.to(gdt) @ other_guide.to(gdt).T
        threshold = guide_threshold(scores.gather(1, labels[:, None]), masks.margin, masks.strategy)
        excluded |= scores > threshold
        # NaN or inf in a guide row: the exclusions of its row (a guide_q row) or of every row (a guide_k
        # row) are undefined, so their losses are NaN (infcl.masks).
        bad = ~torch.isfinite(guide).all(dim=1) | ~torch.isfinite(other_guide).all()
    excluded &= ~positive
    valid = positive.any(dim=1)
    # Rows without a positive have no loss; keep their arithmetic finite so that no NaN reaches a gradient.
    safe_excluded = excluded & valid[:, None]
    safe_positive = positive | ~valid[:, None]
    lse = torch.logsumexp(logits.masked_fill(safe_excluded, neg_inf), dim=1)
    count = safe_positive.sum(dim=1)
    pos_mean = torch.where(safe_positive, logits, 0).sum(dim=1) / count
    if masks.multi_positive == "sum":
        pos_term = torch.logsumexp(logits.masked_fill(~safe_positive, neg_inf), dim=1)
    else:
        pos_term = pos_mean
    loss = torch.where(valid, lse - pos_term, float("nan"))
    if label_smoothing:
        kept = ~safe_excluded
        uniform = lse - torch.where(kept, logits, 0).sum(dim=1) / kept.sum(dim=1)
        loss = (1.0 - label_smoothing) * loss + label_smoothing * uniform
    if guide is not None:  # NaN times the loss: NaN gradients too, as NaN features give
        loss = loss * torch.where(bad, float("nan"), 1.0).to(loss.dtype)
    with torch.no_grad():
        best = logits.masked_fill(excluded, neg_inf).amax(dim=1)
        best_positive = logits.masked_fill(~positive, neg_inf).amax(dim=1)
        hit = torch.where(valid, (best_positive >= best).to(logits.dtype), float("nan"))
        info = row_info(hit, torch.where(valid, pos_mean, float("nan")), valid)
    return loss, info


def sigmoid_reference_losses(q, k, scale, bias, labels, layout: RingLayout, masks: Optional[MaskOptions] = None):
    """Per-row sigmoid (SigLIP) losses of this rank on materialized logits, as open_clip's SigLipLoss
    writes them: ``-logsigmoid(z * (scale * q @ k_all.T + bias)).sum(1)``, z = +1 at the label (with ``masks``:
    wherever the ids match), -1 elsewhere."""
    acc = accum_dtype(q.dtype)
    k_all = _gather(k.to(acc), layout, layout.k_sizes)
    logits = scale.to(acc) * q.to(acc) @ k_all.T + bias.to(acc)
    if masks is None:
        signs = torch.full_like(logits, -1.0).scatter_(1, labels[:, None], 1.0)
    else:
        k_ids_all = _gather_plain(masks.k_ids, layout, layout.k_sizes)
        signs = torch.where(masks.q_ids[:, None] == k_ids_all[None, :], 1.0, -1.0).to(acc)
    return -F.logsigmoid(signs * logits).sum(dim=1)
