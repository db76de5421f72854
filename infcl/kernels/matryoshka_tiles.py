"""The fused Matryoshka kernels' shared steps (the entries: :mod:`infcl.kernels.matryoshka`; their launchers and
ops: :mod:`infcl.kernels.matryoshka_ops`): the operands' named tuples, a program's walk, one prefix's step on a tile
(:func:`_prefix_tile`, the same S^p in every kernel), the forward's and the backward's walk over a program's lines
(:func:`_forward_lines`, :func:`_backward_lines`), plain or with the mask options, and each prefix's dS."""

from typing import Any, NamedTuple

import triton
import triton.language as tl

from .rank import program_lines, tile_at
from .score_tiles import (
    Matrix,
    dot_operand,
    load_tile,
    load_vector,
    masked_scores,
    score_chunks,
    tile_dot,
)
from .softmax_mask_tiles import (
    MEAN_POSITIVES,
    ONE_POSITIVE,
    SUM_POSITIVES,
    block_masks,
    load_optional,
    masked_softmax_grad,
    positive_partials,
)
from .tile_stats import kept_rest_stats, merge_kept_stats, merge_rest_stats, softmax_grad, tile_rest_stats

# Partials per line and prefix of the forward: the stats (max, rest) and, by rows, the positive logit.
FORWARD_ROWS = 3


class PrefixArgs(NamedTuple):
    """The prefixes as a kernel reads them: ``bounds_ptr`` [K + 1] int32 (0, m_1, ..., m_K), their count K and
    each side's factors [K, n] (rows ``stride_qf`` / ``stride_kf`` apart, each contiguous)."""

    bounds_ptr: Any
    count: Any
    q_factor_ptr: Any
    k_factor_ptr: Any
    stride_qf: Any
    stride_kf: Any


class Operands(NamedTuple):
    """A Matryoshka kernel's operands: q and k (:class:`Matrix` each), the prefixes (:class:`PrefixArgs`), the
    scale (a 0-d tensor, read in the kernel) and each row's positive column in the block (-1: none)."""

    q: Any
    k: Any
    prefixes: Any
    scale_ptr: Any
    pos_ptr: Any


class Outputs(NamedTuple):
    """Where a backward program writes: ``grad`` (:class:`Matrix`: dq [Bq, D], or dk [Bk, D] by columns; its slice
    is added to), ``dot`` (:class:`Dot`: the gradient products' operand dtype, float32 for 16-bit inputs, and
    precision) and ``sums_ptr`` ([2, K, n], from 0: per prefix and line, sum dS_row * u and sum dS_col * u)."""

    grad: Any
    dot: Any
    sums_ptr: Any


@triton.jit
def _walk(ops, tile, BY_COLUMN: tl.constexpr):
    """A program's walk (:func:`~infcl.kernels.rank.program_lines` over q's and k's rows): (lines, n_lines,
    n_other, step, ok: the lines that exist)."""
    lines, n_lines, n_other, step = program_lines(ops.q.n, ops.k.n, BY_COLUMN, tile.BLOCK_M, tile.BLOCK_N)
    return lines, n_lines, n_other, step, lines < n_lines


