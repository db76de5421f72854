"""Top-k per row on the torch tiles (:func:`infcl.topk_scores`; any device), and the one merge of top-k lists.

``block_topk(block, col_index, found, largest, exclude_positive)`` (contract, order and eligibility:
:mod:`infcl.contract`) continues each row's :class:`infcl.contract.Candidates` in place with the block's
eligible columns. The order is strict (global indices are unique), so the n best of a union are the n best of
the n best of its parts, whatever the parts: :func:`merge_candidates` merges tiles, blocks and ring steps alike,
and the result depends on neither the tiling, the thread count nor the world size, only on the scores.

Per tile (the walk and tile sizes of every torch-tiles loss, :mod:`.walk`): one GEMM into a tile buffer, one
``torch.topk`` for the m-th best key (m = min(n, tile width)), and one integer ``torch.topk`` that takes every
entry above it and the ties at it by (eligible first, then column): the exact m best of the tile, whatever
order ``torch.topk`` breaks ties in.

Memory: the block's q and k in the accumulation dtype (copies only for low-precision inputs), a few
tiles, O(Bq * n) lists.
"""

from typing import Optional

import torch

from ...contract import NO_INDEX, Block, Candidates, Tensor
from .walk import TileSizes, Walk, positives


def best_first(key: Tensor, index: Tensor, n: int):
    """(key, index) of each row's n best entries of ``key`` / ``index`` [rows, m >= n], ordered by key
    descending, then index ascending: a stable sort by index, then a stable sort by key."""
    by_index = torch.sort(index, dim=1, stable=True)
    key = key.gather(1, by_index.indices)
    by_key = torch.sort(key, dim=1, descending=True, stable=True)
    order = by_key.indices[:, :n]
    return by_key.values[:, :n], by_index.values.gather(1, order)


def merge_candidates(acc: Candidates, part: Candidates) -> Candidates:
    """The n best (n = ``acc``'s width) of two candidate lists over disjoint columns, best first."""
    n = acc.key.shape[1]
    key, index = best_first(torch.cat((acc.key, part.key), 1), torch.cat((acc.index, part.index), 1), n)
    return Candidates(key, index, acc.nan + part.nan)


def tile_candidates(key: Tensor, eligible: Optional[Tensor], col_index: Tensor, n: int) -> Candidates:
    """The exact n best of one key tile [ni, nj] (``eligible``: [ni, nj] bool or None for all;
    ``col_index``: [nj] global indices, increasing), unordered; NaN keys are counted and left out."""
    ni, nj = key.shape
    nan = torch.isnan(key)
    keep = ~nan  # NaN is never returned: its row's scores become NaN
    if eligible is not None:
        nan.logical_and_(eligible)
        keep.logical_and_(eligible)
    key = key.masked_fill(~keep, float("-inf"))
    m = min(n, nj)
    kth = torch.topk(key, m, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    # Which m: every entry above the m-th key, then the entries tied with it by (kept, column). ``order``
    # ranks them so: above the m-th first (column - 3 nj: always kept), then kept ties (column), then
    # left-out ties (nj + column: they can only tie at -inf), the rest never (3 nj).
    column = torch.arange(nj, dtype=torch.int32, device=key.device).expand(ni, nj)
    tied = torch.where(keep, column, column + nj)
    order = torch.where(key > kth, column - 3 * nj, torch.where(key == kth, tied, 3 * nj))
    ranked = torch.topk(order, m, dim=1, largest=False, sorted=False)
    picked = ranked.indices
    real = ranked.values < nj  # above the m-th (always eligible) or an eligible tie
    index = torch.where(real, col_index[picked], NO_INDEX)
    nan_count = nan.sum(dim=1)
    found = Candidates(key.gather(1, picked), index, nan_count)
    if m == n:
        return found
    pad = Candidates.empty(ni, n - m, key.dtype, key.device)
    return Candidates(torch.cat((found.key, pad.key), 1), torch.cat((found.index, pad.index), 1), nan_count)


def _eligible(block: Block, tile, exclude_positive: bool) -> Optional[Tensor]:
    """[ni, nj] bool: the tile's entries a row may return (None: all)."""
    eligible = None
    if block.masks is not None:
        eligible = block.masks.q_ids[tile.rows, None] != block.masks.k_ids[None, tile.cols]
    if exclude_positive:
        inside, idx = positives(block.pos, tile)
        if eligible is None:
            eligible = torch.ones(tile.qi.shape[0], tile.kj.shape[0], dtype=torch.bool, device=tile.qi.device)
        eligible.scatter_(1, idx, eligible.gather(1, idx) & ~inside[:, None])
    return eligible


class TopKTiles(TileSizes):
    """``block_topk`` on the torch tiles."""

    def block_topk(self, block: Block, col_index: Tensor, found: Candidates, largest: bool, exclude_positive: bool):
        walk = Walk(block, self.tiles(block.q.device))
        (buf,) = walk.buffers(1)
        n = found.key.shape[1]
        for tile in walk:
            s = walk.scores(tile, buf)
            if not largest:
                s.neg_()
            part = tile_candidates(s, _eligible(block, tile, exclude_positive), col_index[tile.cols], n)
            rows = Candidates(*(t[tile.rows] for t in found))
            for mine, merged in zip(rows, merge_candidates(rows, part)):
                mine.copy_(merged)
