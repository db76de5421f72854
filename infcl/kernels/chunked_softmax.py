"""The chunked route's two Triton passes (``backend="chunked"``, :mod:`infcl.backends.chunked`).

The route walks a block's query rows in chunks of C rows; cuBLAS writes ``raw = q_c @ k.T`` (unscaled, float32,
[C, Bk]) and these passes read it, once per phase:

- :func:`chunk_stats` (forward): ``s = raw * scale`` (an explicit ``mul.rn``, :func:`score_tiles.scale_scores`), each
  row's stats (max, rest) and positive logit, and (symmetric) each column's stats over the chunk's rows, in one
  read of ``raw``. Grid (row blocks, column splits): program (i, j) walks the BLOCK_N tiles of split j for the
  BLOCK_M rows of block i and stores its rows' partials per split and its columns' partials per row block (one
  owner per entry: no atomics). :func:`merge_parts` then merges the partials of each row (column) in the order
  of their index, in one launch, and the host turns ``rest`` into ``r = log1p(rest)`` (:mod:`infcl.lse`).
- :func:`chunk_grad` (backward): the same ``s`` from the same ``raw`` bits, ``dS = g_row * (P_row - Y)`` (+ the
  column term) in float32 with the positive's entry ``g * expm1(x)`` (:func:`tile_stats.softmax_grad`), the
  scale gradient's row and column partials ``sum(dS * raw)`` per program (summed by the host in index order),
  and ``dS * factor[i]`` stored in the products' operand dtype (``factor``: the scale, or for float16 the row's
  1 / gamma: see :mod:`infcl.backends.chunked.softmax`).

Per S entry the forward reads 4 bytes and the backward reads 4 and writes the operand's 2 (bf16 / fp16); the
partials add O((C / BLOCK_M) * Bk + (Bk / SPLIT) * C) per chunk. Under TRITON_INTERPRET=1 the same kernels run on
CPU tensors (the tests), where :func:`score_tiles.scale_scores` and :func:`tile_stats.exp` take their numpy forms.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..lse import REL
from .kernel_args import COMPILE_OPTIONS
from .score_tiles import PTX, masked_scores
from .tile_stats import holds_positive, kept_rest_stats, merge_kept_stats, positive_span, softmax_grad
from .tiling import CHUNK_GRAD_TILE, CHUNK_MERGE_BLOCK, CHUNK_SPLIT_TILES, CHUNK_STATS_TILE


@triton.jit
def round_operand(x, OPERAND: tl.constexpr):
    """float32 ``x`` rounded to ``OPERAND`` to nearest even. Triton's interpreter casts float32 to bfloat16 by
    truncation (numpy has no bfloat16), a bias of -2**-9 per entry on average; there the rounding is done on the
    bits (add 0x7FFF plus the kept part's lowest bit, clear the low 16), as float32 values."""
    if OPERAND == tl.float32:
        y = x
    elif not PTX and OPERAND == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(OPERAND, fp_downcast_rounding="rtne")
    return y


@triton.jit
def _load_raw(raw_ptr, rows, cols, n_rows, n_cols, stride_raw, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile raw[rows, cols]; 0 outside the chunk (masked_scores makes s -inf there)."""
    ptrs = raw_ptr + rows[:, None].to(tl.int64) * stride_raw + cols[None, :]
    if EVEN_M and EVEN_N:
        raw = tl.load(ptrs)
    else:
        raw = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    return raw


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
    scale = tl.load(scale_ptr)
    pos = tl.load(pos_ptr + rows, mask=rows < n_rows, other=-1)
    lo, hi = positive_span(pos)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    rest = tl.full([BLOCK_M], -1.0, tl.float32)  # the empty set
    positive = tl.zeros([BLOCK_M], tl.float32)
    first = split * SPLIT_TILES
    n_tiles = tl.minimum(SPLIT_TILES, tl.cdiv(n_cols, BLOCK_N) - first)
    for t in range(0, n_tiles):
        c0 = (first + t) * BLOCK_N
        cols = c0 + tl.arange(0, BLOCK_N)
        raw = _load_raw(raw_ptr, rows, cols, n_rows, n_cols, stride_raw, EVEN_M, EVEN_N)
        s = masked_scores(raw, scale, rows, cols, n_rows, n_cols, not EVEN_M, not EVEN_N)
        t_row, rest_row = kept_rest_stats(s, 1)
        m, rest = merge_kept_stats(m, rest, t_row, rest_row)
        if holds_positive(lo, hi, c0, BLOCK_N, True):
            positive += tl.sum(tl.where(cols[None, :] == pos[:, None], s, 0.0), axis=1)
        if SYMMETRIC:
            t_col, rest_col = kept_rest_stats(s, 0)
            out = cols_ptr + row_block.to(tl.int64) * stride_cols_part + cols
            tl.store(out, t_col, mask=cols < n_cols)
            tl.store(out + stride_cols_stat, rest_col, mask=cols < n_cols)
    out = rows_ptr + split.to(tl.int64) * stride_rows_part + rows
    tl.store(out, m, mask=rows < n_rows)
    tl.store(out + stride_rows_stat, rest, mask=rows < n_rows)
    tl.store(out + 2 * stride_rows_stat, positive, mask=rows < n_rows)


@triton.jit
def _merge_parts_kernel(
    parts_ptr,
    out_ptr,
    n,
    n_parts,
    stride_part_stat,
    stride_part,
    stride_out_stat,
    HAS_SUM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[:, i] = the merge of parts[:, 0, i], parts[:, 1, i], ... in that order: stats in rest form (rows 0-1),
    and (HAS_SUM) row 2 summed."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < n
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    rest = tl.full([BLOCK], -1.0, tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for p in range(0, n_parts):
        part = parts_ptr + p * stride_part + idx
        t = tl.load(part, mask=inside, other=float("-inf"))
        rest_t = tl.load(part + stride_part_stat, mask=inside, other=-1.0)
        m, rest = merge_kept_stats(m, rest, t, rest_t)
        if HAS_SUM:
            total += tl.load(part + 2 * stride_part_stat, mask=inside, other=0.0)
    tl.store(out_ptr + idx, m, mask=inside)
    tl.store(out_ptr + stride_out_stat + idx, rest, mask=inside)
    if HAS_SUM:
        tl.store(out_ptr + 2 * stride_out_stat + idx, total, mask=inside)


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
    scale = tl.load(scale_ptr)
    pos = tl.load(pos_ptr + rows, mask=row_in, other=-1)
    lo, hi = positive_span(pos)
    m_row = tl.load(row_stats_ptr + rows, mask=row_in, other=0.0)[:, None]
    r_row = tl.load(row_stats_ptr + stride_row_stat + rows, mask=row_in, other=0.0)[:, None]
    g_row = tl.load(g_row_ptr + rows, mask=row_in, other=0.0)[:, None]
    factor = tl.load(factor_ptr + rows.to(tl.int64) * stride_factor, mask=row_in, other=0.0)[:, None]
    row_part = tl.zeros([BLOCK_M], tl.float32)  # the scale gradient's terms, summed per row
    col_part = tl.zeros([BLOCK_M], tl.float32)
    first = split * SPLIT_TILES
    n_tiles = tl.minimum(SPLIT_TILES, tl.cdiv(n_cols, BLOCK_N) - first)
    for t in range(0, n_tiles):
        c0 = (first + t) * BLOCK_N
        cols = c0 + tl.arange(0, BLOCK_N)
        raw = _load_raw(raw_ptr, rows, cols, n_rows, n_cols, stride_raw, EVEN_M, EVEN_N)
        s = masked_scores(raw, scale, rows, cols, n_rows, n_cols, not EVEN_M, not EVEN_N)
        has_pos = holds_positive(lo, hi, c0, BLOCK_N, True)
        is_pos = cols[None, :] == pos[:, None]
        ds = softmax_grad(s, m_row, r_row, g_row, is_pos, has_pos)
        row_part += tl.sum(ds * raw, axis=1)
        if SYMMETRIC:
            col_in = cols < n_cols
            m_col = tl.load(col_stats_ptr + cols, mask=col_in, other=0.0)[None, :]
            r_col = tl.load(col_stats_ptr + stride_col_stat + cols, mask=col_in, other=0.0)[None, :]
            g_col = tl.load(g_col_ptr + cols, mask=col_in, other=0.0)[None, :]
            dc = softmax_grad(s, m_col, r_col, g_col, is_pos, has_pos)
            col_part += tl.sum(dc * raw, axis=1)
            ds += dc
        out = ds_ptr + rows[:, None].to(tl.int64) * stride_ds + cols[None, :]
        value = round_operand(ds * factor, OPERAND)
        if EVEN_M and EVEN_N:
            tl.store(out, value)
        else:
            tl.store(out, value, mask=row_in[:, None] & (cols[None, :] < n_cols))
    program = row_block * tl.num_programs(1) + split
    tl.store(dscale_ptr + program, tl.sum(row_part, axis=0))
    tl.store(dscale_ptr + stride_dscale + program, tl.sum(col_part, axis=0))


# ---- launchers ----------------------------------------------------------------------------------------


def _even(n_rows: int, n_cols: int, block_m: int, block_n: int) -> dict:
    return {"EVEN_M": n_rows % block_m == 0, "EVEN_N": n_cols % block_n == 0}


def _unit(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride in its last dim (the kernels read its rows so; a copy only for such a view)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _splits(n_cols: int, block_n: int) -> int:
    return triton.cdiv(triton.cdiv(n_cols, block_n), CHUNK_SPLIT_TILES)


def merge_parts(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``parts`` [R, P, n] (R = 2 stats in rest form, or 3 with a summed row) merged over P in index order into
    ``out`` [R, n] (any row stride; the last dim contiguous), then rest -> r = log1p(rest) (the contract's form;
    the empty set's -1 becomes -inf). Returns ``out``."""
    n_stats, n_parts, n = parts.shape
    _merge_parts_kernel[(triton.cdiv(n, CHUNK_MERGE_BLOCK),)](
        parts_ptr=parts,
        out_ptr=out,
        n=n,
        n_parts=n_parts,
        stride_part_stat=parts.stride(0),
        stride_part=parts.stride(1),
        stride_out_stat=out.stride(0),
        HAS_SUM=n_stats == 3,
        BLOCK=CHUNK_MERGE_BLOCK,
        **COMPILE_OPTIONS,
    )
    out[REL].log1p_()
    return out


def chunk_stats(
    raw: torch.Tensor,
    scale: torch.Tensor,
    pos: torch.Tensor,
    symmetric: bool,
    rows_out: torch.Tensor,
) -> Optional[torch.Tensor]:
    """The forward pass over one chunk. ``raw`` [C, Bk] float32 (row stride free, columns contiguous), ``scale``
    0-d float32, ``pos`` [C] int64 (the positive's column, -1 for none). Writes ``rows_out`` [3, C] (max, r,
    positive logit or 0) and returns the chunk's column stats [2, Bk] (max, r) over its C rows, or None."""
    n_rows, n_cols = raw.shape
    assert raw.stride(1) == 1 and rows_out.stride(1) == 1, "the passes read rows of contiguous columns"
    pos = _unit(pos)
    block_m, block_n = CHUNK_STATS_TILE.block_m, CHUNK_STATS_TILE.block_n
    row_blocks, splits = triton.cdiv(n_rows, block_m), _splits(n_cols, block_n)
    rows = torch.empty(3, splits, n_rows, dtype=torch.float32, device=raw.device)
    cols = torch.empty(2, row_blocks, n_cols, dtype=torch.float32, device=raw.device) if symmetric else None
    _chunk_stats_kernel[(row_blocks, splits)](
        raw_ptr=raw,
        scale_ptr=scale,
        pos_ptr=pos,
        rows_ptr=rows,
        cols_ptr=cols,
        n_rows=n_rows,
        n_cols=n_cols,
        stride_raw=raw.stride(0),
        stride_rows_stat=rows.stride(0),
        stride_rows_part=rows.stride(1),
        stride_cols_stat=cols.stride(0) if symmetric else 0,
        stride_cols_part=cols.stride(1) if symmetric else 0,
        SYMMETRIC=symmetric,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLIT_TILES=CHUNK_SPLIT_TILES,
        **_even(n_rows, n_cols, block_m, block_n),
        num_warps=CHUNK_STATS_TILE.num_warps,
        **COMPILE_OPTIONS,
    )
    merge_parts(rows, rows_out)
    if not symmetric:
        return None
    return merge_parts(cols, torch.empty(2, n_cols, dtype=torch.float32, device=raw.device))


_OPERANDS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
    n_rows, n_cols = raw.shape
    assert raw.stride(1) == 1 and ds.stride(1) == 1, "the passes read and write rows of contiguous columns"
    pos, row_stats, g_row = _unit(pos), _unit(row_stats), _unit(g_row)
    if col_stats is not None:
        col_stats, g_col = _unit(col_stats), _unit(g_col)
    block_m, block_n = CHUNK_GRAD_TILE.block_m, CHUNK_GRAD_TILE.block_n
    row_blocks, splits = triton.cdiv(n_rows, block_m), _splits(n_cols, block_n)
    parts = torch.empty(2, row_blocks * splits, dtype=torch.float32, device=raw.device)
    symmetric = col_stats is not None
    _chunk_grad_kernel[(row_blocks, splits)](
        raw_ptr=raw,
        ds_ptr=ds,
        scale_ptr=scale,
        factor_ptr=factor,
        pos_ptr=pos,
        row_stats_ptr=row_stats,
        g_row_ptr=g_row,
        col_stats_ptr=col_stats,  # None (never traced) for the one-directional loss
        g_col_ptr=g_col if symmetric else None,
        dscale_ptr=parts,
        n_rows=n_rows,
        n_cols=n_cols,
        stride_raw=raw.stride(0),
        stride_ds=ds.stride(0),
        stride_factor=factor.stride(0) if factor.dim() else 0,
        stride_row_stat=row_stats.stride(0),
        stride_col_stat=col_stats.stride(0) if symmetric else 0,
        stride_dscale=parts.stride(0),
        SYMMETRIC=symmetric,
        OPERAND=_OPERANDS[operand],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SPLIT_TILES=CHUNK_SPLIT_TILES,
        **_even(n_rows, n_cols, block_m, block_n),
        num_warps=CHUNK_GRAD_TILE.num_warps,
        **COMPILE_OPTIONS,
    )
    return parts.sum(dim=1)


def pass_bytes(n_rows: int, n_cols: int, operand: torch.dtype, symmetric: bool) -> Tuple[int, int]:
    """HBM bytes (forward pass, backward pass) over one chunk, the partials included (the A/B's GB/s)."""
    block_m, block_n = CHUNK_STATS_TILE.block_m, CHUNK_STATS_TILE.block_n
    splits = _splits(n_cols, block_n)
    forward = n_rows * n_cols * 4 + 12 * splits * n_rows
    if symmetric:
        forward += 8 * triton.cdiv(n_rows, block_m) * n_cols
    element = torch.empty((), dtype=operand).element_size()
    backward = n_rows * n_cols * (4 + element) + (16 * n_cols if symmetric else 0)
    return forward, backward


__all__ = ["chunk_grad", "chunk_stats", "merge_parts", "pass_bytes"]