@triton.jit
def _prefix_tile(ops, p, lo, raw, rows, cols, scale, tile, dot):
    """Prefix ``p`` on the tile, from prefix p - 1's raw product ``raw`` and end ``lo`` (0 and 0 for p = 0):
    (raw^p, m_p, u, s, a, b). raw^p = raw + q[rows, lo:m_p] @ k[cols, lo:m_p].T
    (:func:`~infcl.kernels.score_tiles.score_chunks` on the segment's columns, features past m_p read 0,
    continuing ``raw`` in the products' own accumulator); a (rows) and b (columns) its factors,
    u = (raw^p * a) * b and s = scale * u, -inf outside the block. Both walks, forward and backward, step
    through the prefixes here: every kernel forms the same S^p."""
    prefixes = ops.prefixes
    hi = tl.load(prefixes.bounds_ptr + p + 1)
    q, k = ops.q, ops.k
    raw = score_chunks(
        Matrix(q.ptr + lo.to(tl.int64) * q.stride_c, q.n, hi - lo, q.stride_r, q.stride_c),
        Matrix(k.ptr + lo.to(tl.int64) * k.stride_c, k.n, hi - lo, k.stride_r, k.stride_c),
        rows,
        cols,
        tile,
        dot,
        raw=raw,
    )
    a = load_vector(prefixes.q_factor_ptr + p * prefixes.stride_qf, rows, q.n, 1, 1.0, True)
    b = load_vector(prefixes.k_factor_ptr + p * prefixes.stride_kf, cols, k.n, 1, 1.0, True)
    u = raw * a[:, None] * b[None, :]
    return raw, hi, u, masked_scores(u, scale, rows, cols, q.n, k.n, True, True), a, b


@triton.jit
def _tile_masks(masks, rows, cols):
    """(positive, excluded_rows, excluded_cols) of one tile (:func:`infcl.kernels.softmax_mask_tiles.block_masks`:
    the ids and, with a guide, one guide product over D'), formed once for every prefix from its rows' positive
    column, ids and thresholds."""
    n_q = masks.gq.n
    pos = load_vector(masks.pos_ptr, rows, n_q, 1, -1, True)
    q_ids = load_optional(masks.q_ids_ptr, rows, n_q, masks.HAS_IDS, True)
    row_thr = load_optional(masks.row_thr_ptr, rows, n_q, masks.HAS_GUIDE, True)
    return block_masks(masks, rows, cols, pos, q_ids, row_thr)


@triton.jit
def _forward_lines(ops, out_ptr, tile, dot, masks, BY_COLUMN: tl.constexpr):
    """The forward program's lines (rows, or BY_COLUMN columns): every prefix's stats (and, by rows, positive
    logit), merged tile by tile into ``out_ptr`` [3, K, n] (max, rest, positive; from the empty set's
    (-inf, -1, 0)), which this program alone reads and writes. With mask options (``masks``: HAS_IDS or
    HAS_GUIDE) the tile's positives and exclusions are formed once and every prefix's masked partials are
    merged into ``out_ptr`` [6, K, n] (:func:`_merge_masked_prefix`)."""
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    AXIS: tl.constexpr = 0 if BY_COLUMN else 1  # the tile's axis along a line
    MASKED: tl.constexpr = masks.HAS_IDS or masks.HAS_GUIDE
    count = ops.prefixes.count
    lines, n_lines, n_other, step, ok = _walk(ops, tile, BY_COLUMN)
    scale = tl.load(ops.scale_ptr)  # a device tensor, not a launch argument: no host sync, no fp32 rounding
    if BY_COLUMN or MASKED:
        pos = lines  # unused: the columns' positives are the rows' (the host scatters them); masked: the tile's
    else:
        pos = load_vector(ops.pos_ptr, lines, ops.q.n, 1, -1, True)
    for o0 in range(0, n_other, step):
        rows, cols = tile_at(lines, o0, BY_COLUMN, BLOCK_M, BLOCK_N)
        if MASKED:
            tile_masks = _tile_masks(masks, rows, cols)
        raw = tl.zeros([BLOCK_M, BLOCK_N], dtype=dot.ACC)
        hi = tl.load(ops.prefixes.bounds_ptr)
        for p in range(count):
            raw, hi, _, s, _, _ = _prefix_tile(ops, p, hi, raw, rows, cols, scale, tile, dot)
            at = out_ptr + p * n_lines.to(tl.int64) + lines  # [R, K, n]: stat rows K * n apart
            if MASKED:
                _merge_masked_prefix(at, count * n_lines, ok, s, tile_masks, masks, BY_COLUMN)
            else:
                tile_max, tile_rest = tile_rest_stats(s, AXIS)
                run_max = tl.load(at, mask=ok, other=float("-inf"))
                run_rest = tl.load(at + count * n_lines, mask=ok, other=-1.0)
                run_max, run_rest = merge_rest_stats(run_max, run_rest, tile_max, tile_rest)
                tl.store(at, run_max, mask=ok)
                tl.store(at + count * n_lines, run_rest, mask=ok)
                if not BY_COLUMN:
                    hit = tl.sum(tl.where(cols[None, :] == pos[:, None], s, 0.0), axis=1)
                    at_pos = at + 2 * count * n_lines
                    tl.store(at_pos, tl.load(at_pos, mask=ok, other=0.0) + hit, mask=ok)


