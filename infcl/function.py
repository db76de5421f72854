"""The autograd Functions behind ``cal_inf_loss``, ``cal_siglip_loss``, ``cal_distill_loss`` and ``cal_maxsim_loss``
for every non-reference backend, all on the one ring driver.

:class:`InfLossFunction` (softmax): forward runs the ring driver with the softmax loss's block steps and
returns per-row (and, for the symmetric loss, per-column) losses ``(max - positive) + rel``; it saves
only q, k, the labels and the ``[2, n]`` log-sum-exp stats (with mask options, the whole
:class:`~infcl.losses.softmax.MaskedPartials`). Backward hands the named upstream inputs (stats and upstream
gradients, per row and per column) to the driver, which recomputes the tiles.

:class:`SigmoidLossFunction` (SigLIP): the same driver with the sigmoid loss's block steps; it saves
only q, k, the labels, the scale and the bias (the backward needs no forward statistics).

:class:`SigmoidOnePassFunction` (SigLIP reduced by "mean" or "sum", on a backend that takes a block's loss and
gradient in one pass: the chunked route): its forward takes the loss and the gradient for a unit upstream
gradient at once and saves dq, dk (float32) and the parameters' gradients; its backward scales them.

:class:`DistillLossFunction` (open_clip's distillation term): the same driver with the distillation loss's
block steps (:mod:`infcl.losses.distill`); it saves q, k, the teacher's features and scale and the ``[4, n]``
stats (the student's and the teacher's); the teacher gets no gradient.
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .contract import accum_dtype
from .losses.distill import DistillSteps, DistillUpstream
from .losses.matryoshka import MaskedMatryoshkaSteps, MatryoshkaSteps
from .losses.maxsim import MaxSimSteps
from .losses.sigmoid import SigmoidOnePassSteps, SigmoidSteps, SigmoidUpstream
from .losses.smoothing import SmoothedIdsSteps, SmoothedKeptSteps, SmoothedSoftmaxSteps
from .losses.softmax import GuideScores, MaskedSoftmaxSteps, SoftmaxSteps
from .masks import MaskOptions, guide_dtype, guide_threshold
from .matryoshka import Prefixes
from .ring.driver import ring_backward, ring_forward
from .ring.layout import RingLayout


@dataclass(frozen=True)
class LossPlan:
    """Everything about a call that is not a tensor: handed to the Function as one argument."""

    backend: object  # the backend object (infcl.backends.resolve.backend_object): the loss's block operations
    symmetric: bool
    layout: RingLayout
    masks: Optional[MaskOptions] = None  # ids / multi-positive / guide options (softmax); ids (sigmoid)
    label_smoothing: float = 0.0  # the softmax loss's eps (infcl.losses.smoothing; softmax only)
    prefixes: Optional[Prefixes] = None  # Matryoshka prefixes (infcl.matryoshka; MatryoshkaLossFunction only)


def device_scale(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The scale as a 0-d tensor in the accumulation dtype on the features' device (no host sync)."""
    return scale.detach().to(device=like.device, dtype=accum_dtype(like.dtype)).reshape(())


def _param_meta(param: torch.Tensor):
    return param.dtype, param.shape, param.device


def _param_grad(needed: bool, grad: torch.Tensor, meta):
    """A loss parameter's gradient back in the dtype, shape and device the caller passed (None if unneeded)."""
    if not needed:
        return None
    dtype, shape, device = meta
    return grad.to(device=device, dtype=dtype).reshape(shape)


def _stats_loss_forward(ctx, q, k, scale, labels, plan: LossPlan, ring):
    """The forward of a loss whose ring steps keep per-line stats (:class:`InfLossFunction`,
    :class:`MatryoshkaLossFunction`): (row losses, column losses, row infos, column infos), the column ones empty
    ([..., 0]) for the one-directional loss; saves q, k, the scale, the labels and ``ring.saved`` of each side."""
    scale_t = device_scale(scale, q)
    rows, cols = ring_forward(q, k, scale_t, labels, ring, plan.backend, plan.layout)
    row_loss, row_info, saved = ring.losses(rows), rows.info(), ring.saved(rows)
    if plan.symmetric:
        col_loss, col_info = ring.losses(cols), cols.info()
        saved += ring.saved(cols)
    else:
        col_loss, col_info = row_loss.new_empty(*row_loss.shape[:-1], 0), row_info.new_empty(*row_info.shape[:-1], 0)
    ctx.save_for_backward(q, k, scale_t, labels, *saved)
    ctx.plan, ctx.ring, ctx.n_saved = plan, ring, len(ring.saved(rows))
    ctx.scale_meta = _param_meta(scale)
    ctx.mark_non_differentiable(labels, row_info, col_info)
    return row_loss, col_loss, row_info, col_info


