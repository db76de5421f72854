"""The MaxSim (late-interaction) loss on the native CPU kernel (``csrc/maxsim.cpp``; contract: :mod:`infcl.contract`).

The block is walked one tile of documents at a time, all queries against it. ``torch.ops.infcl.maxsim_scores``
forms the tile of scores R [Bq, nd] in C++ (the token products by one fixed-order register block, the max over
each document's real tokens, the weighted sum over each query's tokens) and, in the backward, each max's winning
document token (the lowest index among equal maxima); the softmax over the tile is the torch tiles' own
(:mod:`infcl.backends.torch_tiles.maxsim`'s ``merge_score_tile`` and ``score_tile_gradients``:
:func:`infcl.lse.lse_merge`, the ids' false negatives, the positives); ``torch.ops.infcl.maxsim_route_`` then routes
C = scale * dS through the winners: dq += P @ docs and dk += P.T @ q as sparse products in a fixed order.

Token products per tile: 1 in the forward, 1 in the backward (the recomputation; the routing reads the winners
instead of multiplying by a dense P). Extra memory: the tile's winners (int32, [Bq, Lq, nd]) and its packed
documents, each bounded by :data:`TILE_BYTES`, the [Bq, nd] score tile, and per thread a group of packed queries
and one strip of products (csrc/maxsim_tokens.h).
"""

from typing import Iterator, Tuple

import torch

from ...contract import Block, Tensor, accum_dtype
from ...lse import empty_stats
from ..torch_tiles.maxsim import merge_score_tile, score_tile_gradients
from ..torch_tiles.walk import Tile
from .build import torch_ops

# Bytes of each of a tile's two large buffers, the winners (4 bytes per query token and document) and the packed
# documents (D accumulation-dtype values per real token): 8 MiB each, so that B = 1024 x Lq = 32 queries take 64
# documents a tile (16 calls per block at Bk = 1024) and the loss stays far inside the 64 MiB.
TILE_BYTES = 8 * 1024 * 1024
WINNER_BYTES = 4  # int32


def documents_per_tile(block: Block) -> int:
    """How many documents a tile holds: as many as :data:`TILE_BYTES` allows both for the winners and for the
    packed documents, at least 1."""
    bq, lq, d = block.q.shape
    bk, lk, _ = block.k.shape
    per_winner_doc = bq * lq * WINNER_BYTES
    per_packed_doc = lk * d * torch.finfo(accum_dtype(block.q.dtype)).bits // 8
    return max(1, min(bk, TILE_BYTES // per_winner_doc, TILE_BYTES // per_packed_doc))


def _score_tiles(block: Block, with_winners: bool) -> Iterator[Tuple[Tile, Tensor, Tensor]]:
    """(tile, R [Bq, nd], winners [Bq, Lq, nd] or empty) for each tile of documents, in order."""
    ops = torch_ops()
    bq, bk = block.q.shape[0], block.k.shape[0]
    step = documents_per_tile(block)
    for j0 in range(0, bk, step):
        cols = slice(j0, min(j0 + step, bk))
        docs = block.k[cols]
        mask = None if block.k_mask is None else block.k_mask[cols]
        raw, winners = ops.maxsim_scores(block.q, docs, block.q_weight, mask, with_winners)
        yield Tile(slice(0, bq), cols, block.q, docs), raw, winners


class NativeMaxSim:
    """The MaxSim loss's block operations on the custom ops."""

    def maxsim_forward_block(self, block: Block) -> Tensor:
        acc, dev = accum_dtype(block.q.dtype), block.q.device
        bq = block.q.shape[0]
        rows = torch.cat((empty_stats(bq, acc, dev), torch.zeros(1, bq, dtype=acc, device=dev)))
        for tile, raw, _ in _score_tiles(block, with_winners=False):
            merge_score_tile(block, rows, tile, raw)
        return rows

    def maxsim_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        dscale = torch.zeros(2, dtype=accum_dtype(block.q.dtype), device=block.q.device)
        ops = torch_ops()
        for tile, raw, winners in _score_tiles(block, with_winners=True):
            coef = score_tile_gradients(block, tile, raw, dscale)
            ops.maxsim_route_(block.q, tile.kj, winners, coef, block.q_weight, dq, dk[tile.cols])
        return dscale
