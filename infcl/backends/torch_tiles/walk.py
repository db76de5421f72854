"""The torch tiles' walk: one block's q and k in the accumulation dtype, cut into tile_q x tile_k tiles (row tiles
outer), with flat tile buffers, and the tile sizes per device kind. Every loss's tiles (:mod:`.softmax`,
:mod:`.sigmoid`, :mod:`.distill`, :mod:`.rank`) walk the same way, so a tile recomputed in a later pass is the same
product with the same shapes: bit-identical.

Where scores of *different* tiles are compared (the ranks' and top-k's order, the guide thresholds), each tile's
scores are read out of one product of the block's full tile shape (:meth:`Walk.scores`, :func:`window_product`):
a BLAS picks its kernel by shape, and two kernels may sum a dot product in different orders (MKL's sgemm on
AVX-512 Intel CPUs does, for a 2 x 5 against a 2 x 3 tile), so the same dot product in a ragged tile would
otherwise miss its tie by an ulp. On a CPU that product is also padded to whole micro-kernel blocks
(:data:`CPU_PRODUCT_MULTIPLE`): within one product, MKL sums the edge rows and columns in another order.
"""

from typing import NamedTuple, Optional, Tuple

import torch

from ...contract import Block, Tensor, accum_dtype

# CPU tile sizes (2 MiB fp32 tiles; the backward holds four). On the 2-vCPU AMD EPYC family 25 model 1 (Zen 3,
# AVX2), B=4096, D=512, fp32 symmetric fwd+bwd, 512 x 1024 ran 10-20% faster than 256 x 1024 on 2 threads: MKL
# splits a 256-row product badly over two threads, and dk's product (dS.T @ q) is only tile_q deep. Larger tiles
# ran within the noise of 512 x 1024 there, and the masked loss's tile buffers and bool tiles must stay below
# tests/test_masks_memory.py's one-B x B-bool-mask bound at B=4096 (13 of 16 MiB at 512 x 1024; 1024 x 1024's
# four plain tile buffers alone are 16); see docs/benchmarks.md (issue 35).
CPU_TILES = (512, 1024)
# On a GPU each tile op is a kernel launch, so tiles must be large enough to fill the device: 2048 x 4096
# fp32 tiles are 32 MiB each (a handful live at once), small beside any GPU's memory, and every product
# is large enough for cuBLAS to reach its full rate. Not measured on a GPU yet.
GPU_TILES = (2048, 4096)
# A compared product's rows and columns on a CPU, padded with zero rows to a multiple of this. One product shape per
# tile is not enough there: MKL's sgemm sums the rows and columns beyond its AVX-512 micro-kernel's width in another
# order than the rest of the same product (on an AMD EPYC Zen 4, a duplicate column at position 4 of a 5-column
# product, or duplicate rows of a 2- or 3-row one, differ by an ulp), so an exact duplicate would miss its tie. With
# both sides multiples of 16, no duplicate row or column differed there for D in 1 ... 768 (issue 52's note).
CPU_PRODUCT_MULTIPLE = 16


class Tile(NamedTuple):
    """One tile of a block: its rows (of q) and columns (of k), and their features in the accumulation dtype."""

    rows: slice
    cols: slice
    qi: Tensor  # [ni, D]
    kj: Tensor  # [nj, D]

    def view(self, buf: Tensor) -> Tensor:
        """A contiguous [ni, nj] view at the start of a preallocated flat buffer."""
        ni, nj = self.qi.shape[0], self.kj.shape[0]
        return buf[: ni * nj].view(ni, nj)


class Walk:
    """One block's q and k in the accumulation dtype, walked tile by tile, row tiles outer."""

    def __init__(self, block: Block, tiles: Tuple[int, int]):
        self.acc = accum_dtype(block.q.dtype)
        self.q, self.k = block.q.to(self.acc), block.k.to(self.acc)
        self.device = self.q.device
        self.tq, self.tk = tiles

    def zeros(self, *shape: int) -> Tensor:
        return torch.zeros(*shape, dtype=self.acc, device=self.device)

    def buffers(self, n: int):
        """``n`` flat buffers, each large enough for one tile."""
        numel = min(self.q.shape[0], self.tq) * min(self.k.shape[0], self.tk)
        return [torch.empty(numel, dtype=self.acc, device=self.device) for _ in range(n)]

    def scores(self, tile: Tile, buf: Tensor) -> Tensor:
        """The tile's q @ k.T out of the block's full-size product that holds it (:func:`window_product`), so
        that equal dot products compare equal across tiles; a view into ``buf`` (a :meth:`buffers` buffer)."""
        return window_product(self.q, self.k, tile.rows, tile.cols, buf)

    def __iter__(self):
        for i0 in range(0, self.q.shape[0], self.tq):
            rows = slice(i0, i0 + self.tq)
            for j0 in range(0, self.k.shape[0], self.tk):
                cols = slice(j0, j0 + self.tk)
                yield Tile(rows, cols, self.q[rows], self.k[cols])