def _stats_loss_backward(ctx, g_row, g_col):
    """The backward of :func:`_stats_loss_forward`: (dq, dk, dscale, None, None)."""
    plan: LossPlan = ctx.plan
    q, k, scale_t, labels, *saved = ctx.saved_tensors
    rows = ctx.ring.upstream(saved[: ctx.n_saved], g_row)
    cols = ctx.ring.upstream(saved[ctx.n_saved :], g_col) if plan.symmetric else None
    dq, dk, dparams = ring_backward(q, k, scale_t, labels, ctx.ring, plan.backend, plan.layout, rows, cols)
    scale_grad = _param_grad(ctx.needs_input_grad[2], dparams[0], ctx.scale_meta)
    return dq.to(q.dtype), dk.to(k.dtype), scale_grad, None, None


class InfLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, scale, labels, plan: LossPlan):
        """(row losses [Bq], column losses [Bk] or empty, row info [3, Bq], column info [3, Bk] or empty):
        the infos (:mod:`infcl.stats`) carry no gradient."""
        return _stats_loss_forward(ctx, q, k, scale, labels, plan, _softmax_ring(q, k, labels, plan))

    @staticmethod
    @once_differentiable  # the backward is itself a tiled loop: no double backward
    def backward(ctx, g_row, g_col, _g_row_info, _g_col_info):
        return _stats_loss_backward(ctx, g_row, g_col)


def _softmax_ring(q, k, labels, plan: LossPlan) -> SoftmaxSteps:
    """The softmax loss's ring steps: plain, or with the mask options (the guide thresholds found first,
    :class:`GuideScores`, and set on the one :class:`~infcl.masks.MaskOptions` value the ring carries on)."""
    masks = plan.masks
    if masks is None and plan.label_smoothing:
        layout = plan.layout
        return SmoothedSoftmaxSteps(plan.symmetric, plan.label_smoothing, layout.total_k, layout.total_q)
    if masks is None:
        return SoftmaxSteps(plan.symmetric)
    # Label smoothing over the kept columns: summed by the tiles that decide them where the backend's do
    # (``kept_sums``; a guide always runs on such a backend: infcl.api.smoothing_backend), else from ids.
    kept_in_tiles = getattr(plan.backend, "kept_sums", False)
    if plan.label_smoothing and not kept_in_tiles:
        return SmoothedIdsSteps(plan.symmetric, plan.label_smoothing, masks)
    masks = _with_thresholds(q, labels, plan)
    if plan.label_smoothing:
        return SmoothedKeptSteps(plan.symmetric, plan.label_smoothing, masks)
    return MaskedSoftmaxSteps(plan.symmetric, masks)


def _with_thresholds(q, labels, plan: LossPlan) -> MaskOptions:
    """The call's mask options with the guide thresholds set (a pass of :class:`GuideScores` on the one ring loop,
    the guide features in their accumulation dtype), or as they are without a guide."""
    masks = plan.masks
    if not masks.has_guide:
        return masks
    gdt = guide_dtype(masks.guide_q)
    guide_q, guide_k = masks.guide_q.to(gdt), masks.guide_k.to(gdt)
    scores = GuideScores(plan.symmetric, q.dtype)
    rows, cols = ring_forward(guide_q, guide_k, None, labels, scores, plan.backend, plan.layout)
    col_threshold = guide_threshold(cols.score, masks.margin, masks.strategy) if plan.symmetric else None
    return replace(
        masks,
        guide_q=guide_q,
        guide_k=guide_k,
        row_threshold=guide_threshold(rows.score, masks.margin, masks.strategy),
        col_threshold=col_threshold,
    )


def _matryoshka_ring(q, labels, plan: LossPlan):
    """The Matryoshka loss's ring steps: plain, or with the mask options (thresholds set once: the guide features
    are never truncated, so every prefix shares them) on a backend with ``masked_matryoshka``."""
    if plan.masks is None:
        return MatryoshkaSteps(plan.symmetric, plan.prefixes)
    return MaskedMatryoshkaSteps(plan.symmetric, _with_thresholds(q, labels, plan), plan.prefixes)


