"""The forward kernel's per-tile helpers (:mod:`infcl.kernels.softmax_forward`): a tile folded into its rows'
running stats and positive logits, its column stats merged into the group's partials (plain and masked),
the stores of a finished row block, and the plain symmetric forward over a pair of row blocks
(:func:`_symmetric_pair`)."""

import triton
import triton.language as tl

from .score_tiles import load_tile, load_vector, masked_scores, score_pair
from .softmax_mask_tiles import positive_partials
from .tile_stats import (
    holds_positive,
    kept_rest_stats,
    merge_kept_stats,
    merge_rest_stats,
    pair_column_stats,
    positive_span,
    tile_rest_stats,
)


@triton.jit
def _store_vector(ptr, idx, n, value, MASK: tl.constexpr):
    if MASK:
        tl.store(ptr + idx, value, mask=idx < n)
    else:
        tl.store(ptr + idx, value)


@triton.jit
def _merge_masked_columns(
    col_part, stride_stat, cols, n_k, s_cols, kept, positive, POSITIVES: tl.constexpr, MASK: tl.constexpr
):
    """Merge one tile's masked column partials (stats of ``kept``, the positives of ``positive``) into the
    group's [6, Bk] partials: read, merged, written back (the group's program owns them)."""
    col_max, col_rest = kept_rest_stats(kept, 0)
    part_max = load_vector(col_part, cols, n_k, 1, float("-inf"), MASK)
    part_rest = load_vector(col_part + stride_stat, cols, n_k, 1, -1.0, MASK)
    part_max, part_rest = merge_kept_stats(part_max, part_rest, col_max, col_rest)
    _store_vector(col_part, cols, n_k, part_max, MASK)
    _store_vector(col_part + stride_stat, cols, n_k, part_rest, MASK)
    pos_max = load_vector(col_part + 2 * stride_stat, cols, n_k, 1, float("-inf"), MASK)
    pos_rest = load_vector(col_part + 3 * stride_stat, cols, n_k, 1, -1.0, MASK)
    pos_sum = load_vector(col_part + 4 * stride_stat, cols, n_k, 1, 0.0, MASK)
    pos_count = load_vector(col_part + 5 * stride_stat, cols, n_k, 1, 0.0, MASK)
    pos_max, pos_rest, pos_sum, pos_count = positive_partials(
        s_cols, positive, pos_max, pos_rest, pos_sum, pos_count, 0, POSITIVES
    )
    _store_vector(col_part + 2 * stride_stat, cols, n_k, pos_max, MASK)
    _store_vector(col_part + 3 * stride_stat, cols, n_k, pos_rest, MASK)
    _store_vector(col_part + 4 * stride_stat, cols, n_k, pos_sum, MASK)
    _store_vector(col_part + 5 * stride_stat, cols, n_k, pos_count, MASK)


@triton.jit
def _fold_rows(s_rows, cols, pos, has_pos, run_max, run_rest, pos_logit):
    """Fold one tile into its rows' running stats and positive logits (the plain loss); ``has_pos``: whether
    the tile may hold a positive (:func:`infcl.kernels.tile_stats.holds_positive`, a uniform branch)."""
    tile_max, tile_rest = tile_rest_stats(s_rows, 1)
    run_max, run_rest = merge_rest_stats(run_max, run_rest, tile_max, tile_rest)
    if has_pos:
        pos_logit += tl.sum(tl.where(cols[None, :] == pos[:, None], s_rows, 0.0), axis=1)
    return run_max, run_rest, pos_logit


@triton.jit
def _merge_columns(col_part, stride_stat, cols, n_k, col_max, col_rest, MASK: tl.constexpr):
    """Merge one tile's column stats into the group's [2, Bk] partials: read, merged, written back (the
    group's program owns them)."""
    part_max = load_vector(col_part, cols, n_k, 1, float("-inf"), MASK)
    part_rest = load_vector(col_part + stride_stat, cols, n_k, 1, -1.0, MASK)
    part_max, part_rest = merge_rest_stats(part_max, part_rest, col_max, col_rest)
    _store_vector(col_part, cols, n_k, part_max, MASK)
    _store_vector(col_part + stride_stat, cols, n_k, part_rest, MASK)


