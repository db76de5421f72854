"""The chunked route's Triton passes (``backend="chunked"``, :mod:`infcl.backends.chunked`).

The route walks a block's query rows in chunks of C rows; cuBLAS writes ``raw = q_c @ k.T`` (unscaled, float32,
[C, Bk]) and these passes read it, once per phase:

- :func:`chunk_stats` (forward), two launches: ``s = raw * scale`` (an explicit ``mul.rn``,
  :func:`score_tiles.scale_scores`), each row's stats (max, rest) and positive logit, and (symmetric) each column's
  stats over the chunk's rows, in one read of ``raw``. Grid (row blocks, column splits): program (i, j) walks the
  BLOCK_N tiles of split j for the BLOCK_M rows of block i, the next tile's load issued before the current tile's
  arithmetic, and stores its rows' partials per split and its columns' partials per row block (one owner per
  entry: no atomics). One merge launch then takes every partial of the chunk: each row's over the splits into
  its (max, r = log1p(rest), positive), each column's over the row blocks merged into the running column stats
  of the chunks before (:func:`infcl.lse.lse_merge`'s arithmetic, in chunk order).
- :func:`chunk_grad` (backward): the same ``s`` from the same ``raw`` bits, ``dS = g_row * (P_row - Y)`` (+ the
  column term) in float32 with the positive's entry ``g * expm1(x)`` (:func:`tile_stats.softmax_grad`), the
  scale gradient's row and column partials ``sum(dS * raw)`` per program (summed by the host in index order),
  and ``dS * factor[i]`` stored in the products' operand dtype (``factor``: the scale, or for float16 the row's
  1 / gamma: see :mod:`infcl.backends.chunked.softmax`).

Per S entry the forward reads 4 bytes and the backward reads 4 and writes the operand's 2 (bf16 / fp16); the
partials add O((C / BLOCK_M) * Bk + (Bk / SPLIT) * C) per chunk. Positions and columns are int32 (a block has
fewer than 2**31 columns); row offsets are int64. Every sum has a fixed order (no atomics), so reruns are
bit-identical. Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests), where
:func:`score_tiles.scale_scores` and :func:`tile_stats.exp` take their numpy forms.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .chunk_tiles import (
    OPERANDS,
    column_splits,
    load_scores,
    round_operand,
    split_tiles,
    store_scores,
    tile_pass,
    unit_rows,
)
from .kernel_args import COMPILE_OPTIONS
from .score_tiles import masked_scores
from .tile_stats import exp, holds_positive, merge_kept_stats, positive_span, softmax_grad
from .tiling import (
    CHUNK_GRAD_TILE,
    CHUNK_MERGE_BLOCK,
    CHUNK_MERGE_PARTS,
    CHUNK_MERGE_WARPS,
    CHUNK_SPLIT_TILES,
    CHUNK_STATS_TILE,
)

# Contiguous score columns a thread loads at once (16 bytes of float32): the stats pass keeps each row's running stats
# per such lane across its tiles (an in-thread reduction per tile) and merges the lanes once, after its loop.
LANE = tl.constexpr(4)


@triton.jit
def log1p(x):
    """log(1 + x) to full relative precision near 0 (Kahan's trick: log(u) * x / (u - 1), u = 1 + x); -1 -> -inf.
    tl.log is libdevice's logf on NVIDIA GPUs (numpy's log under the interpreter)."""
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def _add_pairs(a_sum, a_ties, b_sum, b_ties):
    return a_sum + b_sum, a_ties + b_ties


@triton.jit
def _line_stats(s, AXIS: tl.constexpr):
    """:func:`tile_stats.kept_rest_stats` of a tile along AXIS (0: per column, 1: per row, 2: per row and lane of a
    [rows, lanes, LANE] view), with the terms' sum and the ties' count in one reduction (one shared-memory round
    across warps and its barriers, instead of two)."""
    t = tl.max(s, axis=AXIS)
    if AXIS == 2:
        t_b = t[:, :, None]
    elif AXIS == 1:
        t_b = t[:, None]
    else:
        t_b = t[None, :]
    at_max = s == t_b
    others, ties = tl.reduce((tl.where(at_max, 0.0, exp(s - t_b)), at_max.to(tl.float32)), AXIS, _add_pairs)
    return t, tl.where(t == float("-inf"), -1.0, others + (ties - 1.0))


@triton.jit
def _merged(m, rest, AXIS: tl.constexpr):
    """Stats in rest form (a tile of them) merged along AXIS (0 or 1): the maximal entries keep their rest and count
    their 1, the others' rest + 1 is scaled down (:func:`tile_stats.merge_rest_stats`'s arithmetic over a line);
    a line of empty sets (-inf, -1) stays the empty set. A fixed order of sums: deterministic."""
    t = tl.max(m, axis=AXIS)
    if AXIS == 1:
        t_b = t[:, None]
    else:
        t_b = t[None, :]
    at_max = m == t_b
    terms = tl.where(at_max, rest, (rest + 1.0) * exp(m - t_b))
    summed, ties = tl.reduce((terms, at_max.to(tl.float32)), AXIS, _add_pairs)
    return t, summed + (ties - 1.0)


@triton.jit
def _chunk_stats_kernel(
    raw_ptr,
    scale_ptr,
    pos_ptr,
    rows_ptr,
    cols_ptr,
    n_rows,
    n_cols,
    stride_raw,
    stride_rows_stat,
    stride_rows_part,
    stride_cols_stat,
    stride_cols_part,
    SYMMETRIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ptrs = raw_ptr + rows[:, None].to(tl.int64) * stride_raw
    scale = tl.load(scale_ptr)
    # int32 columns (a block has < 2**31): the positives' compares and the column indices in one register each
    pos = tl.load(pos_ptr + rows, mask=rows < n_rows, other=-1).to(tl.int32)
    lo, hi = positive_span(pos)
    # The rows' running stats per lane: each row's LANE-wide column groups (a thread's contiguous entries) kept apart
    # across the tiles and merged across lanes once after the loop, so the per-tile row reduction is in-thread.
    m = tl.full([BLOCK_M, BLOCK_N // LANE], float("-inf"), tl.float32)
    rest = tl.full([BLOCK_M, BLOCK_N // LANE], -1.0, tl.float32)  # the empty set
    positive = tl.zeros([BLOCK_M], tl.float32)
    first, n_tiles = split_tiles(split, n_cols, BLOCK_N, SPLIT_TILES)
    offsets = tl.arange(0, BLOCK_N)
    raw = load_scores(row_ptrs, rows, first * BLOCK_N + offsets, n_rows, n_cols, EVEN_M, EVEN_N)
    for t in range(0, n_tiles):
        c0 = (first + t) * BLOCK_N
        cols = c0 + offsets
        # Software pipelining: the next tile's load is issued before this tile's arithmetic (the last tile loads
        # itself again, from L2, so the loads stay unmasked on even tiles).
        ahead = (first + tl.minimum(t + 1, n_tiles - 1)) * BLOCK_N + offsets
        raw_ahead = load_scores(row_ptrs, rows, ahead, n_rows, n_cols, EVEN_M, EVEN_N)
        s = masked_scores(raw, scale, rows, cols, n_rows, n_cols, not EVEN_M, not EVEN_N)
        t_row, rest_row = _line_stats(tl.reshape(s, [BLOCK_M, BLOCK_N // LANE, LANE]), 2)
        m, rest = merge_kept_stats(m, rest, t_row, rest_row)
        if holds_positive(lo, hi, c0, BLOCK_N, True):
            positive += tl.sum(tl.where(cols[None, :] == pos[:, None], s, 0.0), axis=1)
        if SYMMETRIC:
            t_col, rest_col = _line_stats(s, 0)
            out = cols_ptr + row_block.to(tl.int64) * stride_cols_part + cols
            tl.store(out, t_col, mask=cols < n_cols)
            tl.store(out + stride_cols_stat, rest_col, mask=cols < n_cols)
        raw = raw_ahead
    m, rest = _merged(m, rest, 1)  # the lanes
    out = rows_ptr + split.to(tl.int64) * stride_rows_part + rows
    tl.store(out, m, mask=rows < n_rows)
    tl.store(out + stride_rows_stat, rest, mask=rows < n_rows)
    tl.store(out + 2 * stride_rows_stat, positive, mask=rows < n_rows)


@triton.jit
def _parts_stats(parts_ptr, idx, inside, n_parts, stride_stat, stride_part, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """(m, rest) of entries ``idx`` merged over ``n_parts`` partials (rest form, parts[0/1, p, idx]): PARTS of them
    at a time as one [PARTS, BLOCK] tile (:func:`_merged`), merged into the running stats in order."""
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    rest = tl.full([BLOCK], -1.0, tl.float32)
    for p0 in range(0, n_parts, PARTS):
        part = p0 + tl.arange(0, PARTS)
        mask = (part[:, None] < n_parts) & inside[None, :]
        ptrs = parts_ptr + part[:, None].to(tl.int64) * stride_part + idx[None, :]
        m_p = tl.load(ptrs, mask=mask, other=float("-inf"))
        rest_p = tl.load(ptrs + stride_stat, mask=mask, other=-1.0)
        t, rest_t = _merged(m_p, rest_p, 0)
        m, rest = merge_kept_stats(m, rest, t, rest_t)
    return m, rest


@triton.jit
def _parts_sum(parts_ptr, idx, inside, n_parts, stride_part, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """sum over p of parts[p, idx], PARTS at a time, in a fixed order."""
    total = tl.zeros([BLOCK], tl.float32)
    for p0 in range(0, n_parts, PARTS):
        part = p0 + tl.arange(0, PARTS)
        mask = (part[:, None] < n_parts) & inside[None, :]
        total += tl.sum(tl.load(parts_ptr + part[:, None].to(tl.int64) * stride_part + idx[None, :], mask=mask,
                                other=0.0), axis=0)  # fmt: skip
    return total


@triton.jit
def _lse_merge(m_a, r_a, m_b, r_b):
    """:func:`infcl.lse.lse_merge` of stats in the contract's form (m, r): r = logaddexp(r_a + (m_a - M),
    r_b + (m_b - M)), an empty side (m = -inf) the identity, NaN kept."""
    new_m = tl.maximum(m_a, m_b, propagate_nan=tl.PropagateNan.ALL)
    x = tl.where(m_a == float("-inf"), m_a, r_a + (m_a - new_m))
    y = tl.where(m_b == float("-inf"), m_b, r_b + (m_b - new_m))
    hi = tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)
    lo = tl.minimum(x, y, propagate_nan=tl.PropagateNan.ALL)
    return new_m, tl.where(hi == float("-inf"), hi, hi + log1p(exp(lo - hi)))


@triton.jit
def _merge_chunk_kernel(
    row_parts_ptr,
    rows_out_ptr,
    col_parts_ptr,
    cols_ptr,
    n_rows,
    n_cols,
    n_splits,
    n_row_blocks,
    stride_row_parts_stat,
    stride_row_parts_part,
    stride_rows_out_stat,
    stride_col_parts_stat,
    stride_col_parts_part,
    stride_cols_stat,
    ROW_PROGRAMS: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One launch for a chunk's partials: the first ROW_PROGRAMS programs merge each row's partials over the
    column splits into rows_out (max, r = log1p(rest), positive logit); the others (SYMMETRIC) each column's over
    the row blocks, merged (ACCUMULATE) into the running column stats ``cols`` (the contract's (m, r): the chunks
    in order), or stored there as (m, r)."""
    program = tl.program_id(0)
    if program < ROW_PROGRAMS:
        idx = program * BLOCK + tl.arange(0, BLOCK)
        inside = idx < n_rows
        m, rest = _parts_stats(
            row_parts_ptr, idx, inside, n_splits, stride_row_parts_stat, stride_row_parts_part, PARTS, BLOCK
        )
        positive = _parts_sum(
            row_parts_ptr + 2 * stride_row_parts_stat, idx, inside, n_splits, stride_row_parts_part, PARTS, BLOCK
        )
        tl.store(rows_out_ptr + idx, m, mask=inside)
        tl.store(rows_out_ptr + stride_rows_out_stat + idx, log1p(rest), mask=inside)
        tl.store(rows_out_ptr + 2 * stride_rows_out_stat + idx, positive, mask=inside)
    elif SYMMETRIC:
        idx = (program - ROW_PROGRAMS) * BLOCK + tl.arange(0, BLOCK)
        inside = idx < n_cols
        m, rest = _parts_stats(
            col_parts_ptr, idx, inside, n_row_blocks, stride_col_parts_stat, stride_col_parts_part, PARTS, BLOCK
        )
        r = log1p(rest)
        if ACCUMULATE:
            m_acc = tl.load(cols_ptr + idx, mask=inside, other=float("-inf"))
            r_acc = tl.load(cols_ptr + stride_cols_stat + idx, mask=inside, other=float("-inf"))
            m, r = _lse_merge(m_acc, r_acc, m, r)
        tl.store(cols_ptr + idx, m, mask=inside)
        tl.store(cols_ptr + stride_cols_stat + idx, r, mask=inside)


