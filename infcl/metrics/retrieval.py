"""``retrieval_metrics``: exact R@k, mean and median rank over a whole validation set, without the B x B scores.

open_clip's ``get_clip_metrics`` builds the full score matrix and argsorts it. Here each direction's rank
of a row's positive is counted on the tiles in two passes on the one ring loop
(:func:`infcl.ring.driver.ring_forward`), no-grad, in O(B * D) memory:

1. :class:`infcl.losses.rank.BestPositives`: each row's (and column's) best positive, its score read off the
   tile that holds it (the same product the counts compare with: ties compare equal), and its global index.
2. :class:`infcl.losses.rank.AheadCounts`: the number of columns (rows) ahead of it; the column thresholds
   travel with k, the column counts travel home like a symmetric loss's column partials.

Then each rank gathers the O(B) ranks (an all_gather) and computes the same dict.
The arithmetic: the torch tiles (:mod:`infcl.backends.torch_tiles.rank`), the native kernel
(``csrc/retrieval.cpp``, :mod:`infcl.backends.native.rank`) or the Triton kernels
(:mod:`infcl.backends.triton.rank` on :mod:`infcl.kernels.rank`).
"""

import math
import numbers
from typing import Dict, NamedTuple, Tuple

import torch
import torch.distributed as dist

from ..backends import backend_for
from ..checks import check_features, global_labels, local_labels, make_masks
from ..contract import Ahead, Best, Tensor, accum_dtype
from ..losses.rank import AheadCounts, BestPositives
from ..ring.driver import ring_forward
from ..ring.layout import RingLayout, exchange_layout, rejected_everywhere, ring_group, single_layout

DIRECTIONS = ("image_to_text", "text_to_image")


class DirectionRanks(NamedTuple):
    """One direction's local ranks."""

    rank: Tensor  # [n] float64: 0-based rank of the best positive; NaN where undefined
    valid: Tensor  # [n] bool: the row has a positive (always, without any_positive)


def retrieval_metrics(
    image: Tensor,
    text: Tensor,
    labels=None,
    *,
    ks=(1, 5, 10),
    q_ids=None,
    k_ids=None,
    any_positive: bool = False,
    return_ranks: bool = False,
    group=None,
    backend: str = "auto",
):
    """Exact image->text and text->image retrieval metrics of S = image @ text.T, never materialized.

    Args:
        image: [N, D] image (query) features; any float dtype and strides. Scores are computed in the
            accumulation dtype (float32; float64 for float64 inputs). No scale: a positive scale changes
            no rank (but for the rounding of the products it would add).
        text: [M, D] text features, same dtype and device.
        labels: [N] integer column of each image's positive text, a permutation (so each text has one
            positive image, the image labelled with it); None: the diagonal (N == M). Global indices
            under a ring. Not used with ``any_positive``.
        ks: the k of each R@k, positive ints.
        q_ids, k_ids: [N], [M] integer ids (both or neither), as in :func:`infcl.cal_inf_loss`: a column
            with the row's id other than its positive is not counted against it (duplicate captions), and
            likewise for the text->image direction.
        any_positive: every column with the row's id is a positive, and the rank is that of the
            best-ranked one (COCO's 5 captions per image: N != M allowed); needs the ids. A row with no
            positive gets no rank (NaN) and is left out of its direction's metrics.
        return_ranks: also return ``{"image_to_text": [N_local], "text_to_image": [M_local]}``, each row's
            0-based rank as float64 (exact below 2**53), NaN where undefined.
        group: torch.distributed group to ring over (default: the world when initialized); each rank
            passes its shard and gets the metrics of the global set: the same dict on every rank.
        backend: "auto" (the native kernel for CPU tensors when it is built, else the torch tiles; on CUDA
            the torch tiles until the Triton kernels have run on a GPU, :mod:`infcl.backends.resolve`;
            ``INFCL_BACKEND`` overrides it), "torch", "cpu" or "triton". Every
            backend gives the same ranks wherever its scores are the same bits (always for exact ties);
            "reference" raises NotImplementedError.

    Returns:
        A dict of Python floats with open_clip ``get_clip_metrics``'s keys and values:
        ``{direction}_mean_rank`` = mean(rank) + 1, ``{direction}_median_rank`` = floor(median(rank)) + 1
        (numpy's median: the mean of the two middle ranks for an even count), ``{direction}_R@{k}`` =
        fraction of ranks < k, for direction in ("image_to_text", "text_to_image"). All of a direction's
        values are NaN when a score it compares is NaN (or none of its rows has a positive).
        With ``return_ranks``: ``(metrics, ranks)``.

    Rank: the number of columns scoring strictly higher than the positive, plus those scoring equal with
    a lower global column index: the position of the positive in a *stable* descending sort of the row
    (``torch.argsort(..., descending=True, stable=True)``). With any_positive, the best positive is the
    highest-scoring one, the lowest index among equals.
    """
    ring = ring_group(group)
    with torch.no_grad(), rejected_everywhere(ring):
        backend_impl, ks = _check_args(image, text, ks, q_ids, k_ids, labels, any_positive, return_ranks, backend)
        masks = make_masks(image, text, q_ids, k_ids, "mean" if any_positive else None, None, 0.0, "absolute")
        ids = (None, None) if masks is None else (masks.q_ids, masks.k_ids)
        labels_t = local_labels(labels, image)
    with torch.no_grad():
        layout = (
            exchange_layout(image, text, ring, labels_t, masks)
            if ring is not None
            else single_layout(image.shape[0], text.shape[0], labels_t)
        )
        if any_positive:
            labels_t = torch.full((image.shape[0],), -1, dtype=torch.int64, device=image.device)
        else:
            _check_pairs(image, layout)
            labels_t = global_labels(labels_t, image, layout, True, names=("image", "text"))
        ranks = _ranks(image, text, labels_t, ids, any_positive, backend_impl, layout)
        metrics = {}
        for name, local in zip(DIRECTIONS, ranks):
            sizes = layout.q_sizes if name == "image_to_text" else layout.k_sizes
            every = (_gathered(t, sizes, layout) for t in local)
            metrics.update(_summary(name, *every, ks))
    if return_ranks:
        return metrics, {name: local.rank for name, local in zip(DIRECTIONS, ranks)}
    return metrics


