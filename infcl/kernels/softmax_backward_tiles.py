"""The backward kernel's per-tile helpers (:mod:`infcl.kernels.softmax_backward`): dS of one tile on the
plain path (:func:`_plain_tile_grads`) and on the masked path (:func:`_masked_tile_grads`), the stats and
positives loads, and the store of a finished slice. The kernel calls one of the two tile helpers, chosen
by a constexpr, so its body does not interleave the plain and masked dS."""

import triton
import triton.language as tl

from .score_tiles import load_tile, load_vector
from .softmax_mask_tiles import MEAN_POSITIVES, SUM_POSITIVES, masked_softmax_grad
from .tile_stats import holds_positive, softmax_grad


@triton.jit
def _plain_tile_grads(
    s,
    cols,
    col_start,
    pos,
    pos_lo,
    pos_hi,
    m_r,
    r_r,
    g_r,
    m_c,
    r_c,
    g_c,
    SYMMETRIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BRANCH_POSITIVES: tl.constexpr,
):
    """The plain path's (row part, column part) of dS for the tile of columns ``cols`` (from ``col_start``);
    the column part is 0 for the one-directional loss. One positive per row, ``pos`` (-1: none), whose span
    (``pos_lo``, ``pos_hi``) (:func:`infcl.kernels.tile_stats.positive_span`) tells whether the tile may hold one."""
    is_pos = cols[None, :] == pos[:, None]
    has_pos = holds_positive(pos_lo, pos_hi, col_start, BLOCK_N, BRANCH_POSITIVES)
    ds_row = softmax_grad(s, m_r[:, None], r_r[:, None], g_r[:, None], is_pos, has_pos)
    if SYMMETRIC:
        ds_col = softmax_grad(s, m_c[None, :], r_c[None, :], g_c[None, :], is_pos, has_pos)
    else:
        ds_col = 0.0
    return ds_row, ds_col


@triton.jit
def _masked_tile_grads(
    s,
    positive,
    excluded_rows,
    excluded_cols,
    m_r,
    r_r,
    g_r,
    pos_count_r,
    pos_max_r,
    pos_rel_r,
    m_c,
    r_c,
    g_c,
    pos_count_c,
    pos_max_c,
    pos_rel_c,
    SYMMETRIC: tl.constexpr,
    POSITIVES: tl.constexpr,
    EXCLUDES: tl.constexpr,
):
    """The masked path's (row part, column part) of dS for a tile whose positives and exclusions the kernel
    formed (:func:`infcl.kernels.softmax_mask_tiles.block_masks`):
    :func:`infcl.kernels.softmax_mask_tiles.masked_softmax_grad` with the rows' (columns') stats (m, r, g) and
    positives (pos_count, pos_max, pos_rel): their count ("mean") or their global stats ("sum")
    (:func:`_load_positives`); the column part is 0 for the one-directional loss."""
    ds_row = masked_softmax_grad(
        s,
        m_r[:, None],
        r_r[:, None],
        g_r[:, None],
        pos_count_r[:, None],
        pos_max_r[:, None],
        pos_rel_r[:, None],
        positive,
        excluded_rows,
        POSITIVES,
        EXCLUDES,
    )
    if SYMMETRIC:
        ds_col = masked_softmax_grad(
            s,
            m_c[None, :],
            r_c[None, :],
            g_c[None, :],
            pos_count_c[None, :],
            pos_max_c[None, :],
            pos_rel_c[None, :],
            positive,
            excluded_cols,
            POSITIVES,
            EXCLUDES,
        )
    else:
        ds_col = 0.0
    return ds_row, ds_col


@triton.jit
def _load_positives(pos_ptr, idx, n, stride_stat, POSITIVES: tl.constexpr, MASK: tl.constexpr):
    """(pos_count, pos_max, pos_rel) of the rows (columns) ``idx`` from their positives, each row contiguous:
    the count [n] for "mean", the global stats (max, rel) [2, n], ``stride_stat`` apart, for "sum" (the others
    are placeholders, never read);
    past ``n`` a count of 1 and zero stats (those entries' dS is 0 anyway)."""
    if POSITIVES == MEAN_POSITIVES:
        pos_count = load_vector(pos_ptr, idx, n, 1, 1.0, MASK)
        pos_max = pos_count  # unused
        pos_rel = pos_count
    elif POSITIVES == SUM_POSITIVES:
        pos_max = load_vector(pos_ptr, idx, n, 1, 0.0, MASK)
        pos_rel = load_vector(pos_ptr + stride_stat, idx, n, 1, 0.0, MASK)
        pos_count = pos_max  # unused
    else:
        pos_count = idx  # unused: one positive per row
        pos_max = idx
        pos_rel = idx
    return pos_count, pos_max, pos_rel


@triton.jit
def _load_stats(stats_ptr, g_ptr, idx, n, stride_stat, MASK: tl.constexpr):
    """(m, r, g) of the rows (columns) ``idx`` from their stats [2, n] (m's row ``stride_stat`` before r's,
    each contiguous) and contiguous gradients [n]: zero past ``n``, where the entries' S is -inf anyway
    (masked_scores), so their dS is 0."""
    m = load_vector(stats_ptr, idx, n, 1, 0.0, MASK)
    r = load_vector(stats_ptr + stride_stat, idx, n, 1, 0.0, MASK)
    return m, r, load_vector(g_ptr, idx, n, 1, 0.0, MASK)


@triton.jit
def _inverse(factor):
    """1 / factor, 0 where factor is 0 (a row no gradient reaches)."""
    return tl.where(factor > 0, 1.0 / tl.where(factor > 0, factor, 1.0), 0.0)


@triton.jit
def _store_slice(
    ptr,
    rows,
    feats,
    n_rows,
    D,
    stride_r,
    stride_f,
    acc,
    scale,
    factor,
    NORMALIZE: tl.constexpr,
    ADD: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    MASK_FEATS: tl.constexpr,
):
    """ptr[rows, feats] (+)= scale * acc (times each row's dS factor): the program's one write of its
    gradient slice."""
    if NORMALIZE:
        value = acc * (factor * scale)[:, None]
    else:
        value = acc * scale
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_r + feats[None, :].to(tl.int64) * stride_f
    if ADD:
        value += load_tile(ptr, rows, feats, n_rows, D, stride_r, stride_f, MASK_ROWS, MASK_FEATS, False)
    if MASK_ROWS and MASK_FEATS:
        tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (feats[None, :] < D))
    elif MASK_ROWS:
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)
    elif MASK_FEATS:
        tl.store(ptrs, value, mask=feats[None, :] < D)
    else:
        tl.store(ptrs, value)