@triton.jit
def _merge_masked_prefix(at, stride, ok, s, tile_masks, masks, BY_COLUMN: tl.constexpr):
    """Merge one prefix's tile ``s`` into its lines' masked partials at ``at`` (rows ``stride`` apart, the rows
    of :mod:`infcl.masks`, rest in place of rel; read, merged, written back: the program owns them): the stats
    over the entries its lines keep (rows: excluded_rows, columns: excluded_cols), the positives' max (and,
    "sum", rest), the sum of their logits and their count
    (:func:`infcl.kernels.softmax_mask_tiles.positive_partials`)."""
    AXIS: tl.constexpr = 0 if BY_COLUMN else 1
    POSITIVES: tl.constexpr = masks.POSITIVES
    EXCLUDES: tl.constexpr = masks.HAS_GUIDE or (masks.HAS_IDS and POSITIVES == ONE_POSITIVE)
    positive, excluded_rows, excluded_cols = tile_masks
    kept = s
    if EXCLUDES:
        if BY_COLUMN:
            kept = tl.where(excluded_cols, float("-inf"), s)
        else:
            kept = tl.where(excluded_rows, float("-inf"), s)
    tile_max, tile_rest = kept_rest_stats(kept, AXIS)
    run_max = tl.load(at, mask=ok, other=float("-inf"))
    run_rest = tl.load(at + stride, mask=ok, other=-1.0)
    run_max, run_rest = merge_kept_stats(run_max, run_rest, tile_max, tile_rest)
    tl.store(at, run_max, mask=ok)
    tl.store(at + stride, run_rest, mask=ok)
    pos_max = tl.load(at + 2 * stride, mask=ok, other=float("-inf"))
    pos_rest = tl.load(at + 3 * stride, mask=ok, other=-1.0)
    pos_sum = tl.load(at + 4 * stride, mask=ok, other=0.0)
    pos_count = tl.load(at + 5 * stride, mask=ok, other=0.0)
    pos_max, pos_rest, pos_sum, pos_count = positive_partials(
        s, positive, pos_max, pos_rest, pos_sum, pos_count, AXIS, POSITIVES
    )
    tl.store(at + 2 * stride, pos_max, mask=ok)
    tl.store(at + 3 * stride, pos_rest, mask=ok)
    tl.store(at + 4 * stride, pos_sum, mask=ok)
    tl.store(at + 5 * stride, pos_count, mask=ok)


@triton.jit
def _prefix_grad(s, stats_ptr, g_ptr, idx, n, p, count, is_pos, ROWS: tl.constexpr):
    """g^p (P^p - Y) over the tile along rows (ROWS: each row's stats) or columns, from the lines' global
    (m, r) of prefix ``p`` at stats_ptr [2, K, n] and their upstream gradients g_ptr [K, n]; 0 past n."""
    at = p * n.to(tl.int64)
    m = load_vector(stats_ptr + at, idx, n, 1, 0.0, True)
    r = load_vector(stats_ptr + count * n + at, idx, n, 1, 0.0, True)
    g = load_vector(g_ptr + at, idx, n, 1, 0.0, True)
    if ROWS:
        ds = softmax_grad(s, m[:, None], r[:, None], g[:, None], is_pos, True)
    else:
        ds = softmax_grad(s, m[None, :], r[None, :], g[None, :], is_pos, True)
    return ds


