"""The fake (shape-only) impls of the block steps' custom ops, one per output shape, shared by every backend that
registers ops: the native extension's (:mod:`infcl.backends.native.build`) and the Triton kernels'
(:mod:`infcl.kernels`). torch.compile and FakeTensor call a fake with the op's arguments in schema order; each
fake reads only the leading arguments its shapes depend on, which both backends' schemas of an op share, and
ignores the rest (ids, guides, a backend's own ``precision`` and ``tiling``). Shapes: :mod:`infcl.contract`.
"""

from typing import Callable

import torch

from .contract import accum_dtype
from .masks import KEPT_ROWS, MASKED_ROWS

Tensor = torch.Tensor


def stats_fake(rows: int, cols: int, symmetric_at: int = 4) -> Callable:
    """The fake of a forward step with outputs (row partials [rows, Bq], column partials [cols, Bk]; [cols, 0]
    unless the argument at position ``symmetric_at`` is true) in the accumulation dtype; q and k come first."""

    def fake(q: Tensor, k: Tensor, *args):
        acc = accum_dtype(q.dtype)
        n_cols = k.shape[0] if args[symmetric_at - 2] else 0
        return q.new_empty(rows, q.shape[0], dtype=acc), q.new_empty(cols, n_cols, dtype=acc)

    return fake


def masked_stats_fake(kept_sums_at: int) -> Callable:
    """The fake of a masked forward step (schema: q, k, scale, pos, symmetric, ..., a ``kept_sums`` flag at
    position ``kept_sums_at`` among the arguments after q and k, or by keyword, default False): row and column
    partials [6, n], [8, n] with ``kept_sums`` (label smoothing's kept logits' sum and number, :mod:`infcl.masks`)."""

    def fake(q: Tensor, k: Tensor, *args, kept_sums: bool = False):
        kept_sums = args[kept_sums_at] if len(args) > kept_sums_at else kept_sums
        rows = KEPT_ROWS if kept_sums else MASKED_ROWS
        return stats_fake(rows, rows)(q, k, *args)

    return fake


def prefix_stats_fake(q: Tensor, k: Tensor, scale, pos, symmetric: bool, dims, *_):
    """The native Matryoshka forward's fake (schema: q, k, scale, pos, symmetric, dims, renormalize): every prefix's
    row partials [3, K, Bq] (max, log-sum, positive) and column stats [2, K, Bk] ([2, K, 0] unless symmetric)."""
    acc, count = accum_dtype(q.dtype), len(dims)
    n_cols = k.shape[0] if symmetric else 0
    return q.new_empty(3, count, q.shape[0], dtype=acc), q.new_empty(2, count, n_cols, dtype=acc)


def masked_prefix_stats_fake(q: Tensor, k: Tensor, scale, pos, symmetric: bool, dims, *_):
    """The native masked Matryoshka forward's fake (schema: q, k, scale, pos, symmetric, dims, renormalize, the mask
    options): every prefix's masked row and column partials [6, K, n] ([6, K, 0] unless symmetric)."""
    acc, count = accum_dtype(q.dtype), len(dims)
    n_cols = k.shape[0] if symmetric else 0
    return q.new_empty(MASKED_ROWS, count, q.shape[0], dtype=acc), q.new_empty(MASKED_ROWS, count, n_cols, dtype=acc)


def dscale_fake(q: Tensor, *_) -> Tensor:
    """Every backward step's fake: the scale's (and bias') gradient [2] in the accumulation dtype (dq and dk are
    updated in place)."""
    return q.new_empty(2, dtype=accum_dtype(q.dtype))


def row_fake(q: Tensor, *_) -> Tensor:
    """A per-row result [Bq] in the accumulation dtype (the sigmoid forward's row losses)."""
    return q.new_empty(q.shape[0], dtype=accum_dtype(q.dtype))


def guide_scores_fake(guide_q: Tensor, *_) -> Tensor:
    """Each row's guide score at its positive [Bq], in the guide's dtype."""
    return guide_q.new_empty(guide_q.shape[0])


def best_positives_fake(q: Tensor, k: Tensor, pos, row_index, col_index, symmetric: bool, *_):
    """The ranks' pass 1 (:class:`infcl.contract.Best` of the rows, then of the columns; [0] unless symmetric)."""
    acc, cols = accum_dtype(q.dtype), k.shape[0] if symmetric else 0
    return tuple(q.new_empty(n, dtype=dtype) for n in (q.shape[0], cols) for dtype in (acc, torch.int64, torch.int64))


def ahead_counts_fake(q: Tensor, k: Tensor, row_score, row_best, col_score, *_):
    """The ranks' pass 2 (:class:`infcl.contract.Ahead` of the rows, then of the columns; [0] without column
    scores)."""
    cols = k.shape[0] if col_score is not None else 0
    return tuple(q.new_empty(n, dtype=torch.int64) for n in (q.shape[0], q.shape[0], cols, cols))


def in_place_fake(*_) -> None:
    """An op that only updates its mutable arguments in place (top-k's running lists, MaxSim's routing into dq and
    dk)."""
    return None


def maxsim_scores_fake(q: Tensor, docs: Tensor, q_weight, docs_mask, with_winners: bool, *_):
    """MaxSim's tile of scores R [Bq, nd] in the accumulation dtype and its winners, int32 [Bq, Lq, nd] ([0, Lq, nd]
    unless ``with_winners``)."""
    bq, lq, nd = q.shape[0], q.shape[1], docs.shape[0]
    raw = q.new_empty(bq, nd, dtype=accum_dtype(q.dtype))
    return raw, q.new_empty(bq if with_winners else 0, lq, nd, dtype=torch.int32)