@triton.jit
def _chunk_grad_kernel(
    raw_ptr,
    ds_ptr,
    scale_ptr,
    factor_ptr,
    pos_ptr,
    row_stats_ptr,
    g_row_ptr,
    col_stats_ptr,
    g_col_ptr,
    dscale_ptr,
    n_rows,
    n_cols,
    stride_raw,
    stride_ds,
    stride_factor,
    stride_row_stat,
    stride_col_stat,
    stride_dscale,
    SYMMETRIC: tl.constexpr,
    OPERAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    row_block = tl.program_id(0)
    split = tl.program_id(1)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in = rows < n_rows
    row_ptrs = raw_ptr + rows[:, None].to(tl.int64) * stride_raw
    ds_ptrs = ds_ptr + rows[:, None].to(tl.int64) * stride_ds
    scale = tl.load(scale_ptr)
    pos = tl.load(pos_ptr + rows, mask=row_in, other=-1).to(tl.int32)
    lo, hi = positive_span(pos)
    m_row = tl.load(row_stats_ptr + rows, mask=row_in, other=0.0)[:, None]
    r_row = tl.load(row_stats_ptr + stride_row_stat + rows, mask=row_in, other=0.0)[:, None]
    g_row = tl.load(g_row_ptr + rows, mask=row_in, other=0.0)[:, None]
    factor = tl.load(factor_ptr + rows.to(tl.int64) * stride_factor, mask=row_in, other=0.0)[:, None]
    # The scale gradient's terms dS * raw, summed per entry of the tile over the split's tiles and reduced once at
    # the end (no reduction per tile).
    row_terms = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    col_terms = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first, n_tiles = split_tiles(split, n_cols, BLOCK_N, SPLIT_TILES)
    offsets = tl.arange(0, BLOCK_N)
    raw = load_scores(row_ptrs, rows, first * BLOCK_N + offsets, n_rows, n_cols, EVEN_M, EVEN_N)
    for t in range(0, n_tiles):
        c0 = (first + t) * BLOCK_N
        cols = c0 + offsets
        ahead = (first + tl.minimum(t + 1, n_tiles - 1)) * BLOCK_N + offsets  # the next tile, loaded now
        raw_ahead = load_scores(row_ptrs, rows, ahead, n_rows, n_cols, EVEN_M, EVEN_N)
        s = masked_scores(raw, scale, rows, cols, n_rows, n_cols, not EVEN_M, not EVEN_N)
        has_pos = holds_positive(lo, hi, c0, BLOCK_N, True)
        is_pos = cols[None, :] == pos[:, None]
        ds = softmax_grad(s, m_row, r_row, g_row, is_pos, has_pos)
        if SYMMETRIC:
            col_in = cols < n_cols
            m_col = tl.load(col_stats_ptr + cols, mask=col_in, other=0.0)[None, :]
            r_col = tl.load(col_stats_ptr + stride_col_stat + cols, mask=col_in, other=0.0)[None, :]
            g_col = tl.load(g_col_ptr + cols, mask=col_in, other=0.0)[None, :]
            dc = softmax_grad(s, m_col, r_col, g_col, is_pos, has_pos)
            col_terms += dc * raw
            row_terms += ds * raw
            ds += dc
        else:
            row_terms += ds * raw
        store_scores(ds_ptrs, rows, cols, round_operand(ds * factor, OPERAND), n_rows, n_cols, EVEN_M, EVEN_N)
        raw = raw_ahead
    program = row_block * tl.num_programs(1) + split
    tl.store(dscale_ptr + program, tl.sum(tl.sum(row_terms, axis=1), axis=0))
    tl.store(dscale_ptr + stride_dscale + program, tl.sum(tl.sum(col_terms, axis=1), axis=0))


# ---- launchers ----------------------------------------------------------------------------------------


def launch_programs(kernel: str, n_rows: int, n_cols: int, symmetric: bool) -> int:
    """Programs of one launch of pass ``kernel`` ("stats", "merge", "grad") over a [n_rows, n_cols] chunk."""
    if kernel == "merge":
        return triton.cdiv(n_rows, CHUNK_MERGE_BLOCK) + (triton.cdiv(n_cols, CHUNK_MERGE_BLOCK) if symmetric else 0)
    tile = CHUNK_STATS_TILE if kernel == "stats" else CHUNK_GRAD_TILE
    return triton.cdiv(n_rows, tile.block_m) * column_splits(n_cols, tile.block_n, CHUNK_SPLIT_TILES)


def chunk_stats(
    raw: torch.Tensor,
    scale: torch.Tensor,
    pos: torch.Tensor,
    symmetric: bool,
    rows_out: torch.Tensor,
    cols: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """The forward pass over one chunk, in two launches (the stats pass, then one merge of its partials). ``raw``
    [C, Bk] float32 (row stride free, columns contiguous), ``scale`` 0-d float32, ``pos`` [C] int64 (the positive's
    column, -1 for none). Writes ``rows_out`` [3, C] (max, r, positive logit or 0). Symmetric: the chunk's column
    stats [2, Bk] (max, r) over its C rows are merged into ``cols`` in place (the running stats of the chunks
    before, in the contract's form: :func:`infcl.lse.lse_merge`'s arithmetic), or returned when ``cols`` is None.
    Returns the column stats (``cols`` itself where given), or None."""
    n_rows, n_cols = raw.shape
    assert raw.stride(1) == 1 and rows_out.stride(1) == 1, "the passes read rows of contiguous columns"
    grid, tile_args = tile_pass(raw, CHUNK_STATS_TILE, CHUNK_SPLIT_TILES)
    row_blocks, splits = grid
    row_parts = torch.empty(3, splits, n_rows, dtype=torch.float32, device=raw.device)
    col_parts = torch.empty(2, row_blocks, n_cols, dtype=torch.float32, device=raw.device) if symmetric else None
    _chunk_stats_kernel[grid](
        scale_ptr=scale,
        pos_ptr=unit_rows(pos),
        rows_ptr=row_parts,
        cols_ptr=col_parts,
        stride_rows_stat=row_parts.stride(0),
        stride_rows_part=row_parts.stride(1),
        stride_cols_stat=col_parts.stride(0) if symmetric else 0,
        stride_cols_part=col_parts.stride(1) if symmetric else 0,
        SYMMETRIC=symmetric,
        **tile_args,
    )
    accumulate = cols is not None
    if symmetric and not accumulate:
        cols = torch.empty(2, n_cols, dtype=torch.float32, device=raw.device)
    assert not symmetric or cols.stride(1) == 1, "the running column stats are rows of contiguous columns"
    row_programs = triton.cdiv(n_rows, CHUNK_MERGE_BLOCK)
    _merge_chunk_kernel[(launch_programs("merge", n_rows, n_cols, symmetric),)](
        row_parts_ptr=row_parts,
        rows_out_ptr=rows_out,
        col_parts_ptr=col_parts,
        cols_ptr=cols if symmetric else None,
        n_rows=n_rows,
        n_cols=n_cols,
        n_splits=splits,
        n_row_blocks=row_blocks,
        stride_row_parts_stat=row_parts.stride(0),
        stride_row_parts_part=row_parts.stride(1),
        stride_rows_out_stat=rows_out.stride(0),
        stride_col_parts_stat=col_parts.stride(0) if symmetric else 0,
        stride_col_parts_part=col_parts.stride(1) if symmetric else 0,
        stride_cols_stat=cols.stride(0) if symmetric else 0,
        ROW_PROGRAMS=row_programs,
        SYMMETRIC=symmetric,
        ACCUMULATE=accumulate,
        PARTS=CHUNK_MERGE_PARTS,
        BLOCK=CHUNK_MERGE_BLOCK,
        num_warps=CHUNK_MERGE_WARPS,
        **COMPILE_OPTIONS,
    )
    return cols if symmetric else None


def chunk_grad(
    raw: torch.Tensor,
    ds: torch.Tensor,
    scale: torch.Tensor,
    factor: torch.Tensor,
    pos: torch.Tensor,
    row_stats: torch.Tensor,
    g_row: torch.Tensor,
    col_stats: Optional[torch.Tensor],
    g_col: Optional[torch.Tensor],
    operand: torch.dtype,
) -> torch.Tensor:
    """The backward pass over one chunk: writes ``ds`` [C, Bk] = dS * factor rounded to ``operand`` (stored in
    ``ds``'s dtype: the operand's on a GPU, float32 holding the rounded values for the CPU products) and returns
    the scale gradient's (row, column) parts ``[2]``, sums of dS * raw. ``factor``: [C] or a 0-d tensor (the scale)
    read with stride 0. ``row_stats`` [2, C], ``g_row`` [C]; symmetric: ``col_stats`` [2, Bk], ``g_col`` [Bk]."""
    assert raw.stride(1) == 1 and ds.stride(1) == 1, "the passes read and write rows of contiguous columns"
    pos, row_stats, g_row = unit_rows(pos), unit_rows(row_stats), unit_rows(g_row)
    if col_stats is not None:
        col_stats, g_col = unit_rows(col_stats), unit_rows(g_col)
    grid, tile_args = tile_pass(raw, CHUNK_GRAD_TILE, CHUNK_SPLIT_TILES)
    parts = torch.empty(2, grid[0] * grid[1], dtype=torch.float32, device=raw.device)
    symmetric = col_stats is not None
    _chunk_grad_kernel[grid](
        ds_ptr=ds,
        scale_ptr=scale,
        factor_ptr=factor,
        pos_ptr=pos,
        row_stats_ptr=row_stats,
        g_row_ptr=g_row,
        col_stats_ptr=col_stats,  # None (never traced) for the one-directional loss
        g_col_ptr=g_col if symmetric else None,
        dscale_ptr=parts,
        stride_ds=ds.stride(0),
        stride_factor=factor.stride(0) if factor.dim() else 0,
        stride_row_stat=row_stats.stride(0),
        stride_col_stat=col_stats.stride(0) if symmetric else 0,
        stride_dscale=parts.stride(0),
        SYMMETRIC=symmetric,
        OPERAND=OPERANDS[operand],
        **tile_args,
    )
    return parts.sum(dim=1)


def pass_bytes(n_rows: int, n_cols: int, operand: torch.dtype, symmetric: bool) -> Tuple[int, int]:
    """HBM bytes (forward, backward) of the passes over one chunk: the scores read (and dS written), the partials
    written and read back by the merge, the column stats read and written (the A/B's GB/s)."""
    block_m, block_n = CHUNK_STATS_TILE.block_m, CHUNK_STATS_TILE.block_n
    splits = column_splits(n_cols, block_n, CHUNK_SPLIT_TILES)
    forward = n_rows * n_cols * 4 + 2 * 12 * splits * n_rows + 12 * n_rows
    if symmetric:
        forward += 2 * 8 * triton.cdiv(n_rows, block_m) * n_cols + 16 * n_cols
    element = torch.empty((), dtype=operand).element_size()
    backward = n_rows * n_cols * (4 + element) + (12 * n_cols if symmetric else 0)
    return forward, backward


__all__ = ["chunk_grad", "chunk_stats", "launch_programs", "log1p", "pass_bytes"]
