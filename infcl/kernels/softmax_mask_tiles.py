"""The mask options formed inside a tile (:mod:`infcl.masks`): each tile's positives and exclusions from the
ids of its rows and columns and, with a guide, the guide scores of one more product over D'; the positives'
partials; the masked dS, which keeps every positive's entry a single expm1 (an all-excluded line's stats
are the empty set's: :func:`infcl.kernels.tile_stats.kept_rest_stats`).

Compiled only where a launch sets HAS_IDS or HAS_GUIDE; the plain loss's kernels never reach them.
"""

from typing import Any, NamedTuple

import triton
import triton.language as tl

from .score_tiles import load_vector, score_chunks
from .tile_stats import exp, expm1, kept_rest_stats, merge_kept_stats

# The POSITIVES constexpr (configs.POSITIVES): one positive per row at ``pos`` (multi_positive None),
# or every column with the row's id, the loss taking their mean ("mean") or their log-sum-exp ("sum").
ONE_POSITIVE = tl.constexpr(0)
MEAN_POSITIVES = tl.constexpr(1)
SUM_POSITIVES = tl.constexpr(2)


class Masks(NamedTuple):
    """What a softmax kernel knows of each row's positives and exclusions (:mod:`infcl.masks`), packed once by
    the kernel entry: ``pos`` (the column of each row's one positive in this block, -1: elsewhere), the ids'
    and guide thresholds' pointers (None: absent), the guide operands (:class:`Matrix` gq [n_q, D'] and gk
    [n_k, D']: their row counts are the block's even without a guide), the guide's S tile and dot, and the
    constexprs: HAS_IDS, HAS_GUIDE, POSITIVES, BRANCH_POSITIVES (:func:`infcl.kernels.tile_stats.holds_positive`),
    SYMMETRIC and KEPT_SUMS (label smoothing's uniform part over the kept entries, :mod:`infcl.losses.smoothing`:
    the forward also sums and counts each line's kept logits, :func:`kept_sums`; the backward subtracts each
    line's uniform weight from dS on its kept entries, :func:`subtract_uniform`)."""

    pos_ptr: Any
    q_ids_ptr: Any
    k_ids_ptr: Any
    row_thr_ptr: Any
    col_thr_ptr: Any
    gq: Any
    gk: Any
    tile: Any
    dot: Any
    HAS_IDS: Any
    HAS_GUIDE: Any
    POSITIVES: Any
    BRANCH_POSITIVES: Any
    SYMMETRIC: Any
    KEPT_SUMS: Any


@triton.jit
def tile_masks(masks, rows, cols, pos, q_ids, k_ids, scores, row_thr, col_thr):
    """(positive, excluded_rows, excluded_cols) [BLOCK_M, BLOCK_N] bool of one tile (see infcl.masks).

    positive: the one-hot of ``pos`` (ONE_POSITIVE) or q_ids[i] == k_ids[j] on the block's real rows and
    columns. excluded_rows: (same id, with one positive per row) or guide score ``scores`` above the row's
    threshold, and not a positive; excluded_cols the same with the columns' thresholds (SYMMETRIC; else
    it is excluded_rows). Where nothing can be excluded (no guide; ids with several positives) both are
    ``positive``, unused.
    """
    HAS_IDS: tl.constexpr = masks.HAS_IDS
    POSITIVES: tl.constexpr = masks.POSITIVES
    tl.static_assert(HAS_IDS or POSITIVES == ONE_POSITIVE)  # several positives are named by ids
    if POSITIVES == ONE_POSITIVE:
        positive = cols[None, :] == pos[:, None]  # pos is -1 past n_q and where it lies in another block
    else:
        positive = q_ids[:, None] == k_ids[None, :]
        if masks.tile.MASK_M:
            positive = positive & (rows[:, None] < masks.gq.n)
        if masks.tile.MASK_N:
            positive = positive & (cols[None, :] < masks.gk.n)
    if masks.HAS_GUIDE:
        excluded_rows = scores > row_thr[:, None]
        if masks.SYMMETRIC:
            excluded_cols = scores > col_thr[None, :]
        else:
            excluded_cols = excluded_rows
        if HAS_IDS and POSITIVES == ONE_POSITIVE:
            same = q_ids[:, None] == k_ids[None, :]
            excluded_rows = excluded_rows | same
            excluded_cols = excluded_cols | same
        excluded_rows = excluded_rows & ~positive
        excluded_cols = excluded_cols & ~positive
    elif HAS_IDS and POSITIVES == ONE_POSITIVE:
        excluded_rows = (q_ids[:, None] == k_ids[None, :]) & ~positive
        excluded_cols = excluded_rows
    else:
        excluded_rows = positive  # unused: nothing is excluded
        excluded_cols = positive
    return positive, excluded_rows, excluded_cols


@triton.jit
def load_optional(ptr, idx, n, PRESENT: tl.constexpr, MASK: tl.constexpr):
    """An optional per-row (per-column) vector at ``idx``: the ids or the guide thresholds, 0 past n (the
    positives are masked to the real ones), or ``idx`` as a placeholder, never read, when absent."""
    if PRESENT:
        values = load_vector(ptr, idx, n, 1, 0, MASK)
    else:
        values = idx  # unused
    return values


