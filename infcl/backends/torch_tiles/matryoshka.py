"""The softmax loss over Matryoshka prefixes on the torch tiles (math: :mod:`infcl.matryoshka`).

Forward, per tile: the raw product grows segment by segment (``addmm_``), and at each prefix's boundary
S^k = raw * scale (times a^k_i b^k_j where the prefix is renormalized) gives that prefix's row (and column)
stats and positive, exactly as the plain tiles' forward does for one S. Backward, per tile: the raw
products of every prefix are recomputed the same way (one buffer each), then, widest prefix first,
dS^k = g^k * (P^k - Y) (:func:`.softmax.probabilities`), the scale's gradient, the renormalization's
per-row and per-column sums c^k = sum dS^k * S^k, and W = sum over the prefixes so far of dS^k * scale * a^k b^k,
whose products with the segment's columns are dq's and dk's share of that segment.

With the mask options (:mod:`infcl.masks`; ``masked_matryoshka``): a tile's positives and exclusions do not
depend on the prefix (ids; a guide, whose features are never truncated), so each pass forms them once per tile
with the masked softmax tiles' own :func:`.softmax._tile_masks` (one guide product per tile, whatever K) and
applies them to every prefix's S^k: the forward merges each prefix's masked partials (``[6, K, n]``, the masks'
rows per prefix) with :func:`.softmax._masked_partials`, the backward forms each dS^k with
:func:`.softmax.probabilities` as the masked backward does.

GEMMs per block: forward one (over D), backward three (over D), as the plain loss (plus one guide product per
tile in each pass with a guide); the elementwise work is K times the plain loss's. Extra memory: K + 3 tile
buffers (+ 1 with several positives per row), and the masks' bool tiles.
"""

from dataclasses import replace
from typing import Optional

import torch

from ...contract import Block, Tensor
from ...lse import empty_stats, lse_merge, tile_stats
from ...masks import MASKED_ROWS, empty_masked
from ...matryoshka import Prefixes, prefix_factors
from .softmax import _col_positives, _masked_partials, _plain_masks, _row_positives, _tile_masks, probabilities
from .walk import TileSizes, Walk, positives


def _scaled(raw: Tensor, scale: Tensor, a: Optional[Tensor], b: Optional[Tensor], out: Tensor) -> Tensor:
    """u = raw * a_i * b_j (raw itself without renormalization; ``out`` a tile view otherwise)."""
    if a is None:
        return raw
    return torch.mul(raw, a[:, None], out=out).mul_(b[None, :])


def _prefix_upstream(block: Block, k: int) -> Block:
    """The backward's block with prefix k's slices of the per-prefix fields (stats, upstream gradients and the
    positives' stats or counts), which the masked tiles' helpers read as one loss's."""
    fields = {}
    for name in ("row_stats", "col_stats", "row_pos_stats", "col_pos_stats"):
        value = getattr(block, name)
        if value is not None:
            fields[name] = value[:, k]
    for name in ("g_row", "g_col", "row_pos_count", "col_pos_count"):
        value = getattr(block, name)
        if value is not None:
            fields[name] = value[k]
    return replace(block, **fields)