@triton.jit
def _masked_prefix_grad(s, up, idx, n, p, count, positive, excluded, masks, ROWS: tl.constexpr):
    """The masked g^p (P^p - Y) over the tile along rows (ROWS) or columns
    (:func:`infcl.kernels.softmax_mask_tiles.masked_softmax_grad`), from the lines' global (m, r) of prefix ``p``,
    their upstream gradients and, with several positives, their count ("mean") or global stats ("sum"):
    ``up`` = (stats [2, K, n], g [K, n], positives [K, n] or [2, K, n]); 0 past n."""
    POSITIVES: tl.constexpr = masks.POSITIVES
    EXCLUDES: tl.constexpr = masks.HAS_GUIDE or (masks.HAS_IDS and POSITIVES == ONE_POSITIVE)
    at = p * n.to(tl.int64)
    m = load_vector(up[0] + at, idx, n, 1, 0.0, True)
    r = load_vector(up[0] + count * n + at, idx, n, 1, 0.0, True)
    g = load_vector(up[1] + at, idx, n, 1, 0.0, True)
    if POSITIVES == MEAN_POSITIVES:
        pos_count = load_vector(up[2] + at, idx, n, 1, 1.0, True)
        pos_max = pos_count  # unused
        pos_rel = pos_count
    elif POSITIVES == SUM_POSITIVES:
        pos_max = load_vector(up[2] + at, idx, n, 1, 0.0, True)
        pos_rel = load_vector(up[2] + count * n + at, idx, n, 1, 0.0, True)
        pos_count = pos_max  # unused
    else:
        pos_count = m  # unused: one positive per row
        pos_max = m
        pos_rel = m
    if ROWS:
        ds = masked_softmax_grad(
            s,
            (m[:, None], r[:, None], g[:, None]),
            (pos_count[:, None], pos_max[:, None], pos_rel[:, None]),
            positive,
            excluded,
            POSITIVES,
            EXCLUDES,
        )
    else:
        ds = masked_softmax_grad(
            s,
            (m[None, :], r[None, :], g[None, :]),
            (pos_count[None, :], pos_max[None, :], pos_rel[None, :]),
            positive,
            excluded,
            POSITIVES,
            EXCLUDES,
        )
    return ds