@triton.jit
def block_masks(masks, rows, cols, pos, q_ids, row_thr):
    """One tile's (positive, excluded_rows, excluded_cols) (:func:`tile_masks`) from its rows' ``pos``, ids and
    thresholds: the columns' ids and, with a guide, the guide scores (the S tile of :func:`score_chunks` over
    D') and the columns' thresholds."""
    k_ids = load_optional(masks.k_ids_ptr, cols, masks.gk.n, masks.HAS_IDS, masks.tile.MASK_N)
    if masks.HAS_GUIDE:
        scores = score_chunks(masks.gq, masks.gk, rows, cols, masks.tile, masks.dot)
    else:
        scores = rows  # unused
    SYMMETRIC_GUIDE: tl.constexpr = masks.HAS_GUIDE and masks.SYMMETRIC
    col_thr = load_optional(masks.col_thr_ptr, cols, masks.gk.n, SYMMETRIC_GUIDE, masks.tile.MASK_N)
    return tile_masks(masks, rows, cols, pos, q_ids, k_ids, scores, row_thr, col_thr)


@triton.jit
def positive_partials(s, positive, pos_max, pos_rest, pos_sum, pos_count, AXIS: tl.constexpr, POSITIVES: tl.constexpr):
    """Fold one tile's positives into the running (max, rest, sum, count) of each row (AXIS 1) or column
    (AXIS 0): their max (with "sum", their stats, rest as in :func:`tile_rest_stats`; else rest stays the
    empty set's -1), the sum of their logits and their number."""
    at_pos = tl.where(positive, s, float("-inf"))
    if POSITIVES == SUM_POSITIVES:
        t, rest = kept_rest_stats(at_pos, AXIS)
        pos_max, pos_rest = merge_kept_stats(pos_max, pos_rest, t, rest)
    else:
        pos_max = tl.maximum(pos_max, tl.max(at_pos, axis=AXIS))
    pos_sum += tl.sum(tl.where(positive, s, 0.0), axis=AXIS)
    pos_count += tl.sum(positive.to(s.dtype), axis=AXIS)
    return pos_max, pos_rest, pos_sum, pos_count


@triton.jit
def kept_sums(kept, kept_sum, kept_count, AXIS: tl.constexpr):
    """Fold one tile's kept logits into the running sum and number of each row's (AXIS 1) or column's (AXIS 0):
    ``kept`` is the tile the stats see, -inf on the excluded entries and past the block's edge, so an entry is
    kept where it is above -inf (:func:`subtract_uniform` keeps the same ones)."""
    keep = kept > float("-inf")
    kept_sum += tl.sum(tl.where(keep, kept, 0.0), axis=AXIS)
    kept_count += tl.sum(keep.to(kept.dtype), axis=AXIS)
    return kept_sum, kept_count


@triton.jit
def subtract_uniform(ds, s, excluded, uniform, EXCLUDES: tl.constexpr):
    """ds - uniform on the tile's kept entries (label smoothing's eps * g / n_kept; ``uniform`` broadcast like
    the stats): those not excluded and inside the block (``s`` above -inf, as :func:`kept_sums` counted them).
    An excluded entry's dS stays 0."""
    if EXCLUDES:
        keep = (s > float("-inf")) & ~excluded
    else:
        keep = s > float("-inf")
    return ds - tl.where(keep, uniform, 0.0)


@triton.jit
def masked_softmax_grad(s, stats, positives, positive, excluded, POSITIVES: tl.constexpr, EXCLUDES: tl.constexpr):
    """g * (P - Y) for a tile with masks: P = exp((s - m) - r) off the exclusions and 0 on them; ``stats``
    (m, r, g) and ``positives`` (pos_count, pos_max, pos_rel) come broadcast like :func:`softmax_grad`'s stats
    (each only where its POSITIVES reads it). Y, and a positive's entry:

    - ONE_POSITIVE: the one-hot of ``positive``; g * expm1(x) there, picked out per row (as softmax_grad);
    - MEAN_POSITIVES (``pos_count`` c = |P|): 1 / c on the positives; (p - 1/c) = expm1(x + log c) / c;
    - SUM_POSITIVES (``pos_max``, ``pos_rel``: the positives' global max and log-sum relative to it): the
      softmax over P; p - y = y * expm1(d) with y = exp((s - pos_max) - pos_rel) and
      d = (pos_max - m) + (pos_rel - r) <= 0, the log of the positives' share.

    Never a difference of two rounded probabilities, so a confident row keeps its digits.
    """
    m, r, g = stats
    pos_count, pos_max, pos_rel = positives
    x = (s - m) - r
    p = exp(x)
    if EXCLUDES:
        p = tl.where(excluded, 0.0, p)
    if POSITIVES == ONE_POSITIVE:
        x_pos = tl.sum(tl.where(positive, x, 0.0), axis=1)
        at_pos = expm1(x_pos)[:, None]
    elif POSITIVES == MEAN_POSITIVES:
        at_pos = expm1(x + tl.log(pos_count)) / pos_count
    else:
        at_pos = exp((s - pos_max) - pos_rel) * expm1((pos_max - m) + (pos_rel - r))
    return g * tl.where(positive, at_pos, p)
