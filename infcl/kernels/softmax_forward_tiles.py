"""The forward kernel's per-tile helpers (:mod:`infcl.kernels.softmax_forward`): a tile folded into its rows'
running stats and positive logits, its column stats merged into the group's partials (plain and masked),
the stores of a finished row block, and the plain symmetric forward over a pair of row blocks
(:func:`_symmetric_pair`)."""

import triton
import triton.language as tl

from ..masks import KEPT_SUM
from .score_tiles import load_tile, load_vector, masked_scores, score_pair
from .softmax_mask_tiles import kept_sums, positive_partials
from .tile_stats import (
    holds_positive,
    kept_rest_stats,
    merge_kept_stats,
    merge_rest_stats,
    pair_column_stats,
    positive_span,
    tile_rest_stats,
)

# The first of the masked partials' two kept-sums rows (infcl.masks.KEPT_SUM, then KEPT_COUNT), as the kernels see it.
KEPT_ROW = tl.constexpr(KEPT_SUM)


@triton.jit
def _load_stat(part, i: tl.constexpr, idx, other, MASK: tl.constexpr):
    """part[i, idx] of a [R, n] partials :class:`Matrix` (each row contiguous); ``other`` past n (MASK)."""
    return load_vector(part.ptr + i * part.stride_r, idx, part.d, 1, other, MASK)


@triton.jit
def _store_stat(part, i: tl.constexpr, idx, value, MASK: tl.constexpr):
    """part[i, idx] = value, nothing stored past n (MASK)."""
    ptr = part.ptr + i * part.stride_r + idx
    if MASK:
        tl.store(ptr, value, mask=idx < part.d)
    else:
        tl.store(ptr, value)


@triton.jit
def _merge_masked_columns(
    col_part, cols, s_cols, kept, positive, POSITIVES: tl.constexpr, KEPT_SUMS: tl.constexpr, MASK: tl.constexpr
):
    """Merge one tile's masked column partials (stats of ``kept``, the positives of ``positive`` and, with
    KEPT_SUMS, the sum and number of the kept logits) into the group's [6, Bk] ([8, Bk]) partials: read, merged,
    written back (the group's program owns them)."""
    col_max, col_rest = kept_rest_stats(kept, 0)
    part_max = _load_stat(col_part, 0, cols, float("-inf"), MASK)
    part_rest = _load_stat(col_part, 1, cols, -1.0, MASK)
    part_max, part_rest = merge_kept_stats(part_max, part_rest, col_max, col_rest)
    _store_stat(col_part, 0, cols, part_max, MASK)
    _store_stat(col_part, 1, cols, part_rest, MASK)
    pos_max = _load_stat(col_part, 2, cols, float("-inf"), MASK)
    pos_rest = _load_stat(col_part, 3, cols, -1.0, MASK)
    pos_sum = _load_stat(col_part, 4, cols, 0.0, MASK)
    pos_count = _load_stat(col_part, 5, cols, 0.0, MASK)
    pos_max, pos_rest, pos_sum, pos_count = positive_partials(
        s_cols, positive, pos_max, pos_rest, pos_sum, pos_count, 0, POSITIVES
    )
    _store_rows(col_part, cols, (pos_max, pos_rest, pos_sum, pos_count), MASK, 2)
    if KEPT_SUMS:
        kept_sum = _load_stat(col_part, KEPT_ROW, cols, 0.0, MASK)
        kept_count = _load_stat(col_part, KEPT_ROW + 1, cols, 0.0, MASK)
        kept_sum, kept_count = kept_sums(kept, kept_sum, kept_count, 0)
        _store_rows(col_part, cols, (kept_sum, kept_count), MASK, KEPT_ROW)


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
def _merge_columns(col_part, cols, col_max, col_rest, MASK: tl.constexpr):
    """Merge one tile's column stats into the group's [2, Bk] partials: read, merged, written back (the
    group's program owns them)."""
    part_max = _load_stat(col_part, 0, cols, float("-inf"), MASK)
    part_rest = _load_stat(col_part, 1, cols, -1.0, MASK)
    part_max, part_rest = merge_rest_stats(part_max, part_rest, col_max, col_rest)
    _store_rows(col_part, cols, (part_max, part_rest), MASK)