@triton.jit
def _backward_lines(
    ops,
    upstream,
    out,
    tile,
    dot,
    masks,
    BY_COLUMN: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    SIGN_ONLY: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    """The backward program's lines (rows, or BY_COLUMN columns) and feature slice: their gradient slice (added
    to ``out.grad``, :class:`Outputs`) and, from the slice-0 programs, the sums per prefix and line of dS_row * u
    and dS_col * u (``out.sums_ptr``). ``upstream``: (row_stats [2, K, Bq], g_row [K, Bq], col_stats, g_col);
    ``out.dot``: the gradient products' operand dtype (its ACC: float32 for float16 inputs) and precision.
    SIGN_ONLY: prefix 0 is one wide and renormalized (:meth:`infcl.matryoshka.Prefixes.sign_only`): its
    features' gradient is exactly 0, so it joins no product (its sums, the scale's gradient, stay).
    With mask options (``masks``: HAS_IDS or HAS_GUIDE; ``upstream`` then also holds the rows' and columns'
    positives' inputs) the tile's positives and exclusions are formed once for every prefix and each dS^k is
    the masked softmax's (:func:`_masked_prefix_grad`)."""
    GRAD_F32: tl.constexpr = out.dot.ACC != ops.q.ptr.dtype.element_ty
    MASKED: tl.constexpr = masks.HAS_IDS or masks.HAS_GUIDE
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    AXIS: tl.constexpr = 0 if BY_COLUMN else 1  # the tile's axis along a line
    n_q = ops.q.n
    n_k = ops.k.n
    count = ops.prefixes.count
    lines, n_lines, n_other, step, ok = _walk(ops, tile, BY_COLUMN)
    f0 = tl.program_id(1) * BLOCK_OUT
    feats = f0 + tl.arange(0, BLOCK_OUT)
    # Every slice recomputes the same dS: the first writes the sums of its lines.
    write_sums = ok & (tl.zeros(lines.shape, tl.int32) + tl.program_id(1) == 0)
    scale = tl.load(ops.scale_ptr)
    grad = tl.zeros([lines.shape[0], BLOCK_OUT], dot.ACC)
    if BY_COLUMN or MASKED:
        pos = lines  # unused: the tile's rows' positives are loaded per tile (masked: with its masks)
    else:
        pos = load_vector(ops.pos_ptr, lines, n_q, 1, -1, True)
    for o0 in range(0, n_other, step):
        rows, cols = tile_at(lines, o0, BY_COLUMN, BLOCK_M, BLOCK_N)
        if MASKED:
            positive, excluded_rows, excluded_cols = _tile_masks(masks, rows, cols)
            is_pos = positive  # unused
        elif BY_COLUMN:
            is_pos = cols[None, :] == load_vector(ops.pos_ptr, rows, n_q, 1, -1, True)[:, None]
        else:
            is_pos = cols[None, :] == pos[:, None]
        raw = tl.zeros([BLOCK_M, BLOCK_N], dtype=dot.ACC)
        hi = tl.load(ops.prefixes.bounds_ptr)
        for p in range(count):
            raw, hi, u, s, a, b = _prefix_tile(ops, p, hi, raw, rows, cols, scale, tile, dot)
            if MASKED:
                row_up = (upstream[0], upstream[1], upstream[4])
                ds = _masked_prefix_grad(s, row_up, rows, n_q, p, count, positive, excluded_rows, masks, True)
            else:
                ds = _prefix_grad(s, upstream[0], upstream[1], rows, n_q, p, count, is_pos, True)
            at = out.sums_ptr + p * n_lines.to(tl.int64) + lines  # [2, K, n]: rows K * n apart
            part = tl.sum(ds * u, axis=AXIS)
            tl.store(at, tl.load(at, mask=write_sums, other=0.0) + part, mask=write_sums)
            if SYMMETRIC:
                if MASKED:
                    col_up = (upstream[2], upstream[3], upstream[5])
                    ds_col = _masked_prefix_grad(s, col_up, cols, n_k, p, count, positive, excluded_cols, masks, False)
                else:
                    ds_col = _prefix_grad(s, upstream[2], upstream[3], cols, n_k, p, count, is_pos, False)
                at = at + count * n_lines
                part = tl.sum(ds_col * u, axis=AXIS)
                tl.store(at, tl.load(at, mask=write_sums, other=0.0) + part, mask=write_sums)
                ds = ds + ds_col
            holds = hi > f0  # prefix p holds features of this slice: those below hi
            if SIGN_ONLY:
                holds = holds & (p > 0)
            if holds:
                operand = dot_operand(ds * a[:, None] * b[None, :], out.dot.ACC, out.dot.PRECISION)
                if BY_COLUMN:
                    other = load_tile(
                        Matrix(ops.q.ptr, n_q, hi, ops.q.stride_r, ops.q.stride_c), rows, feats, True, True
                    )
                    operand = tl.trans(operand)
                else:
                    other = load_tile(
                        Matrix(ops.k.ptr, n_k, hi, ops.k.stride_r, ops.k.stride_c), cols, feats, True, True
                    )
                if GRAD_F32:
                    other = other.to(tl.float32)
                grad = tile_dot(operand, other, grad, out.dot.UPCAST, out.dot.PRECISION)
    D = ops.q.d
    mask = ok[:, None] & (feats[None, :] < D)
    ptrs = out.grad.ptr + lines[:, None] * out.grad.stride_r + feats[None, :].to(tl.int64) * out.grad.stride_c
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + scale * grad, mask=mask)
