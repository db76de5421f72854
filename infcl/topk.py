"""``topk_scores``: each query's n best corpus columns of q @ k.T, exactly, without the Bq x Bk scores.

The walk of the retrieval ranks (:mod:`infcl.metrics.retrieval`): the same tiles, the same products, on the
one ring loop, with a short list per row instead of a count. The ring step is :mod:`infcl.losses.topk`; the
block operation (:mod:`infcl.contract`) is the torch tiles' (:mod:`infcl.backends.torch_tiles.topk`), the
native kernel's (:mod:`infcl.backends.native.topk`, ``csrc/topk.cpp``) or the Triton kernel's
(:mod:`infcl.backends.triton.topk`, :mod:`infcl.kernels.topk`). docs/topk.md has the rules.
"""

import numbers

import torch
import torch.distributed as dist

from .backends import backend_for
from .checks import check_features, integer_rows, make_ids
from .losses.topk import TopK, ring_topk
from .ring.layout import RingLayout, exchange_layout, rejected_everywhere, ring_group, single_layout

__all__ = ["TopK", "topk_scores"]


def topk_scores(
    q,
    k,
    n,
    *,
    labels=None,
    exclude_labels: bool = False,
    q_ids=None,
    k_ids=None,
    largest: bool = True,
    group=None,
    backend: str = "auto",
) -> TopK:
    """Each row's ``n`` best columns of S = q @ k.T and their scores, exactly, in O((Bq + Bk) * D + Bq * n)
    memory: S is walked tile by tile and never held whole.

    Args:
        q: [Bq, D] queries; any float dtype (float32, bfloat16, float16, float64) and strides.
        k: [Bk, D] the corpus (under a ring: this rank's shard), q's dtype and device.
        n: how many columns per row, an int >= 1; may exceed the number of columns.
        labels: [Bq] integer global column of each row's positive (-1: none), read only with
            ``exclude_labels=True``, which leaves that column out of the row's list.
        q_ids, k_ids: [Bq], [Bk] integer ids (both or neither): a column whose id equals the row's id is
            left out (the row's own document, its known positives, duplicates).
        largest: the n highest scores (True) or the n lowest (False).
        group: torch.distributed group to ring over (default: the world when initialized). Each rank
            passes its local rows and its shard of the corpus; column indices are global (a shard's
            columns follow those of the ranks before it) and each rank gets its rows' global n best.
        backend: "auto" (the native kernel for CPU tensors when it is built, else the torch tiles; on
            CUDA the torch tiles until the Triton kernel has run on a GPU, :mod:`infcl.backends.resolve`;
            ``INFCL_BACKEND`` overrides it), "torch", "cpu" or "triton"; "reference" raises
            NotImplementedError (it would hold S).

    Returns:
        :class:`TopK` ``(scores, indices)``: scores [Bq, n] in the accumulation dtype (float32; float64
        for float64 inputs), indices [Bq, n] int64, best first.

    Order: by score (descending for ``largest``, else ascending), equal scores by lower global column
    index first: a *stable* sort of the row (the ranks' rule). A slot past the row's eligible columns
    has index -1 and score -inf (``largest``) or +inf. A row with a NaN score among its eligible columns
    has NaN scores and index -1 in every slot (its order is undefined); infinite scores order as numbers.
    Scores are computed in the accumulation dtype, one tile product per entry; the same scores give the
    same indices on every backend, thread count and world size (the order is strict, so the n best of a
    union are the n best of its parts' n best).
    """
    ring = ring_group(group)
    with torch.no_grad(), rejected_everywhere(ring):
        n, labels_t, q_ids_t, k_ids_t = _check_args(q, k, n, labels, exclude_labels, q_ids, k_ids, largest)
        block_backend = backend_for(backend, q.device, "topk")
    with torch.no_grad():
        if ring is not None:
            layout = exchange_layout(q, k, ring, labels_t)
            _check_alike(layout, n, largest, labels_t is not None, q_ids_t is not None, q.device)
        else:
            layout = single_layout(q.shape[0], k.shape[0], labels_t)
        _check_label_range(layout)
        return ring_topk(q, k, n, labels_t, q_ids_t, k_ids_t, largest, block_backend, layout)


def _check_args(q, k, n, labels, exclude_labels, q_ids, k_ids, largest):
    check_features(q, k)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for name, flag in (("exclude_labels", exclude_labels), ("largest", largest)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    bq = q.shape[0]
    labels_t = integer_rows(labels, "labels", bq, f"[Bq] = [{bq}] (one column per row of q {list(q.shape)})")
    if exclude_labels and labels_t is None:
        raise ValueError("exclude_labels=True needs labels: the global column of each row's positive (-1: none)")
    if labels_t is not None and not exclude_labels:
        raise ValueError("labels are only read with exclude_labels=True (they name the columns to leave out)")
    if labels_t is not None:
        if labels_t.device != q.device:
            raise ValueError(f"labels must be on q's device {q.device}, got {labels_t.device}")
        labels_t = labels_t.to(torch.int64)
    qi = make_ids(q_ids, "q_ids", bq, q, "q")
    ki = make_ids(k_ids, "k_ids", k.shape[0], k, "k")
    if (qi is None) != (ki is None):
        given, missing = ("q_ids", "k_ids") if ki is None else ("k_ids", "q_ids")
        raise ValueError(f"{given} was given without {missing}: ids compare a row's id with a column's, pass both")
    return int(n), labels_t, qi, ki


def _check_label_range(layout: RingLayout) -> None:
    for rank, bounds in enumerate(layout.label_ranges):
        if bounds is not None and (bounds[0] < -1 or bounds[1] >= layout.total_k):
            where = "" if layout.world == 1 else f" on rank {rank}"
            raise ValueError(
                f"labels must be global column indices in [0, {layout.total_k}) or -1 (none), got values in "
                f"[{bounds[0]}, {bounds[1]}]{where}"
            )


def _check_alike(layout: RingLayout, n: int, largest: bool, labelled: bool, ids: bool, device) -> None:
    """Every rank must ask the same question (n, largest, exclude_labels, ids): one small all_gather."""
    mine = torch.tensor([n, largest, labelled, ids], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(layout.world)]
    dist.all_gather(every, mine, group=layout.group)
    rows = torch.stack(every).cpu().tolist()
    if any(row != rows[0] for row in rows):
        described = ", ".join(
            f"rank {r}: n={row[0]} largest={bool(row[1])} exclude_labels={bool(row[2])} ids={bool(row[3])}"
            for r, row in enumerate(rows)
        )
        raise ValueError(f"topk_scores needs one n, largest, exclude_labels and ids on every rank; got {described}")