def full_window(tile: slice, n: int) -> Tuple[slice, slice]:
    """(window, part): the full-size window (``tile``'s length, at most ``n``) that holds ``tile`` of an axis
    of ``n``, shifted back from the end where the tile is ragged, and the tile's place inside it."""
    size = min(tile.stop - tile.start, n)
    start = min(tile.start, n - size)
    return slice(start, start + size), slice(tile.start - start, min(tile.stop, n) - start)


def window_product(a: Tensor, b: Tensor, rows: slice, cols: slice, buf: Optional[Tensor] = None) -> Tensor:
    """(a @ b.T)[rows, cols], read out of the full-size tile product that holds it (:func:`full_window` on each
    axis): every tile of a block is then one product shape. ``buf``: a flat buffer of a's dtype for the
    product (None: a new tensor); the result is a view into it."""
    (row_window, row_part), (col_window, col_part) = full_window(rows, a.shape[0]), full_window(cols, b.shape[0])
    aw, bw = _zero_padded(a[row_window]), _zero_padded(b[col_window])
    if aw.shape[0] != row_window.stop - row_window.start or bw.shape[0] != col_window.stop - col_window.start:
        buf = None  # the padded product is larger than a tile buffer
    out = None if buf is None else buf[: aw.shape[0] * bw.shape[0]].view(aw.shape[0], bw.shape[0])
    return torch.mm(aw, bw.T, out=out)[row_part, col_part]


def product_rows(n: int, device: torch.device) -> int:
    """The rows (or columns) a compared product of ``n`` takes: on a CPU, ``n`` rounded up to a multiple of
    :data:`CPU_PRODUCT_MULTIPLE`; elsewhere ``n``."""
    if device.type != "cpu":
        return n
    return -(-n // CPU_PRODUCT_MULTIPLE) * CPU_PRODUCT_MULTIPLE


def _zero_padded(x: Tensor) -> Tensor:
    """``x`` [n, D] with zero rows appended up to :func:`product_rows` (x itself where that is n)."""
    n = x.shape[0]
    padded = product_rows(n, x.device)
    if padded == n:
        return x
    out = x.new_zeros(padded, x.shape[1])
    out[:n] = x
    return out


def positives(pos: Tensor, tile: Tile) -> Tuple[Tensor, Tensor]:
    """(inside, idx): which of the tile's rows have their positive (``pos``: column in the block) among
    the tile's columns, and its column in the tile (clamped to a valid index for the rest, whose
    gathered values are then ignored)."""
    nj = tile.kj.shape[0]
    p = pos[tile.rows] - tile.cols.start
    inside = (p >= 0) & (p < nj)
    return inside, p.clamp(0, nj - 1)[:, None]


def replace_positives(out: Tensor, inside: Tensor, idx: Tensor, values: Tensor) -> Tensor:
    """out[i, idx[i]] = values[i] for the rows whose positive lies in this tile (``inside``); in place."""
    return out.scatter_(1, idx, torch.where(inside[:, None], values, out.gather(1, idx)))


class TileSizes:
    """The tile sizes of a torch-tiles backend: ``tile_q`` x ``tile_k``, or the device kind's defaults."""

    def __init__(self, tile_q: Optional[int] = None, tile_k: Optional[int] = None):
        self.tile_q = tile_q
        self.tile_k = tile_k

    def tiles(self, device: torch.device) -> Tuple[int, int]:
        """(tile_q, tile_k): the explicit sizes if given, else the device kind's defaults."""
        tq, tk = CPU_TILES if device.type == "cpu" else GPU_TILES
        return self.tile_q or tq, self.tile_k or tk
