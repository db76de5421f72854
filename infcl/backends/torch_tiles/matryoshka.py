"""The softmax loss over Matryoshka prefixes on the torch tiles (math: :mod:`infcl.matryoshka`).

Forward, per tile: the raw product grows segment by segment (``addmm_``), and at each prefix's boundary
S^k = raw * scale (times a^k_i b^k_j where the prefix is renormalized) gives that prefix's row (and column)
stats and positive, exactly as the plain tiles' forward does for one S. Backward, per tile: the raw
products of every prefix are recomputed the same way (one buffer each), then, widest prefix first,
dS^k = g^k * (P^k - Y) (:func:`.softmax.probabilities`), the scale's gradient, the renormalization's
per-row and per-column sums c^k = sum dS^k * S^k, and W = sum over the prefixes so far of dS^k * scale * a^k b^k,
whose products with the segment's columns are dq's and dk's share of that segment.

GEMMs per block: forward one (over D), backward three (over D), as the plain loss; the elementwise work is
K times the plain loss's. Extra memory: K + 3 tile buffers.
"""

from typing import Optional, Tuple

import torch

from ...contract import Block, Tensor
from ...lse import empty_stats, lse_merge, tile_stats
from ...matryoshka import Prefixes, prefix_factors
from .softmax import _plain_masks, probabilities
from .walk import TileSizes, Walk, positives


def _scaled(raw: Tensor, scale: Tensor, a: Optional[Tensor], b: Optional[Tensor], out: Tensor) -> Tensor:
    """u = raw * a_i * b_j (raw itself without renormalization; ``out`` a tile view otherwise)."""
    if a is None:
        return raw
    return torch.mul(raw, a[:, None], out=out).mul_(b[None, :])


class MatryoshkaTiles(TileSizes):
    """The Matryoshka softmax loss's block operations on the torch tiles (:mod:`infcl.losses.matryoshka`)."""

    def matryoshka_forward_block(
        self, block: Block, prefixes: Prefixes, symmetric: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(row stats [2, K, Bq], row positives [K, Bq], column stats [2, K, Bk] or None)."""
        walk = Walk(block, self.tiles(block.q.device))
        bq, bk, acc, dev, n = walk.q.shape[0], walk.k.shape[0], walk.acc, walk.device, prefixes.count
        row_stats = empty_stats(n * bq, acc, dev).view(2, n, bq)
        row_pos = walk.zeros(n, bq)
        col_stats = empty_stats(n * bk, acc, dev).view(2, n, bk) if symmetric else None
        a, b = prefix_factors(walk.q, prefixes), prefix_factors(walk.k, prefixes)
        raw_buf, s_buf, scratch, ones = walk.buffers(4)
        for tile in walk:
            raw = tile.view(raw_buf).zero_()
            inside, idx = positives(block.pos, tile)
            for k in range(n):
                seg = prefixes.segment(k)
                raw.addmm_(tile.qi[:, seg], tile.kj[:, seg].T)
                renorm = prefixes.renormalize[k]
                u = _scaled(raw, block.scale, a[k, tile.rows] if renorm else None, b[k, tile.cols], tile.view(s_buf))
                s = torch.mul(u, block.scale, out=tile.view(s_buf))  # the backward repeats exactly these operations
                lse_merge(row_stats[:, k, tile.rows], tile_stats(s, 1, tile.view(scratch), tile.view(ones)))
                if symmetric:
                    lse_merge(col_stats[:, k, tile.cols], tile_stats(s, 0, tile.view(scratch), tile.view(ones)))
                pos_row = row_pos[k, tile.rows]
                torch.where(inside, s.gather(1, idx).squeeze(1), pos_row, out=pos_row)
        return row_stats, row_pos, col_stats

    def matryoshka_backward_block(self, block: Block, prefixes: Prefixes, dq: Tensor, dk: Tensor) -> Tensor:
        """dq, dk accumulated in place; returns dscale [2] (rows' part, columns' part). ``block.row_stats``
        [2, K, Bq] and ``block.g_row`` [K, Bq] (symmetric: ``col_stats``, ``g_col`` likewise) per prefix."""
        walk = Walk(block, self.tiles(block.q.device))
        scale, symmetric, n = block.scale, block.symmetric, prefixes.count
        dscale = walk.zeros(2)
        a, b = prefix_factors(walk.q, prefixes), prefix_factors(walk.k, prefixes)
        row_c, col_c = walk.zeros(n, walk.q.shape[0]), walk.zeros(n, walk.k.shape[0])
        raws = walk.buffers(n)
        u_buf, s_buf, ds_buf, w_buf = walk.buffers(4)
        col_buf = walk.buffers(1)[0] if symmetric else None
        for tile in walk:
            raw = tile.view(raws[0]).zero_()
            for k in range(n):
                seg = prefixes.segment(k)
                if k:
                    raw = tile.view(raws[k]).copy_(raw)  # R^k starts from R^(k-1), as the forward grows it
                raw.addmm_(tile.qi[:, seg], tile.kj[:, seg].T)
            masks = _plain_masks(block, tile)
            w = tile.view(w_buf).zero_()
            for k in reversed(range(n)):
                raw = tile.view(raws[k])
                renorm = prefixes.renormalize[k]
                ak, bk = (a[k, tile.rows], b[k, tile.cols]) if renorm else (None, None)
                u = _scaled(raw, scale, ak, bk, tile.view(u_buf))
                s = torch.mul(u, scale, out=tile.view(s_buf))
                ds = probabilities(
                    tile.view(ds_buf),
                    s,
                    masks,
                    None,
                    block.row_stats[:, k, tile.rows, None],
                    block.g_row[k, tile.rows, None],
                    None,
                    s,
                )
                dscale[0] += torch.dot(ds.view(-1), u.reshape(-1))
                if symmetric:
                    pc = probabilities(
                        tile.view(col_buf),
                        s,
                        masks,
                        None,
                        block.col_stats[:, k, None, tile.cols],
                        block.g_col[k, None, tile.cols],
                        None,
                        s,
                    )
                    dscale[1] += torch.dot(pc.view(-1), u.reshape(-1))
                    ds.add_(pc)
                if prefixes.sign_only(k):
                    pass  # its features' gradient is exactly 0: nothing joins W or the normalization's sums
                elif renorm:  # probabilities left s as it was (one positive per row: no scratch use)
                    prod = s.mul_(ds)
                    row_c[k, tile.rows] += prod.sum(dim=1)
                    col_c[k, tile.cols] += prod.sum(dim=0)
                    w.add_(ds.mul_(ak[:, None]).mul_(bk[None, :]).mul_(scale))
                else:
                    w.add_(ds.mul_(scale))  # W: the sum over the prefixes holding segment k of scale * dS^k * a^k b^k
                seg = prefixes.segment(k)
                dq[tile.rows, seg].addmm_(w, tile.kj[:, seg])
                dk[tile.cols, seg].addmm_(w.T, tile.qi[:, seg])
        # The normalization's own gradient: -a_i^2 c_i q_i[:m] (columns alike), per prefix.
        for k in range(n):
            if prefixes.renormalize[k]:
                m = prefixes.dims[k]
                dq[:, :m].sub_(walk.q[:, :m] * (a[k] * a[k] * row_c[k])[:, None])
                dk[:, :m].sub_(walk.k[:, :m] * (b[k] * b[k] * col_c[k])[:, None])
        return dscale
