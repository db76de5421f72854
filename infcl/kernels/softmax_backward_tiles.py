"""The backward kernel's per-tile helpers (:mod:`infcl.kernels.softmax_backward`): dS of one tile on the
plain path (:func:`_plain_tile_grads`) and on the masked path (:func:`_masked_tile_grads`), the stats and
positives loads, and the store of a finished slice. The kernel calls one of the two tile helpers, chosen
by a constexpr, so its body does not interleave the plain and masked dS."""

from typing import Any, NamedTuple

import triton
import triton.language as tl

from .score_tiles import Matrix, load_tile, load_vector
from .softmax_mask_tiles import MEAN_POSITIVES, SUM_POSITIVES, masked_softmax_grad, subtract_uniform
from .tile_stats import holds_positive, softmax_grad


@triton.jit
def _plain_tile_grads(
    s,
    cols,
    col_start,
    pos,
    pos_span,
    row,
    col,
    SYMMETRIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BRANCH_POSITIVES: tl.constexpr,
):
    """The plain path's (row part, column part) of dS for the tile of columns ``cols`` (from ``col_start``),
    with the rows' and columns' stats ``row`` / ``col`` = (m, r, g) (:func:`_load_stats`); the column part is 0
    for the one-directional loss. One positive per row, ``pos`` (-1: none), whose span ``pos_span``
    (:func:`infcl.kernels.tile_stats.positive_span`) tells whether the tile may hold one."""
    is_pos = cols[None, :] == pos[:, None]
    has_pos = holds_positive(pos_span[0], pos_span[1], col_start, BLOCK_N, BRANCH_POSITIVES)
    ds_row = softmax_grad(s, row[0][:, None], row[1][:, None], row[2][:, None], is_pos, has_pos)
    if SYMMETRIC:
        ds_col = softmax_grad(s, col[0][None, :], col[1][None, :], col[2][None, :], is_pos, has_pos)
    else:
        ds_col = 0.0
    return ds_row, ds_col


@triton.jit
def _masked_tile_grads(
    s,
    tile_masks,
    row_inputs,
    col_inputs,
    SYMMETRIC: tl.constexpr,
    POSITIVES: tl.constexpr,
    EXCLUDES: tl.constexpr,
    KEPT_SUMS: tl.constexpr,
):
    """The masked path's (row part, column part) of dS for a tile whose (positive, excluded_rows,
    excluded_cols) ``tile_masks`` the kernel formed (:func:`infcl.kernels.softmax_mask_tiles.block_masks`):
    :func:`infcl.kernels.softmax_mask_tiles.masked_softmax_grad` with the rows' (columns') ``row_inputs``
    (``col_inputs``) = (stats (m, r, g), positives (pos_count, pos_max, pos_rel): their count ("mean") or their
    global stats ("sum") (:func:`_load_positives`), uniform weights (:func:`_load_uniform`)), less, with
    KEPT_SUMS, each line's uniform weight on its kept entries (label smoothing,
    :func:`infcl.kernels.softmax_mask_tiles.subtract_uniform`); the column part is 0 for the one-directional
    loss."""
    positive, excluded_rows, excluded_cols = tile_masks
    row, row_pos, row_u = row_inputs
    col, col_pos, col_u = col_inputs
    ds_row = masked_softmax_grad(
        s,
        (row[0][:, None], row[1][:, None], row[2][:, None]),
        (row_pos[0][:, None], row_pos[1][:, None], row_pos[2][:, None]),
        positive,
        excluded_rows,
        POSITIVES,
        EXCLUDES,
    )
    if KEPT_SUMS:
        ds_row = subtract_uniform(ds_row, s, excluded_rows, row_u[:, None], EXCLUDES)
    if SYMMETRIC:
        ds_col = masked_softmax_grad(
            s,
            (col[0][None, :], col[1][None, :], col[2][None, :]),
            (col_pos[0][None, :], col_pos[1][None, :], col_pos[2][None, :]),
            positive,
            excluded_cols,
            POSITIVES,
            EXCLUDES,
        )
        if KEPT_SUMS:
            ds_col = subtract_uniform(ds_col, s, excluded_cols, col_u[None, :], EXCLUDES)
    else:
        ds_col = 0.0
    return ds_row, ds_col