class MatryoshkaTiles(TileSizes):
    """The Matryoshka softmax loss's block operations on the torch tiles (:mod:`infcl.losses.matryoshka`)."""

    masked_matryoshka = True  # the mask options in the fused pass (infcl.api.fused_matryoshka)

    def matryoshka_forward_block(self, block: Block, prefixes: Prefixes, symmetric: bool):
        """Plain: (row stats [2, K, Bq], row positives [K, Bq], column stats [2, K, Bk] or None). With
        ``block.masks``: (rows [6, K, Bq], columns [6, K, Bk] or None), the masks' rows per prefix."""
        if block.masked:
            return self._masked_matryoshka_forward(block, prefixes, symmetric)
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

    def _masked_matryoshka_forward(self, block: Block, prefixes: Prefixes, symmetric: bool):
        """(rows [6, K, Bq], columns [6, K, Bk] or None): each prefix's masked partials, the tile's masks formed
        once for all K."""
        walk = Walk(block, self.tiles(block.q.device))
        bq, bk, acc, dev, n = walk.q.shape[0], walk.k.shape[0], walk.acc, walk.device, prefixes.count
        kind = block.masks.loss_kind
        rows = empty_masked(n * bq, acc, dev).view(MASKED_ROWS, n, bq)
        cols = empty_masked(n * bk, acc, dev).view(MASKED_ROWS, n, bk) if symmetric else None
        a, b = prefix_factors(walk.q, prefixes), prefix_factors(walk.k, prefixes)
        raw_buf, s_buf, kept_buf, scratch = walk.buffers(4)
        for tile in walk:
            raw = tile.view(raw_buf).zero_()
            masks = _tile_masks(block, tile, symmetric, kept_buf)
            kept, spare = tile.view(kept_buf), tile.view(scratch)
            for k in range(n):
                seg = prefixes.segment(k)
                raw.addmm_(tile.qi[:, seg], tile.kj[:, seg].T)
                renorm = prefixes.renormalize[k]
                u = _scaled(raw, block.scale, a[k, tile.rows] if renorm else None, b[k, tile.cols], tile.view(s_buf))
                s = torch.mul(u, block.scale, out=tile.view(s_buf))  # as the plain forward's S^k, bit for bit
                _masked_partials(rows[:, k, tile.rows], s, masks, masks.excluded, kept, spare, 1, kind)
                if symmetric:
                    _masked_partials(cols[:, k, tile.cols], s, masks, masks.col_excluded, kept, spare, 0, kind)
        return rows, cols

    def matryoshka_backward_block(self, block: Block, prefixes: Prefixes, dq: Tensor, dk: Tensor) -> Tensor:
        """dq, dk accumulated in place; returns dscale [2] (rows' part, columns' part). ``block.row_stats``
        [2, K, Bq] and ``block.g_row`` [K, Bq] (symmetric: ``col_stats``, ``g_col`` likewise) per prefix; with
        ``block.masks`` also the positives' count [K, n] ("mean") or stats [2, K, n] ("sum") per prefix."""
        walk = Walk(block, self.tiles(block.q.device))
        scale, symmetric, n = block.scale, block.symmetric, prefixes.count
        single = block.masks is None or block.masks.multi_positive is None
        per_prefix = [_prefix_upstream(block, k) for k in range(n)]
        dscale = walk.zeros(2)
        a, b = prefix_factors(walk.q, prefixes), prefix_factors(walk.k, prefixes)
        row_c, col_c = walk.zeros(n, walk.q.shape[0]), walk.zeros(n, walk.k.shape[0])
        raws = walk.buffers(n)
        u_buf, s_buf, ds_buf, w_buf = walk.buffers(4)
        col_buf = walk.buffers(1)[0] if symmetric else None
        # Several positives per row: probabilities holds the positives' entries in a scratch tile, and s is read
        # after it (the renormalization's sums), so the scratch is a tile of its own.
        pos_buf = None if single else walk.buffers(1)[0]
        for tile in walk:
            raw = tile.view(raws[0]).zero_()
            for k in range(n):
                seg = prefixes.segment(k)
                if k:
                    raw = tile.view(raws[k]).copy_(raw)  # R^k starts from R^(k-1), as the forward grows it
                raw.addmm_(tile.qi[:, seg], tile.kj[:, seg].T)
            # The tile's masks, once for every prefix (ds_buf holds the guide scores until dS^k's first use).
            masks = _tile_masks(block, tile, symmetric, ds_buf) if block.masked else _plain_masks(block, tile)
            w = tile.view(w_buf).zero_()
            for k in reversed(range(n)):
                raw = tile.view(raws[k])
                renorm = prefixes.renormalize[k]
                ak, bk = (a[k, tile.rows], b[k, tile.cols]) if renorm else (None, None)
                u = _scaled(raw, scale, ak, bk, tile.view(u_buf))
                s = torch.mul(u, scale, out=tile.view(s_buf))
                up = per_prefix[k]
                ds = probabilities(
                    tile.view(ds_buf),
                    s,
                    masks,
                    masks.excluded,
                    up.row_stats[:, tile.rows, None],
                    up.g_row[tile.rows, None],
                    None if single else _row_positives(up, tile),
                    s if single else tile.view(pos_buf),
                )
                dscale[0] += torch.dot(ds.view(-1), u.reshape(-1))
                if symmetric:
                    pc = probabilities(
                        tile.view(col_buf),
                        s,
                        masks,
                        masks.col_excluded,
                        up.col_stats[:, None, tile.cols],
                        up.g_col[None, tile.cols],
                        None if single else _col_positives(up, tile),
                        s if single else tile.view(pos_buf),
                    )
                    dscale[1] += torch.dot(pc.view(-1), u.reshape(-1))
                    ds.add_(pc)
                if prefixes.sign_only(k):
                    pass  # its features' gradient is exactly 0: nothing joins W or the normalization's sums
                elif renorm:  # probabilities left s as it was (its scratch is s only with one positive per row)
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
