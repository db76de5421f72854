"""The chunked route's sigmoid (SigLIP) pass (``backend="chunked"``, :mod:`infcl.backends.chunked.sigmoid`).

cuBLAS writes a chunk's ``raw = q_c @ k.T`` (unscaled, float32, [C, Bk]); this pass reads it once. With the logits
L = scale * raw + bias and the margins t = -z * L (z = +1 at the row's positive), the fused kernels' own entry math
(:mod:`infcl.kernels.sigmoid`: ``_margins``, ``_softplus``, ``_sigmoid``, from one e = exp(-|t|)):

- LOSS: each row's sum of softplus(t) over the chunk's Bk columns (its loss over the block: a row's entries are
  independent, so no statistic is needed before its gradient);
- GRAD: dL = g_i * -z * sigmoid(t) in float32, the scale and bias gradients' partials sum(dL * raw) and sum(dL)
  per program, and ``dL * factor[i]`` stored in the products' operand dtype (``factor``: the scale, or for
  float16 the row's 1 / gamma, as the softmax pass: :mod:`infcl.backends.chunked.products`).

Both at once is the route's one-pass SigLIP (its forward takes the loss and, for a unit upstream gradient, dS and
the products dq, dk: 3 GEMM-equivalents per block); LOSS alone a forward without gradient, GRAD alone the backward
of ``reduction="none"`` (per-row upstream gradients). Grid (row blocks, column splits): program (i, j) walks the
BLOCK_N tiles of split j for the BLOCK_M rows of block i and writes its rows' loss partials per split and its
gradient partials in its own slot (one owner per entry: no atomics); torch sums them in index order. A program
sums its rows' terms per entry over its tiles and reduces them once after its loop; the positive's sign flips run
only in a tile that may hold one (a uniform branch, as in :mod:`.chunked_softmax`). Per S entry
it reads 4 bytes and (GRAD) writes the operand's 2.
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
from .sigmoid import _margins, _sigmoid, _softplus
from .tile_stats import holds_positive, positive_span
from .tiling import CHUNK_GRAD_TILE, CHUNK_SPLIT_TILES


@triton.jit
def _entries(
    raw, scale, bias, g, pos_offset, BLOCK_N: tl.constexpr, POS: tl.constexpr, LOSS: tl.constexpr, GRAD: tl.constexpr
):
    """(softplus(t), dL) of a tile's entries (each 0 where not asked for), ``POS``: the tile may hold a positive,
    at the offset ``pos_offset`` of its row (an int32 compare with the tile's own offsets: one an entry)."""
    if POS:
        is_pos = tl.arange(0, BLOCK_N)[None, :] == pos_offset[:, None]
        margin = _margins(raw, is_pos, scale, bias)
    else:
        margin = raw * scale + bias  # _margins without a positive
    term = tl.zeros_like(raw)
    dl = tl.zeros_like(raw)
    if LOSS:
        term = _softplus(margin)
    if GRAD:
        dl = g * _sigmoid(margin)
        if POS:
            dl = tl.where(is_pos, -dl, dl)
    return term, dl


@triton.jit
def _chunk_sigmoid_kernel(
    raw_ptr,
    ds_ptr,
    params_ptr,
    factor_ptr,
    pos_ptr,
    g_ptr,
    loss_ptr,
    grad_parts_ptr,
    n_rows,
    n_cols,
    stride_raw,
    stride_ds,
    stride_factor,
    stride_loss,
    stride_grad_parts,
    LOSS: tl.constexpr,
    GRAD: tl.constexpr,
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
    scale = tl.load(params_ptr)
    bias = tl.load(params_ptr + 1)
    pos = tl.load(pos_ptr + rows, mask=row_in, other=-1).to(tl.int32)  # a column index: int32 compares
    lo, hi = positive_span(pos)
    # Each row's sums (the loss, dL * raw, dL), accumulated per entry of the tile over the split's tiles and
    # reduced once after the loop (no reduction per tile; a fixed order: deterministic).
    loss = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dscale = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dbias = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GRAD:
        g = tl.load(g_ptr + rows, mask=row_in, other=0.0)[:, None]
        factor = tl.load(factor_ptr + rows.to(tl.int64) * stride_factor, mask=row_in, other=0.0)[:, None]
        ds_ptrs = ds_ptr + rows[:, None].to(tl.int64) * stride_ds
    else:
        g = 0.0
    row_ptrs = raw_ptr + rows[:, None].to(tl.int64) * stride_raw
    first, n_tiles = split_tiles(split, n_cols, BLOCK_N, SPLIT_TILES)
    offsets = tl.arange(0, BLOCK_N)
    for t in range(0, n_tiles):
        c0 = (first + t) * BLOCK_N
        cols = c0 + offsets
        raw = load_scores(row_ptrs, rows, cols, n_rows, n_cols, EVEN_M, EVEN_N)
        # The positives' work (t = -L and -dL there) only in a tile that may hold one: a uniform branch, all but
        # one or two column tiles per row block take the other.
        if holds_positive(lo, hi, c0, BLOCK_N, True):
            term, dl = _entries(raw, scale, bias, g, pos - c0, BLOCK_N, True, LOSS, GRAD)
        else:
            term, dl = _entries(raw, scale, bias, g, pos - c0, BLOCK_N, False, LOSS, GRAD)
        if LOSS:
            if not (EVEN_M and EVEN_N):
                # Zero outside the chunk explicitly: a padded entry must not add to any sum, whatever it holds.
                term = tl.where(row_in[:, None] & (cols[None, :] < n_cols), term, 0.0)
            loss += term
        if GRAD:
            if not (EVEN_M and EVEN_N):
                dl = tl.where(row_in[:, None] & (cols[None, :] < n_cols), dl, 0.0)
            dscale += dl * raw
            dbias += dl
            store_scores(ds_ptrs, rows, cols, round_operand(dl * factor, OPERAND), n_rows, n_cols, EVEN_M, EVEN_N)
    if LOSS:
        tl.store(loss_ptr + split.to(tl.int64) * stride_loss + rows, tl.sum(loss, axis=1), mask=row_in)
    if GRAD:
        program = row_block * tl.num_programs(1) + split
        tl.store(grad_parts_ptr + program, tl.sum(tl.sum(dscale, axis=1), axis=0))
        tl.store(grad_parts_ptr + stride_grad_parts + program, tl.sum(tl.sum(dbias, axis=1), axis=0))


def sigmoid_chunk(
    raw: torch.Tensor,
    params: torch.Tensor,
    pos: torch.Tensor,
    loss_out: Optional[torch.Tensor],
    ds: Optional[torch.Tensor],
    factor: Optional[torch.Tensor],
    g_row: Optional[torch.Tensor],
    operand: torch.dtype,
) -> Optional[torch.Tensor]:
    """The sigmoid pass over one chunk. ``raw`` [C, Bk] float32 (row stride free, columns contiguous),
    ``params`` [2] float32 (scale, bias), ``pos`` [C] int64 (the positive's column, -1 for none).
    ``loss_out`` [C] (or None): written with each row's sum of softplus over the chunk's columns. ``ds`` [C, Bk]
    (or None: no gradient): written with dL * factor rounded to ``operand`` (stored in ``ds``'s dtype), dL =
    g_row * -z * sigmoid(t); ``factor`` [C] or 0-d (read with stride 0). Returns the (scale, bias) gradients'
    parts ``[2]`` (sums of dL * raw and dL), or None without ``ds``."""
    n_rows = raw.shape[0]
    grad = ds is not None
    assert raw.stride(1) == 1 and (not grad or ds.stride(1) == 1), "the pass reads and writes contiguous rows"
    assert loss_out is not None or grad, "a pass that computes nothing"
    pos = unit_rows(pos)
    grid, tile_args = tile_pass(raw, CHUNK_GRAD_TILE, CHUNK_SPLIT_TILES)
    losses = torch.empty(grid[1], n_rows, dtype=torch.float32, device=raw.device) if loss_out is not None else None
    parts = torch.empty(2, grid[0] * grid[1], dtype=torch.float32, device=raw.device) if grad else None
    _chunk_sigmoid_kernel[grid](
        ds_ptr=ds,  # None (never traced) without a gradient
        params_ptr=params,
        factor_ptr=factor,
        pos_ptr=pos,
        g_ptr=unit_rows(g_row) if grad else None,
        loss_ptr=losses,
        grad_parts_ptr=parts,
        stride_ds=ds.stride(0) if grad else 0,
        stride_factor=factor.stride(0) if grad and factor.dim() else 0,
        stride_loss=losses.stride(0) if losses is not None else 0,
        stride_grad_parts=parts.stride(0) if grad else 0,
        LOSS=loss_out is not None,
        GRAD=grad,
        OPERAND=OPERANDS[operand],
        **tile_args,
    )
    if loss_out is not None:
        torch.sum(losses, dim=0, out=loss_out)
    return parts.sum(dim=1) if grad else None


def pass_bytes(n_rows: int, n_cols: int, operand: torch.dtype, grad: bool) -> Tuple[int, int]:
    """HBM bytes of one chunk's pass: (read, written), the partials included (the A/B's GB/s)."""
    splits = column_splits(n_cols, CHUNK_GRAD_TILE.block_n, CHUNK_SPLIT_TILES)
    element = torch.empty((), dtype=operand).element_size()
    written = 4 * splits * n_rows + (n_rows * n_cols * element if grad else 0)
    return n_rows * n_cols * 4, written


__all__ = ["pass_bytes", "sigmoid_chunk"]