@triton.jit
def _store_rows(row_out, stride_stat, rows, n_q, run_max, run_rest, pos_logit, MASK: tl.constexpr):
    _store_vector(row_out, rows, n_q, run_max, MASK)
    _store_vector(row_out + stride_stat, rows, n_q, run_rest, MASK)
    _store_vector(row_out + 2 * stride_stat, rows, n_q, pos_logit, MASK)


@triton.jit
def _symmetric_pair(
    q_ptr,
    k_ptr,
    pos_ptr,
    row_out,
    col_part,
    scale,
    rows0,
    cb_lo,
    cb_hi,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_rows_stat,
    stride_cols_stat,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    MASK_M0: tl.constexpr,
    MASK_M1: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BRANCH_POSITIVES: tl.constexpr,
):
    """The plain symmetric forward over two row blocks at once (rows0 and the BLOCK_M rows after them;
    MASK_M1: the second may reach past n_q): each k block's two S tiles (:func:`score_pair`, each the one
    S tile of every kernel) fold into their rows' stats as a single tile does, and into the columns' stats
    together (:func:`pair_column_stats`), so the cross-row reductions, the merge and the read-modify-write
    of the column partials run once per 2 * BLOCK_M rows."""
    rows1 = rows0 + BLOCK_M
    if ONE_CHUNK:  # both q tiles are loaded once and held in registers for the whole k loop
        feats = tl.arange(0, BLOCK_D)
        q_res0 = load_tile(q_ptr, rows0, feats, n_q, D, stride_q0, stride_q1, MASK_M0, MASK_D)
        q_res1 = load_tile(q_ptr, rows1, feats, n_q, D, stride_q0, stride_q1, MASK_M1, MASK_D)
    else:
        q_res0 = q_ptr  # unused
        q_res1 = q_ptr
    pos0 = load_vector(pos_ptr, rows0, n_q, 1, -1, MASK_M0).to(tl.int32)
    pos1 = load_vector(pos_ptr, rows1, n_q, 1, -1, MASK_M1).to(tl.int32)
    pos_lo0, pos_hi0 = positive_span(pos0)
    pos_lo1, pos_hi1 = positive_span(pos1)
    run_max0 = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    run_rest0 = tl.full([BLOCK_M], -1.0, dtype=ACC)
    pos_logit0 = tl.zeros([BLOCK_M], dtype=ACC)
    run_max1 = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    run_rest1 = tl.full([BLOCK_M], -1.0, dtype=ACC)
    pos_logit1 = tl.zeros([BLOCK_M], dtype=ACC)
    for cb in range(cb_lo, cb_hi):
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        raw0, raw1 = score_pair(
            q_ptr,
            k_ptr,
            q_res0,
            q_res1,
            rows0,
            rows1,
            cols,
            n_q,
            n_k,
            D,
            stride_q0,
            stride_q1,
            stride_k0,
            stride_k1,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            ONE_CHUNK,
            MASK_M0,
            MASK_M1,
            MASK_N,
            MASK_D,
            ACC,
            UPCAST,
            PRECISION,
        )
        # Row stats see only real columns, column stats only real rows (as the single tile's).
        run_max0, run_rest0, pos_logit0 = _fold_rows(
            masked_scores(raw0, scale, rows0, cols, n_q, n_k, False, MASK_N),
            cols,
            pos0,
            holds_positive(pos_lo0, pos_hi0, cb * BLOCK_N, BLOCK_N, BRANCH_POSITIVES),
            run_max0,
            run_rest0,
            pos_logit0,
        )
        run_max1, run_rest1, pos_logit1 = _fold_rows(
            masked_scores(raw1, scale, rows1, cols, n_q, n_k, False, MASK_N),
            cols,
            pos1,
            holds_positive(pos_lo1, pos_hi1, cb * BLOCK_N, BLOCK_N, BRANCH_POSITIVES),
            run_max1,
            run_rest1,
            pos_logit1,
        )
        col_max, col_rest = pair_column_stats(
            masked_scores(raw0, scale, rows0, cols, n_q, n_k, MASK_M0, False),
            masked_scores(raw1, scale, rows1, cols, n_q, n_k, MASK_M1, False),
        )
        _merge_columns(col_part, stride_cols_stat, cols, n_k, col_max, col_rest, MASK_N)
    _store_rows(row_out, stride_rows_stat, rows0, n_q, run_max0, run_rest0, pos_logit0, MASK_M0)
    _store_rows(row_out, stride_rows_stat, rows1, n_q, run_max1, run_rest1, pos_logit1, MASK_M1)