class MatryoshkaLossFunction(torch.autograd.Function):
    """(row losses [K, Bq], column losses [K, Bk] or empty, row infos [K, 3, Bq], column infos [K, 3, Bk] or
    empty): the softmax loss of each Matryoshka prefix (:mod:`infcl.matryoshka`, increasing dims), out of one
    tiled pass forward and one backward; saves q, k, the scale, the labels and the ``[2, K, n]`` stats (with mask
    options, the whole :class:`~infcl.losses.matryoshka.PrefixMaskedPartials`)."""

    @staticmethod
    def forward(ctx, q, k, scale, labels, plan: LossPlan):
        return _stats_loss_forward(ctx, q, k, scale, labels, plan, _matryoshka_ring(q, labels, plan))

    @staticmethod
    @once_differentiable  # the backward is itself a tiled loop: no double backward
    def backward(ctx, g_row, g_col, _g_row_info, _g_col_info):
        return _stats_loss_backward(ctx, g_row, g_col)


class SigmoidLossFunction(torch.autograd.Function):
    """Per-row sigmoid losses ``[Bq]`` of this rank's rows against the global k (see ``cal_siglip_loss``)."""

    @staticmethod
    def forward(ctx, q, k, scale, bias, labels, plan: LossPlan):
        scale_t, bias_t = device_scale(scale, q), device_scale(bias, q)
        rows, _ = ring_forward(q, k, scale_t, labels, SigmoidSteps(bias_t, plan.masks), plan.backend, plan.layout)
        ctx.save_for_backward(q, k, scale_t, bias_t, labels)
        ctx.plan = plan
        ctx.param_meta = (_param_meta(scale), _param_meta(bias))
        return rows.loss

    @staticmethod
    @once_differentiable  # the backward is itself a tiled loop: no double backward
    def backward(ctx, g_row):
        plan: LossPlan = ctx.plan
        q, k, scale_t, bias_t, labels = ctx.saved_tensors
        # The upstream gradient of a mean is an expanded (stride 0) vector: an O(B) copy makes it plain.
        rows = SigmoidUpstream(g_row.to(scale_t.dtype).contiguous())
        ring = SigmoidSteps(bias_t, plan.masks)
        dq, dk, dparams = ring_backward(q, k, scale_t, labels, ring, plan.backend, plan.layout, rows, None)
        grads = [_param_grad(ctx.needs_input_grad[2 + i], dparams[i], meta) for i, meta in enumerate(ctx.param_meta)]
        return dq.to(q.dtype), dk.to(k.dtype), *grads, None, None


def one_pass_sigmoid(backend, reduction: str, needs_grad: bool, layout: RingLayout) -> bool:
    """Whether a sigmoid loss call runs :class:`SigmoidOnePassFunction`: a reduced loss ("mean", "sum": every row's
    upstream gradient the same) whose gradient is wanted, on a backend with ``sigmoid_loss_and_grad_block``, in a
    single process. Under a ring, dk sums every rank's rows, each under its own rank's upstream gradient, which the
    forward cannot know: the ring runs the two-pass Function (its blocks still on the backend's route)."""
    one_pass = hasattr(backend, "sigmoid_loss_and_grad_block")
    return needs_grad and reduction in ("mean", "sum") and one_pass and layout.world == 1


class SigmoidOnePassFunction(torch.autograd.Function):
    """The sigmoid loss reduced by ``reduction`` ("mean" over the rows, or "sum"), 0-d.

    Forward: the ring's backward loop (one process: the ring of one) with a unit upstream gradient
    (:class:`SigmoidOnePassSteps`) gives each row's loss and dq, dk and the (scale, bias) gradients of the rows' sum
    at once; they are saved (float32, O(B * D)).
    Backward: the upstream gradient g times the reduction's weight (1 / Bq for "mean") times the saved gradients:
    exact, since every row's upstream gradient is that one weight. A single process only (:func:`one_pass_sigmoid`:
    under a ring, dk would mix other ranks' upstream gradients)."""

    @staticmethod
    def forward(ctx, q, k, scale, bias, labels, plan: LossPlan, reduction: str):
        scale_t, bias_t = device_scale(scale, q), device_scale(bias, q)
        steps = SigmoidOnePassSteps(bias_t, plan.masks)
        rows = steps.init_rows(q.shape[0], scale_t.dtype, q.device)
        dq, dk, dparams = ring_backward(q, k, scale_t, labels, steps, plan.backend, plan.layout, rows, None)
        ctx.save_for_backward(dq, dk, dparams)
        ctx.weight = 1.0 / max(q.shape[0], 1) if reduction == "mean" else 1.0
        ctx.dtypes = (q.dtype, k.dtype)
        ctx.param_meta = (_param_meta(scale), _param_meta(bias))
        return rows.loss.mean() if reduction == "mean" else rows.loss.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        dq, dk, dparams = ctx.saved_tensors
        weight = g.to(dq.dtype) * ctx.weight
        grads = [
            _param_grad(ctx.needs_input_grad[2 + i], dparams[i] * weight, meta) for i, meta in enumerate(ctx.param_meta)
        ]
        return (dq * weight).to(ctx.dtypes[0]), (dk * weight).to(ctx.dtypes[1]), *grads, None, None, None