def _check_args(image, text, ks, q_ids, k_ids, labels, any_positive, return_ranks, backend):
    check_features(image, text, names=("image", "text"))
    for name, flag in (("any_positive", any_positive), ("return_ranks", return_ranks)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if isinstance(ks, numbers.Integral):
        ks = (ks,)
    if (
        not isinstance(ks, (tuple, list))
        or not ks
        or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool) and k >= 1 for k in ks)
    ):
        raise ValueError(f"ks must be a non-empty tuple of positive ints, got {ks!r}")
    if any_positive and q_ids is None:
        raise ValueError("any_positive=True needs q_ids and k_ids (the positives are the columns with the row's id)")
    if any_positive and labels is not None:
        raise ValueError("labels are not used with any_positive=True (the positives are the ids' matches): pass None")
    return backend_for(backend, image.device, "rank"), tuple(int(k) for k in ks)


def _check_pairs(image: Tensor, layout: RingLayout) -> None:
    """Without any_positive each text's positive is the image labelled with it: as many of each, per rank."""
    for rank, (n, m) in enumerate(zip(layout.q_sizes, layout.k_sizes)):
        if n != m:
            where = "" if layout.world == 1 else f" on rank {rank}"
            raise ValueError(
                f"retrieval_metrics needs as many image rows as text rows{where} (each text's positive is the image "
                f"labelled with it): image [{n}, {image.shape[1]}], text [{m}, {image.shape[1]}]; for several texts "
                f"per image pass q_ids, k_ids and any_positive=True"
            )


def _ranks(
    image, text, labels, ids, any_positive, backend, layout: RingLayout
) -> Tuple[DirectionRanks, DirectionRanks]:
    """Both directions' local ranks: the two passes on the ring."""
    dev = image.device
    row_index = torch.arange(image.shape[0], device=dev) + layout.q_offsets[layout.rank]
    col_index = torch.arange(text.shape[0], device=dev) + layout.k_offsets[layout.rank]
    one = torch.ones((), dtype=accum_dtype(image.dtype), device=dev)  # Block needs a scale; the ranks use none
    best = BestPositives(row_index, col_index, ids, any_positive)
    rows, cols = ring_forward(image, text, one, labels, best, backend, layout)
    counts = AheadCounts(rows, cols, row_index, col_index, ids, any_positive)
    ahead_rows, ahead_cols = ring_forward(image, text, one, labels, counts, backend, layout)
    return _direction(rows, ahead_rows), _direction(cols, ahead_cols)


def _direction(best: Best, counts: Ahead) -> DirectionRanks:
    valid = best.count > 0
    rank = torch.where(valid & (counts.nonfinite == 0), counts.ahead.to(torch.float64), float("nan"))
    return DirectionRanks(rank, valid)


def _gathered(local: Tensor, sizes, layout: RingLayout) -> Tensor:
    """Every rank's ``local`` [sizes[r]] concatenated in rank order (itself for one process)."""
    if layout.world == 1:
        return local
    padded = local.new_zeros(max(sizes))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(layout.world)]
    dist.all_gather(parts, padded, group=layout.group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def _summary(name: str, rank: Tensor, valid: Tensor, ks) -> Dict[str, float]:
    """open_clip's keys from one direction's global ranks (rows without a positive left out)."""
    kept = rank[valid].cpu()
    n = kept.numel()
    if n == 0 or bool(torch.isnan(kept).any()):
        nan = float("nan")
        return {f"{name}_mean_rank": nan, f"{name}_median_rank": nan, **{f"{name}_R@{k}": nan for k in ks}}
    ordered = torch.sort(kept).values
    median = (float(ordered[(n - 1) // 2]) + float(ordered[n // 2])) / 2
    out = {f"{name}_mean_rank": float(kept.mean()) + 1, f"{name}_median_rank": math.floor(median) + 1.0}
    for k in ks:
        out[f"{name}_R@{k}"] = float((kept < k).to(torch.float64).mean())
    return out
