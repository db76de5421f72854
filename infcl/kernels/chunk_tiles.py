"""What the chunked route's passes (:mod:`.chunked_softmax`, :mod:`.chunked_sigmoid`) share: the [C, Bk] float32
score tile's loads and the operand tile's stores (rows of contiguous columns, int64 row offsets), a program's
column split, dS's rounding to the products' operand dtype, and the launch geometry the host derives from them.
"""

from typing import Tuple

import torch
import triton
import triton.language as tl

from .kernel_args import COMPILE_OPTIONS, even_blocks
from .score_tiles import PTX

# The operand dtypes the passes store dS in, as the kernels' OPERAND constexpr.
OPERANDS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
def load_scores(row_ptrs, rows, cols, n_rows, n_cols, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile raw[rows, cols] (``row_ptrs``: the rows' starts, [BLOCK_M, 1]); 0 outside
    the chunk (masked_scores makes s -inf there)."""
    ptrs = row_ptrs + cols[None, :]
    if EVEN_M and EVEN_N:
        raw = tl.load(ptrs)
    else:
        raw = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
    return raw


@triton.jit
def store_scores(row_ptrs, rows, cols, value, n_rows, n_cols, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """Store the [BLOCK_M, BLOCK_N] tile ``value`` at [rows, cols] (``row_ptrs`` as :func:`load_scores` takes
    them), nothing outside the chunk."""
    ptrs = row_ptrs + cols[None, :]
    if EVEN_M and EVEN_N:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def split_tiles(split, n_cols, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr):
    """(first column tile, tiles) of column split ``split``."""
    first = split * SPLIT_TILES
    return first, tl.minimum(SPLIT_TILES, tl.cdiv(n_cols, BLOCK_N) - first)


def column_splits(n_cols: int, block_n: int, split_tiles: int) -> int:
    """Column splits of a pass over ``n_cols`` columns in tiles of ``block_n``, ``split_tiles`` tiles a split (the
    pass's SPLIT_TILES: CHUNK_SPLIT_TILES)."""
    return triton.cdiv(triton.cdiv(n_cols, block_n), split_tiles)


def tile_pass(raw: torch.Tensor, tile, split_tiles: int) -> Tuple[Tuple[int, int], dict]:
    """(grid, arguments) of a tile pass over the chunk ``raw`` [C, Bk] with S tile ``tile`` (a
    :class:`~infcl.kernels.configs.TileConfig`), ``split_tiles`` column tiles a split: the grid (row blocks,
    column splits), and what every tile pass takes: the chunk, its sizes and row stride, the tile, the split,
    the EVEN flags and the compile options."""
    n_rows, n_cols = raw.shape
    grid = (triton.cdiv(n_rows, tile.block_m), column_splits(n_cols, tile.block_n, split_tiles))
    return grid, dict(
        raw_ptr=raw,
        n_rows=n_rows,
        n_cols=n_cols,
        stride_raw=raw.stride(0),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        SPLIT_TILES=split_tiles,
        **even_blocks(n_rows, n_cols, tile.block_m, tile.block_n),
        num_warps=tile.num_warps,
        **COMPILE_OPTIONS,
    )


def unit_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride in its last dim (the kernels read its rows so; a copy only for such a view)."""
    return t if t.stride(-1) == 1 else t.contiguous()