@triton.jit
def _store_rows(part, idx, values, MASK: tl.constexpr, FIRST: tl.constexpr = 0):
    """part[FIRST + i, idx] = values[i] for each of the tuple ``values``: a finished row block's stats."""
    for i in tl.static_range(len(values)):
        _store_stat(part, FIRST + i, idx, values[i], MASK)


@triton.jit
def _symmetric_pair(q, k, masks, out, scale, rows0, col_blocks, tile, MASK_M1: tl.constexpr, dot):
    """The plain symmetric forward over two row blocks at once (rows0 and the BLOCK_M rows after them;
    MASK_M1: the second may reach past n_q): each k block's two S tiles (:func:`score_pair`, each the one
    S tile of every kernel) fold into their rows' stats as a single tile does, and into the columns' stats
    together (:func:`pair_column_stats`), so the cross-row reductions, the merge and the read-modify-write
    of the column partials run once per 2 * BLOCK_M rows."""
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    ACC: tl.constexpr = dot.ACC
    MASK_M0: tl.constexpr = tile.MASK_M
    BRANCH_POSITIVES: tl.constexpr = masks.BRANCH_POSITIVES
    n_q = q.n
    n_k = k.n
    rows1 = rows0 + BLOCK_M
    if tile.ONE_CHUNK:  # both q tiles are loaded once and held in registers for the whole k loop
        feats = tl.arange(0, tile.BLOCK_D)
        q_res = (load_tile(q, rows0, feats, MASK_M0, tile.MASK_D), load_tile(q, rows1, feats, MASK_M1, tile.MASK_D))
    else:
        q_res = (q.ptr, q.ptr)  # unused
    pos0 = load_vector(masks.pos_ptr, rows0, n_q, 1, -1, MASK_M0).to(tl.int32)
    pos1 = load_vector(masks.pos_ptr, rows1, n_q, 1, -1, MASK_M1).to(tl.int32)
    pos_lo0, pos_hi0 = positive_span(pos0)
    pos_lo1, pos_hi1 = positive_span(pos1)
    run_max0 = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    run_rest0 = tl.full([BLOCK_M], -1.0, dtype=ACC)
    pos_logit0 = tl.zeros([BLOCK_M], dtype=ACC)
    run_max1 = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    run_rest1 = tl.full([BLOCK_M], -1.0, dtype=ACC)
    pos_logit1 = tl.zeros([BLOCK_M], dtype=ACC)
    for cb in range(col_blocks[0], col_blocks[1]):
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        raw0, raw1 = score_pair(q, k, q_res, (rows0, rows1), cols, tile, MASK_M1, dot)
        # Row stats see only real columns, column stats only real rows (as the single tile's).
        run_max0, run_rest0, pos_logit0 = _fold_rows(
            masked_scores(raw0, scale, rows0, cols, n_q, n_k, False, tile.MASK_N),
            cols,
            pos0,
            holds_positive(pos_lo0, pos_hi0, cb * BLOCK_N, BLOCK_N, BRANCH_POSITIVES),
            run_max0,
            run_rest0,
            pos_logit0,
        )
        run_max1, run_rest1, pos_logit1 = _fold_rows(
            masked_scores(raw1, scale, rows1, cols, n_q, n_k, False, tile.MASK_N),
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
        _merge_columns(out[1], cols, col_max, col_rest, tile.MASK_N)
    _store_rows(out[0], rows0, (run_max0, run_rest0, pos_logit0), MASK_M0)
    _store_rows(out[0], rows1, (run_max1, run_rest1, pos_logit1), MASK_M1)
