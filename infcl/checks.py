"""Input validation for the public API: every problem is a TypeError or ValueError naming the argument.

``assert`` is never used for user input; these checks run before any compute.
"""

import math
import numbers
from typing import Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .masks import MARGIN_STRATEGIES, MULTI_POSITIVE, MaskOptions
from .ring.layout import RingLayout

REDUCTIONS = ("mean", "sum", "none")


def shape_text(t: torch.Tensor) -> str:
    """``t``'s shape as the input errors print it: ``[2, 3]``."""
    return "[" + ", ".join(str(n) for n in t.shape) + "]"


# The layouts of the inputs :func:`check_features` takes: feature vectors, and (MaxSim) tokens' feature vectors.
FEATURES = ("batch", "dim")
TOKENS = ("batch", "tokens", "dim")
_DIM_WORDS = {"dim": "feature", "tokens": "token"}


def check_features(q, k, names=("q", "k"), layout=FEATURES) -> None:
    """q [Bq, ..., D] and k [Bk, ..., D] with the dimensions ``layout`` names: float tensors of one dtype, device
    and D, no dimension empty; ``names`` as the caller calls them."""
    nq, nk = names
    for name, t in ((nq, q), (nk, k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor (float32, bfloat16, float16, float64), got {t.dtype}"
            )
        if t.dim() != len(layout):
            raise ValueError(f"{name} must be {len(layout)}-d [{', '.join(layout)}], got shape {shape_text(t)}")
        if t.shape[0] == 0:
            raise ValueError(f"{name} is an empty batch: shape {shape_text(t)}")
        for size, dim in zip(t.shape[1:], layout[1:]):
            if size == 0:
                raise ValueError(f"{name} has {_DIM_WORDS[dim]} dimension 0: shape {shape_text(t)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{nq} and {nk} must have the same feature dimension: {nq} {shape_text(q)}, {nk} {shape_text(k)}"
        )
    if q.dtype != k.dtype:
        raise TypeError(f"{nq} and {nk} must have the same dtype: {nq} {q.dtype}, {nk} {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"{nq} and {nk} must be on the same device: {nq} on {q.device}, {nk} on {k.device}")


def check_rows_like(name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    """``t`` has one row per row of ``like`` and lives on its device (a guide beside its features, a teacher's
    features beside the student's)."""
    if t.shape[0] != like.shape[0]:
        rows = f"{like_name} {shape_text(like)}, {name} {shape_text(t)}"
        raise ValueError(f"{name} must have one row per row of {like_name}: {rows}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like_name}'s device {like.device}, got {t.device}")


def check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_head_dim(head_dim) -> None:
    # Accepted for call-compatibility with Inf-CL's cal_inf_loss and ignored: every D is supported.
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)):
        raise TypeError(f"head_dim must be None or an int (it is ignored), got {type(head_dim).__name__}")


def make_scale(scale, name: str = "scale") -> torch.Tensor:
    """The logit scale as a tensor that autograd can differentiate (a Python number gets no gradient).

    Accepted: None (1.0); a Python or NumPy real scalar (float or int); a floating tensor or NumPy array
    with one element (0-d, or open_clip's ``[1]`` logit_scale), whose gradient comes back in its shape.
    """
    if scale is None:
        return torch.ones((), dtype=torch.float32)
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{name} must be a float or a one-element floating tensor, got bool")
    if isinstance(scale, numbers.Real):
        return torch.tensor(float(scale), dtype=torch.float64)
    if isinstance(scale, np.ndarray):
        if not np.issubdtype(scale.dtype, np.floating) and not np.issubdtype(scale.dtype, np.integer):
            raise TypeError(f"{name} must be a real number, got a NumPy array of {scale.dtype}")
        if scale.size != 1:
            raise ValueError(f"{name} must have one element, got a NumPy array of shape {list(scale.shape)}")
        return torch.tensor(float(scale.reshape(())), dtype=torch.float64)
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a float or a one-element floating tensor, got {type(scale).__name__}")
    if not scale.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {scale.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"{name} must be a 0-d or one-element tensor, got shape {shape_text(scale)}")
    return scale


def make_bias(bias) -> torch.Tensor:
    """The sigmoid loss's logit bias, accepted as :func:`make_scale` accepts the scale; None means 0."""
    if bias is None:
        return torch.zeros((), dtype=torch.float32)
    return make_scale(bias, "bias")


def local_labels(labels, q: torch.Tensor) -> Optional[torch.Tensor]:
    """Check the labels' type and shape; return them as int64 on q's device, or None.

    Everything that depends on batch sizes or label values is checked by :func:`global_labels`, after
    the ring layout exchange, so that a problem on one rank raises on every rank instead of hanging.
    """
    bq = q.shape[0]
    if integer_rows(labels, "labels", bq, f"[Bq] = [{bq}]") is None:
        return None
    return labels.to(device=q.device, dtype=torch.int64)


def integer_rows(value, name: str, rows: int, shape: str) -> Optional[torch.Tensor]:
    """``value`` if it is None or an integer tensor of shape [rows] (``shape`` says so in the message), else
    a TypeError / ValueError naming ``name``."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be None or an integer tensor, got {type(value).__name__}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    if value.dim() != 1 or value.shape[0] != rows:
        raise ValueError(f"{name} must have shape {shape}, got {shape_text(value)}")
    return value


def global_labels(
    labels: Optional[torch.Tensor], q: torch.Tensor, layout: RingLayout, symmetric: bool, names=("q", "k")
) -> torch.Tensor:
    """Global column index of each local row's positive, checked against every rank's sizes and labels."""
    dim = q.shape[1]
    nq, nk = names
    for rank, (bq, bk, bounds) in enumerate(zip(layout.q_sizes, layout.k_sizes, layout.label_ranges)):
        where = "" if layout.world == 1 else f" on rank {rank}"
        if symmetric and bq != bk:
            raise ValueError(f"symmetric=True needs as many q rows as k rows{where}: q [{bq}, {dim}], k [{bk}, {dim}]")
        if bounds is None and bq != bk:
            raise ValueError(
                f"labels=None means the diagonal, which needs Bq == Bk{where}; "
                f"got {nq} [{bq}, {dim}], {nk} [{bk}, {dim}] "
                f"(pass labels to use the extra {nk} rows as hard negatives)"
            )
        if bounds is not None and (bounds[0] < 0 or bounds[1] >= layout.total_k):
            raise ValueError(
                f"labels must be column indices in [0, {layout.total_k}) (the global k batch), got values in "
                f"[{bounds[0]}, {bounds[1]}]{where}"
            )
    if labels is None:
        labels = torch.arange(q.shape[0], device=q.device) + layout.k_offsets[layout.rank]
        if symmetric and any(bounds is not None for bounds in layout.label_ranges):
            _check_permutation(labels, layout)  # other ranks pass custom labels: check the mix globally
        return labels
    if symmetric:
        _check_permutation(labels, layout)
    return labels


def _check_permutation(labels: torch.Tensor, layout: RingLayout) -> None:
    every = labels
    if layout.world > 1:
        # Each rank holds only its own labels: gather them (padded to the largest rank) to check globally.
        width = max(layout.q_sizes)
        padded = torch.full((width,), -1, dtype=torch.int64, device=labels.device)
        padded[: labels.shape[0]] = labels
        parts = [torch.empty_like(padded) for _ in range(layout.world)]
        dist.all_gather(parts, padded, group=layout.group)
        every = torch.cat([p[:n] for p, n in zip(parts, layout.q_sizes)])
    # Every rank has Bq == Bk here (global_labels checked it), so rows and columns are equally many.
    expected = torch.arange(every.shape[0], device=every.device)
    if not torch.equal(torch.sort(every).values, expected):
        raise ValueError("symmetric=True needs labels that are a permutation of the column indices (each column once)")


def make_id_pair(q, k, q_ids, k_ids, names=("q", "k")) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(q_ids, k_ids) checked (:func:`make_ids`; ``names``: what the messages call q and k), both or neither."""
    qi = make_ids(q_ids, "q_ids", q.shape[0], q, names[0])
    ki = make_ids(k_ids, "k_ids", k.shape[0], k, names[1])
    if (qi is None) != (ki is None):
        given, missing = ("q_ids", "k_ids") if ki is None else ("k_ids", "q_ids")
        raise ValueError(f"{given} was given without {missing}: ids compare a row's id with a column's, pass both")
    return qi, ki


def make_sigmoid_ids(q, k, q_ids, k_ids, labels, names) -> Optional[MaskOptions]:
    """The sigmoid loss's ids (every column with the row's id is a positive) as its mask options, or None;
    ``labels`` must then be None (the ids name the positives)."""
    qi, ki = make_id_pair(q, k, q_ids, k_ids, names)
    if qi is None:
        return None
    if labels is not None:
        raise ValueError("labels and q_ids/k_ids both name the positives: pass labels or the ids, not both")
    return MaskOptions(q_ids=qi, k_ids=ki)


def make_ids(ids, name: str, rows: int, feats: torch.Tensor, feats_name: str) -> Optional[torch.Tensor]:
    """``ids``: None or an integer tensor [rows] on the features' device; returned as contiguous int64 (a
    view such as ``meta[:, 1]`` or an expanded id is copied, O(B): the kernels read ids with stride 1)."""
    if integer_rows(ids, name, rows, f"[{rows}] (one id per row of {feats_name} {shape_text(feats)})") is None:
        return None
    if ids.device != feats.device:
        raise ValueError(f"{name} must be on {feats_name}'s device {feats.device}, got {ids.device}")
    return ids.to(torch.int64).contiguous()


def _guide(guide, q: torch.Tensor, k: torch.Tensor):
    """``guide``: None or a pair (gq [Bq, D'], gk [Bk, D']) of floating tensors of one dtype, on q's device."""
    if guide is None:
        return None, None
    if not isinstance(guide, (tuple, list)) or len(guide) != 2:
        raise TypeError(f"guide must be None or a pair (guide_q, guide_k) of 2-d tensors, got {type(guide).__name__}")
    gq, gk = guide
    for name, t, feats, feats_name in (("guide[0]", gq, q, "q"), ("guide[1]", gk, k, "k")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-d [rows, guide dim], got shape {shape_text(t)}")
        check_rows_like(name, t, feats_name, feats)
    if gq.shape[1] != gk.shape[1] or gq.shape[1] == 0:
        raise ValueError(f"guide[0] and guide[1] must have the same non-zero width: {shape_text(gq)}, {shape_text(gk)}")
    if gq.dtype != gk.dtype:
        raise TypeError(f"guide[0] and guide[1] must have the same dtype: {gq.dtype}, {gk.dtype}")
    return gq.detach(), gk.detach()


def make_masks(q, k, q_ids, k_ids, multi_positive, guide, guide_margin, guide_margin_strategy) -> Optional[MaskOptions]:
    """The call's mask options (:mod:`infcl.masks`) checked, or None when none is used (the plain loss)."""
    if multi_positive not in MULTI_POSITIVE:
        raise ValueError(f"multi_positive must be one of {MULTI_POSITIVE}, got {multi_positive!r}")
    if guide_margin_strategy not in MARGIN_STRATEGIES:
        raise ValueError(f"guide_margin_strategy must be one of {MARGIN_STRATEGIES}, got {guide_margin_strategy!r}")
    if isinstance(guide_margin, (bool, np.bool_)) or not isinstance(guide_margin, numbers.Real):
        raise TypeError(f"guide_margin must be a real number, got {type(guide_margin).__name__}")
    if not math.isfinite(guide_margin):  # math, not numpy: torch.compile traces it without a graph break
        raise ValueError(f"guide_margin must be finite, got {guide_margin}")
    qi, ki = make_id_pair(q, k, q_ids, k_ids)
    if multi_positive is not None and qi is None:
        raise ValueError(
            f"multi_positive={multi_positive!r} needs q_ids and k_ids (positives are the columns with the row's id)"
        )
    gq, gk = _guide(guide, q, k)
    if qi is None and gq is None:
        return None
    return MaskOptions(qi, ki, multi_positive, gq, gk, float(guide_margin), guide_margin_strategy)


def check_label_smoothing(label_smoothing) -> float:
    """``label_smoothing`` checked: a real number in [0, 1] (``F.cross_entropy``'s range), with any mask options
    (:mod:`infcl.losses.smoothing`)."""
    if isinstance(label_smoothing, (bool, np.bool_)) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing must be a real number, got {type(label_smoothing).__name__}")
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:  # also rejects NaN
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    return eps