class DistillLossFunction(torch.autograd.Function):
    """(row losses [Bq], column losses [Bk] or empty) of the student against the teacher (see
    ``cal_distill_loss``); the teacher's features and scale get no gradient."""

    @staticmethod
    def forward(ctx, q, k, scale, teacher_q, teacher_k, teacher_scale, plan: LossPlan):
        acc = accum_dtype(q.dtype)
        scale_t = device_scale(scale, q)
        teacher = (teacher_q.detach().to(acc), teacher_k.detach().to(acc), device_scale(teacher_scale, q))
        ring = DistillSteps(plan.symmetric, *teacher)
        labels = torch.full((q.shape[0],), -1, dtype=torch.int64, device=q.device)  # no positives: no one-hot
        rows, cols = ring_forward(q, k, scale_t, labels, ring, plan.backend, plan.layout)
        row_loss = rows.losses()
        col_loss = cols.losses() if plan.symmetric else row_loss.new_empty(0)
        # The backward's global stats, packed as the backends take them: [4, n] (the student's, the teacher's).
        saved = (torch.cat((rows.student, rows.teacher)),)
        if plan.symmetric:
            saved += (torch.cat((cols.student, cols.teacher)),)
        ctx.save_for_backward(q, k, scale_t, *teacher, labels, *saved)
        ctx.plan, ctx.scale_meta = plan, _param_meta(scale)
        return row_loss, col_loss

    @staticmethod
    @once_differentiable  # the backward is itself a tiled loop: no double backward
    def backward(ctx, g_row, g_col):
        plan: LossPlan = ctx.plan
        q, k, scale_t, tq, tk, tscale, labels, *saved = ctx.saved_tensors
        acc = scale_t.dtype
        rows = DistillUpstream(saved[0], g_row.to(acc).contiguous())
        cols = DistillUpstream(saved[1], g_col.to(acc).contiguous()) if plan.symmetric else None
        ring = DistillSteps(plan.symmetric, tq, tk, tscale)
        dq, dk, dparams = ring_backward(q, k, scale_t, labels, ring, plan.backend, plan.layout, rows, cols)
        scale_grad = _param_grad(ctx.needs_input_grad[2], dparams[0], ctx.scale_meta)
        return dq.to(q.dtype), dk.to(k.dtype), scale_grad, None, None, None, None


class MaxSimLossFunction(torch.autograd.Function):
    """Per-query losses ``[Bq]`` and info ``[3, Bq]`` of the MaxSim loss (see ``cal_maxsim_loss``): q [Bq, Lq, D]
    and the documents [Bk, Lk, D] get gradients, the token weights, masks and ids (in ``steps``) none. Saves q, the
    documents, the labels and the ``[2, Bq]`` stats."""

    @staticmethod
    def forward(ctx, q, docs, scale, labels, plan: LossPlan, steps: MaxSimSteps):
        scale_t = device_scale(scale, q)
        rows, _ = ring_forward(q, docs, scale_t, labels, steps, plan.backend, plan.layout)
        loss, info = steps.losses(rows), rows.info()
        ctx.save_for_backward(q, docs, scale_t, labels, *steps.saved(rows))
        ctx.plan, ctx.steps, ctx.scale_meta = plan, steps, _param_meta(scale)
        ctx.mark_non_differentiable(info)
        return loss, info

    @staticmethod
    @once_differentiable  # the backward is itself a tiled loop: no double backward
    def backward(ctx, g_row, _g_info):
        plan: LossPlan = ctx.plan
        q, docs, scale_t, labels, *saved = ctx.saved_tensors
        rows = ctx.steps.upstream(saved, g_row)
        dq, dk, dparams = ring_backward(q, docs, scale_t, labels, ctx.steps, plan.backend, plan.layout, rows, None)
        scale_grad = _param_grad(ctx.needs_input_grad[2], dparams[0], ctx.scale_meta)
        return dq.to(q.dtype), dk.to(docs.dtype), scale_grad, None, None, None
