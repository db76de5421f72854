"""The dq and dk kernels' per-tile helpers (:mod:`infcl.kernels.softmax_backward`): dS of one tile on the
plain path (:func:`_plain_tile_grads`) and on the masked path (:func:`_masked_tile_grads`, with the rows'
mask inputs from :func:`_masked_rows`), the stats and positives loads, and the store of a finished slice.
Each kernel calls one of the two tile helpers, chosen by a constexpr, so neither kernel body interleaves
the plain and masked paths."""

import triton
import triton.language as tl

from .score_tiles import load_tile, load_vector
from .softmax_mask_tiles import (
    MEAN_POSITIVES,
    ONE_POSITIVE,
    SUM_POSITIVES,
    block_masks,
    load_optional,
    masked_softmax_grad,
)
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
    rows,
    cols,
    pos,
    q_ids,
    row_thr,
    k_ids_ptr,
    col_thr_ptr,
    gq_ptr,
    gk_ptr,
    n_q,
    n_k,
    DG,
    stride_gq0,
    stride_gq1,
    stride_gk0,
    stride_gk1,
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
    HAS_IDS: tl.constexpr,
    HAS_GUIDE: tl.constexpr,
    POSITIVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_ACC: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
):
    """The masked path's (row part, column part) of dS for the tile (``rows``, ``cols``): the tile's positives
    and exclusions (:func:`infcl.kernels.softmax_mask_tiles.block_masks`, from the rows' ``q_ids`` and guide thresholds
    ``row_thr`` and the columns' by pointer), then :func:`infcl.kernels.softmax_mask_tiles.masked_softmax_grad`;
    (pos_count, pos_max, pos_rel) are each row's (column's) positives: their count ("mean") or their global
    stats ("sum") (:func:`_load_positives`)."""
    positive, excluded_rows, excluded_cols = block_masks(
        gq_ptr,
        gk_ptr,
        rows,
        cols,
        pos,
        q_ids,
        k_ids_ptr,
        row_thr,
        col_thr_ptr,
        n_q,
        n_k,
        DG,
        stride_gq0,
        stride_gq1,
        stride_gk0,
        stride_gk1,
        HAS_IDS,
        HAS_GUIDE,
        POSITIVES,
        SYMMETRIC,
        BLOCK_M,
        BLOCK_N,
        BLOCK_G,
        EVEN_M,
        EVEN_N,
        EVEN_G,
        GUIDE_ACC,
        GUIDE_PRECISION,
    )
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
        HAS_GUIDE or (HAS_IDS and POSITIVES == ONE_POSITIVE),
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
            HAS_GUIDE or (HAS_IDS and POSITIVES == ONE_POSITIVE),
        )
    else:
        ds_col = 0.0
    return ds_row, ds_col


@triton.jit
def _masked_rows(
    q_ids_ptr,
    row_thr_ptr,
    row_pos_ptr,
    rows,
    n_q,
    stride_rp0,
    stride_rp1,
    HAS_IDS: tl.constexpr,
    HAS_GUIDE: tl.constexpr,
    POSITIVES: tl.constexpr,
    MASK: tl.constexpr,
):
    """The masked path's inputs of the rows ``rows``: (q_ids, row_thr, pos_count, pos_max, pos_rel), their ids
    and guide thresholds (placeholders when absent) and their positives (:func:`_load_positives`)."""
    q_ids = load_optional(q_ids_ptr, rows, n_q, HAS_IDS, MASK)
    row_thr = load_optional(row_thr_ptr, rows, n_q, HAS_GUIDE, MASK)
    pos_count, pos_max, pos_rel = _load_positives(row_pos_ptr, rows, n_q, stride_rp0, stride_rp1, POSITIVES, MASK)
    return q_ids, row_thr, pos_count, pos_max, pos_rel


@triton.jit
def _load_positives(pos_ptr, idx, n, stride_stat, stride_elem, POSITIVES: tl.constexpr, MASK: tl.constexpr):
    """(pos_count, pos_max, pos_rel) of the rows (columns) ``idx``: the positives' count for "mean", their
    global stats (max, rel) for "sum" (the others are placeholders, never read); past ``n`` a count of 1 and
    zero stats (those entries' dS is 0 anyway)."""
    if POSITIVES == MEAN_POSITIVES:
        pos_count = load_vector(pos_ptr, idx, n, stride_elem, 1.0, MASK)
        pos_max = pos_count  # unused
        pos_rel = pos_count
    elif POSITIVES == SUM_POSITIVES:
        pos_max = load_vector(pos_ptr, idx, n, stride_elem, 0.0, MASK)
        pos_rel = load_vector(pos_ptr + stride_stat, idx, n, stride_elem, 0.0, MASK)
        pos_count = pos_max  # unused
    else:
        pos_count = idx  # unused: one positive per row
        pos_max = idx
        pos_rel = idx
    return pos_count, pos_max, pos_rel


@triton.jit
def _load_stats(stats_ptr, g_ptr, idx, n, stride_stat, stride_elem, stride_g, MASK: tl.constexpr):
    """(m, r, g) of the rows (columns) ``idx``: zero past ``n``, where the entries' S is -inf anyway
    (masked_scores), so their dS is 0."""
    m = load_vector(stats_ptr, idx, n, stride_elem, 0.0, MASK)
    r = load_vector(stats_ptr + stride_stat, idx, n, stride_elem, 0.0, MASK)
    return m, r, load_vector(g_ptr, idx, n, stride_g, 0.0, MASK)


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