class Upstream(NamedTuple):
    """One side's (rows' or columns') inputs to the backward: its stats [2, n] (m's row ``stride_stat`` before
    r's, each contiguous), its upstream gradients [n] and, with mask options, its positives' count [n] or
    global stats [2, n] (``stride_pos`` apart) and label smoothing's uniform weights [n] (None: none)."""

    stats_ptr: Any
    stride_stat: Any
    g_ptr: Any
    pos_ptr: Any
    stride_pos: Any
    uniform_ptr: Any


class GradSlices(NamedTuple):
    """Where a backward program writes: the gradient's partials [splits, n, D] (one split: the caller's
    gradient itself), the dscale partials and, for float16, the largest |g| (NORMALIZE: dS is divided by it);
    constexprs BLOCK_OUT (a slice's width), EVEN_OUT (D is whole slices) and ADD (add to what is there)."""

    ptr: Any
    stride_split: Any
    stride_r: Any
    stride_c: Any
    dscale_ptr: Any
    g_max_ptr: Any
    BLOCK_OUT: Any
    EVEN_OUT: Any
    ADD: Any
    NORMALIZE: Any


@triton.jit
def _load_positives(up, idx, n, POSITIVES: tl.constexpr, MASK: tl.constexpr):
    """(pos_count, pos_max, pos_rel) of the rows (columns) ``idx`` from their positives (:class:`Upstream`):
    the count [n] for "mean", the global stats (max, rel) [2, n] for "sum" (the others are placeholders,
    never read); past ``n`` a count of 1 and zero stats (those entries' dS is 0 anyway)."""
    if POSITIVES == MEAN_POSITIVES:
        pos_count = load_vector(up.pos_ptr, idx, n, 1, 1.0, MASK)
        pos_max = pos_count  # unused
        pos_rel = pos_count
    elif POSITIVES == SUM_POSITIVES:
        pos_max = load_vector(up.pos_ptr, idx, n, 1, 0.0, MASK)
        pos_rel = load_vector(up.pos_ptr + up.stride_pos, idx, n, 1, 0.0, MASK)
        pos_count = pos_max  # unused
    else:
        pos_count = idx  # unused: one positive per row
        pos_max = idx
        pos_rel = idx
    return pos_count, pos_max, pos_rel


@triton.jit
def _load_uniform(up, idx, n, KEPT_SUMS: tl.constexpr, MASK: tl.constexpr):
    """Label smoothing's uniform weights eps * g / n_kept of the rows (columns) ``idx`` (:class:`Upstream`), 0
    past ``n``; ``idx`` as a placeholder, never read, without KEPT_SUMS."""
    if KEPT_SUMS:
        uniform = load_vector(up.uniform_ptr, idx, n, 1, 0.0, MASK)
    else:
        uniform = idx  # unused
    return uniform


@triton.jit
def _load_stats(up, idx, n, MASK: tl.constexpr):
    """(m, r, g) of the rows (columns) ``idx`` (:class:`Upstream`): zero past ``n``, where the entries' S is
    -inf anyway (masked_scores), so their dS is 0."""
    m = load_vector(up.stats_ptr, idx, n, 1, 0.0, MASK)
    r = load_vector(up.stats_ptr + up.stride_stat, idx, n, 1, 0.0, MASK)
    return m, r, load_vector(up.g_ptr, idx, n, 1, 0.0, MASK)


@triton.jit
def _inverse(factor):
    """1 / factor, 0 where factor is 0 (a row no gradient reaches)."""
    return tl.where(factor > 0, 1.0 / tl.where(factor > 0, factor, 1.0), 0.0)


@triton.jit
def _store_slice(out, split, rows, n_rows, feats, D, acc, scale, factor, MASK_ROWS: tl.constexpr):
    """out[split][rows, feats] (+)= scale * acc (times each row's dS factor) (:class:`GradSlices`): the
    program's one write of its gradient slice."""
    MASK_FEATS: tl.constexpr = not out.EVEN_OUT
    if out.NORMALIZE:
        value = acc * (factor * scale)[:, None]
    else:
        value = acc * scale
    part = out.ptr + split.to(tl.int64) * out.stride_split
    ptrs = part + rows[:, None].to(tl.int64) * out.stride_r + feats[None, :].to(tl.int64) * out.stride_c
    if out.ADD:
        value += load_tile(
            Matrix(part, n_rows, D, out.stride_r, out.stride_c), rows, feats, MASK_ROWS, MASK_FEATS, False
        )
    if MASK_ROWS and MASK_FEATS:
        tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (feats[None, :] < D))
    elif MASK_ROWS:
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)
    elif MASK_FEATS:
        tl.store(ptrs, value, mask=feats[None, :] < D)
    else:
        tl.store(ptrs, value)
