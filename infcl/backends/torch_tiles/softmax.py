"""The softmax (InfoNCE / CLIP) loss on the torch tiles (contract: :mod:`infcl.contract`), with the mask
options (:mod:`infcl.masks`).

Walks S = scale * q @ k.T in tile_q x tile_k tiles. The forward takes each tile's stats with
:func:`infcl.lse.tile_stats` (the maximum's own exp(0) = 1 left out of ``rest`` by value, r = log1p(rest),
so a confident row's r ~ 1e-20 keeps its digits), merges them into running row (and column) stats with
:func:`infcl.lse.lse_merge`, and reads each row's positive logit off the tile that holds it; the backward
recomputes each tile with the same operations (so S is bit-identical), forms dS = g * (P - Y) in the
accumulation dtype — the positive's entry as ``g * expm1(x)`` = -g * rest / (1 + rest) for x = -r, never
a difference with 1 — and accumulates the scale gradient as a sum of per-entry terms and dq, dk
by ``addmm_`` of scale * dS (no [tile, D] temporaries). Exponentials: :func:`infcl.lse.exp_`.
Extra memory: the float32 (float64) copies of q and k plus a few tiles,
O((Bq + Bk) * D + tile_q * tile_k), never O(Bq * Bk). No host synchronization: the scale stays a
tensor and the positives are gathered with index arithmetic, never ``nonzero``.

GEMM count per block (each a 2*Bq*Bk*D-flop product): forward 1 (S), backward 3 (S again, dq, dk),
whether the loss is one-directional or symmetric.
"""

from typing import NamedTuple, Optional, Tuple

import torch

from ...contract import Block, Tensor
from ...lse import MAX, REL, empty_stats, exp_, lse_merge, tile_stats
from ...masks import KEPT_COUNT, KEPT_SUM, POS_COUNT, POS_MAX, POS_REL, POS_SUM, empty_masked
from .walk import Tile, TileSizes, Walk, positives, replace_positives, window_product


class TileMasks(NamedTuple):
    """One tile's positives and exclusions (see infcl.masks), [ni, nj] bool where a tile is needed.

    With one positive per row (``multi_positive`` None) the positives are ``inside`` / ``idx`` as for the
    plain loss (:func:`positives`) and ``positive`` is None: they are read and replaced by index, as the
    plain tiles do. ``excluded`` / ``col_excluded`` are None where nothing is excluded (or no column
    direction is wanted); the column direction differs from the rows' only by the guide thresholds.
    """

    positive: Optional[Tensor]
    inside: Optional[Tensor]
    idx: Optional[Tensor]
    excluded: Optional[Tensor]
    col_excluded: Optional[Tensor]


def _guide_tile(guide_q: Tensor, guide_k: Tensor, rows: slice, cols: slice, buf: Optional[Tensor] = None) -> Tensor:
    """One tile's guide scores G = guide_q[rows] @ guide_k[cols].T: the one product both the masks and the
    guide thresholds (:meth:`TorchTilesBackend.guide_label_scores`) read, so that a tie compares equal.

    Every tile of a block is one product of the same shape (:func:`.walk.window_product`), so a column
    duplicating a row's labelled column in a ragged tile meets its threshold's tie. ``buf``: a flat tile
    buffer to hold the window, used where its dtype is the guide's (the same ``torch.mm``, into a
    contiguous output either way)."""
    use_buf = buf is not None and buf.dtype == guide_q.dtype
    return window_product(guide_q, guide_k, rows, cols, buf if use_buf else None)


def _plain_masks(block: Block, tile: Tile) -> TileMasks:
    """What :func:`_tile_masks` gives a block without masks, without its steps: the positives by index."""
    return TileMasks(None, *positives(block.pos, tile), None, None)


def _tile_masks(block: Block, tile: Tile, symmetric: bool, scores_buf: Tensor) -> TileMasks:
    """Form one tile's masks (``block.masks``), in place where possible: at most three bool tiles are the extra
    memory (the ids' matches and the guide's two threshold tests); the guide scores go to ``scores_buf``, a
    flat tile buffer free until the caller's next use of it."""
    masks, same = block.masks, None
    if masks.q_ids is not None:
        same = masks.q_ids[tile.rows, None] == masks.k_ids[None, tile.cols]
    if masks.multi_positive is None:
        positive, (inside, idx) = None, positives(block.pos, tile)  # taken out of the exclusions by index
    else:
        positive, same, inside, idx = same, None, None, None  # every same-id column is a positive
    excluded = same  # the false negatives (None under multi_positive: ids exclude nothing then)
    col_excluded = excluded if symmetric else None
    if masks.guide_q is not None:
        scores = _guide_tile(masks.guide_q, masks.guide_k, tile.rows, tile.cols, scores_buf)
        if symmetric:
            col_above = torch.gt(scores, masks.col_threshold[None, tile.cols])
            col_excluded = col_above if excluded is None else col_above.logical_or_(excluded)
        above = torch.gt(scores, masks.row_threshold[tile.rows, None])
        excluded = above if excluded is None else above.logical_or_(excluded)
    for mask in {id(m): m for m in (excluded, col_excluded) if m is not None}.values():
        if positive is not None:  # a positive is never excluded
            mask.masked_fill_(positive, False)
        else:
            mask.scatter_(1, idx, mask.gather(1, idx).logical_and_(~inside[:, None]))
    return TileMasks(positive, inside, idx, excluded, col_excluded)


def _masked_partials(
    acc: Tensor,
    s: Tensor,
    masks: TileMasks,
    excluded: Optional[Tensor],
    kept: Tensor,
    scratch: Tensor,
    dim: int,
    kind: str,
) -> None:
    """Merge one tile's masked partials along ``dim`` (1: rows, 0: columns) into ``acc`` [6, n] in place
    ([8, n]: also the kept logits' sum and number, label smoothing's uniform part).

    ``kept``: a tile buffer for s with the excluded entries at -inf (with nothing excluded, a copy of s, so
    the stats are the plain loss's bit for bit). ``scratch``: a second tile buffer. No tile is allocated:
    :func:`infcl.lse.tile_stats` counts its ones in ``kept`` (dead by then), and the positives are selected
    by ``torch.where`` into the buffers and counted as floats (a bool tile's own sum widens it to int64).
    """
    neg_inf = float("-inf")
    if acc.shape[0] > KEPT_SUM:  # the same exclusions as the stats' below: kept is what they leave
        if excluded is None:
            acc[KEPT_SUM] += s.sum(dim=dim)
            acc[KEPT_COUNT] += s.shape[dim]
        else:
            acc[KEPT_SUM] += torch.where(excluded, s.new_zeros(()), s, out=scratch).sum(dim=dim)
            acc[KEPT_COUNT] += s.shape[dim] - excluded.sum(dim=dim)
    kept.copy_(s)
    if excluded is not None:
        kept.masked_fill_(excluded, neg_inf)
    lse_merge(acc[MAX : REL + 1], tile_stats(kept, dim, scratch, kept))
    if masks.positive is None:
        _single_positive_partials(acc, s, masks.inside, masks.idx, dim)
        return
    positive = masks.positive
    kept = torch.where(positive, s, s.new_full((), neg_inf), out=kept)  # the positives' logits
    if kind == "sum":
        lse_merge(acc[POS_MAX : POS_REL + 1], tile_stats(kept, dim, scratch, kept))
    else:
        torch.maximum(acc[POS_MAX], torch.amax(kept, dim=dim), out=acc[POS_MAX])
    acc[POS_SUM] += torch.where(positive, s, s.new_zeros(()), out=kept).sum(dim=dim)
    acc[POS_COUNT] += scratch.copy_(positive).sum(dim=dim)


def _single_positive_partials(acc: Tensor, s: Tensor, inside: Tensor, idx: Tensor, dim: int) -> None:
    """The positives' partials when each row has one (``pos``), read off the tile by index: per row, or
    per column (``dim`` 0; labels are then a permutation, so a column has at most one such row)."""
    value = s.gather(1, idx).squeeze(1)
    top = torch.where(inside, value, float("-inf"))
    value = torch.where(inside, value, 0.0)
    count = inside.to(s.dtype)
    if dim == 1:
        torch.maximum(acc[POS_MAX], top, out=acc[POS_MAX])
        acc[POS_SUM] += value
        acc[POS_COUNT] += count
        return
    cols = idx.squeeze(1)
    acc[POS_MAX].scatter_reduce_(0, cols, top, reduce="amax")
    acc[POS_SUM].scatter_add_(0, cols, value)  # one real term per column, the rest exact zeros
    acc[POS_COUNT].scatter_add_(0, cols, count)


class _Positives(NamedTuple):
    """The backward's view of each row's (or column's) positives, broadcast to the tile."""

    count: Optional[Tensor]  # |P|, "mean"
    stats: Optional[Tensor]  # [2, ...] global (max, rel) of the positives' logits, "sum"


def _row_positives(block: Block, tile: Tile) -> _Positives:
    if block.masks.multi_positive == "sum":
        return _Positives(None, block.row_pos_stats[:, tile.rows, None])
    return _Positives(block.row_pos_count[tile.rows, None], None)


def _col_positives(block: Block, tile: Tile) -> _Positives:
    if block.masks.multi_positive == "sum":
        return _Positives(None, block.col_pos_stats[:, None, tile.cols])
    return _Positives(block.col_pos_count[None, tile.cols], None)


def probabilities(
    out: Tensor,
    s: Tensor,
    masks: TileMasks,
    excluded: Optional[Tensor],
    stats: Tensor,
    g: Tensor,
    pos: Optional[_Positives],
    scratch: Tensor,
    uniform: Optional[Tensor] = None,
) -> Tensor:
    """out = g * (P - Y) - uniform for a tile, P = exp((s - m) - r) off the exclusions and 0 on them, and
    the whole entry 0 on them; ``stats``, ``g``, ``pos`` and ``uniform`` (label smoothing's weight on each kept
    entry, or None) are broadcast to the tile (rows: [n, 1]; columns: [1, n]). Y: the one-hot of the row's
    positive (``pos`` None; without exclusions these are the plain loss's operations), or on the positives
    1/c ("mean") or exp((s - pm) - pr) ("sum").

    A positive's entry is never a difference of two rounded probabilities: p - 1 = expm1(x), p - 1/c =
    expm1(x + log c) / c and p - y = y * expm1(d) with d = (pm - m) + (pr - r), the log of the positives'
    share of the softmax.

    ``scratch``: a tile view that holds the positives' entries (multiple positives only); it may be ``s``
    itself where the caller reads s no more.
    """
    x = torch.sub(s, stats[MAX], out=out).sub_(stats[REL])
    if masks.positive is None:
        x_pos = x.gather(1, masks.idx)
        exp_(x)
        if excluded is not None:
            x.masked_fill_(excluded, 0.0)
        x.mul_(g)
        g_pos = g.expand_as(x).gather(1, masks.idx)
        ds = replace_positives(x, masks.inside, masks.idx, g_pos * torch.expm1(x_pos))
        return ds if uniform is None else _subtract_uniform(ds, uniform, excluded)
    if pos.stats is None:
        at_positives = torch.add(x, pos.count.log(), out=scratch).expm1_().div_(pos.count)
    else:
        share = (pos.stats[MAX] - stats[MAX]) + (pos.stats[REL] - stats[REL])
        at_positives = exp_(torch.sub(s, pos.stats[MAX], out=scratch).sub_(pos.stats[REL])).mul_(torch.expm1(share))
    exp_(x)
    if excluded is not None:
        x.masked_fill_(excluded, 0.0)
    ds = torch.where(masks.positive, at_positives, x, out=out).mul_(g)
    return ds if uniform is None else _subtract_uniform(ds, uniform, excluded)


def _subtract_uniform(ds: Tensor, uniform: Tensor, excluded: Optional[Tensor]) -> Tensor:
    """ds - uniform on the kept entries, in place (an excluded entry stays 0: no target, no probability)."""
    ds.sub_(uniform)
    return ds if excluded is None else ds.masked_fill_(excluded, 0.0)


class SoftmaxTiles(TileSizes):
    """The softmax loss's block operations on the torch tiles (contract: :mod:`infcl.contract`)."""

    kept_sums = True  # label smoothing's uniform part over the kept entries, in the masked tiles

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        if block.masked:
            return self._masked_forward_block(block, symmetric)
        walk = Walk(block, self.tiles(block.q.device))
        bq, bk, acc, dev = walk.q.shape[0], walk.k.shape[0], walk.acc, walk.device
        rows = torch.cat((empty_stats(bq, acc, dev), walk.zeros(1, bq)))
        cols = empty_stats(bk, acc, dev) if symmetric else None
        buf, scratch, ones = walk.buffers(3)
        for tile in walk:
            s = torch.mm(tile.qi, tile.kj.T, out=tile.view(buf))
            s.mul_(block.scale)  # the backward repeats exactly these two operations
            lse_merge(rows[:2, tile.rows], tile_stats(s, 1, tile.view(scratch), tile.view(ones)))
            if symmetric:
                lse_merge(cols[:, tile.cols], tile_stats(s, 0, tile.view(scratch), tile.view(ones)))
            inside, idx = positives(block.pos, tile)
            pos_row = rows[2, tile.rows]
            torch.where(inside, s.gather(1, idx).squeeze(1), pos_row, out=pos_row)
        return rows, cols

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        """The plain and the masked loss alike: without masks a tile's positives are its one-hots (by index)
        and nothing is excluded, so :func:`probabilities` does exactly the plain loss's operations."""
        walk = Walk(block, self.tiles(block.q.device))
        scale, symmetric = block.scale, block.symmetric
        single = block.masks is None or block.masks.multi_positive is None
        dscale = walk.zeros(2)
        raw_buf, s_buf, ds_buf, col_buf = walk.buffers(4 if symmetric else 3) + ([] if symmetric else [None])
        for tile in walk:
            raw = torch.mm(tile.qi, tile.kj.T, out=tile.view(raw_buf))
            s = torch.mul(raw, scale, out=tile.view(s_buf))  # bit-identical to the forward's tile
            masks = _tile_masks(block, tile, symmetric, ds_buf) if block.masked else _plain_masks(block, tile)
            ds = probabilities(
                tile.view(ds_buf),
                s,
                masks,
                masks.excluded,
                block.row_stats[:, tile.rows, None],
                block.g_row[tile.rows, None],
                None if single else _row_positives(block, tile),
                tile.view(col_buf) if symmetric else s,  # the column pass's buffer, or s, read no more
                None if block.row_uniform is None else block.row_uniform[tile.rows, None],
            )
            dscale[0] += torch.dot(ds.view(-1), raw.view(-1))
            if symmetric:
                pc = probabilities(
                    tile.view(col_buf),
                    s,
                    masks,
                    masks.col_excluded,
                    block.col_stats[:, None, tile.cols],
                    block.g_col[None, tile.cols],
                    None if single else _col_positives(block, tile),
                    s,  # read no more
                    None if block.col_uniform is None else block.col_uniform[None, tile.cols],
                )
                dscale[1] += torch.dot(pc.view(-1), raw.view(-1))
                ds.add_(pc)
            # scale * dS @ k as (scale * dS) @ k, accumulated by the products themselves (addmm_): one pass
            # over the tile instead of two [tile, D] temporaries and a pass over each.
            ds.mul_(scale)
            dq[tile.rows].addmm_(ds, tile.kj)
            dk[tile.cols].addmm_(ds.T, tile.qi)
        return dscale

    # --- the softmax loss with masks (infcl.masks; contract: infcl.contract) ---------------------
    # GEMMs per block: as above, plus one guide GEMM (width D') per tile in each pass when a guide is given.

    def _masked_forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        walk = Walk(block, self.tiles(block.q.device))
        kind, kept_sums = block.masks.loss_kind, block.kept_sums
        rows = empty_masked(walk.q.shape[0], walk.acc, walk.device, kept_sums)
        cols = empty_masked(walk.k.shape[0], walk.acc, walk.device, kept_sums) if symmetric else None
        buf, kept_buf, scratch = walk.buffers(3)
        for tile in walk:
            s = torch.mm(tile.qi, tile.kj.T, out=tile.view(buf))
            s.mul_(block.scale)  # the same tile as the plain forward's, bit for bit
            masks = _tile_masks(block, tile, symmetric, kept_buf)
            kept, spare = tile.view(kept_buf), tile.view(scratch)
            _masked_partials(rows[:, tile.rows], s, masks, masks.excluded, kept, spare, 1, kind)
            if symmetric:
                _masked_partials(cols[:, tile.cols], s, masks, masks.col_excluded, kept, spare, 0, kind)
        return rows, cols

    def guide_label_scores(self, guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype) -> Tensor:
        """``[Bq]`` G[i, pos[i]] (0 where pos[i] < 0; contract: infcl.contract) read off the very tile
        product the masks form (:func:`_guide_tile`, the same tile grid), only for the tiles that hold a
        positive. One host check per tile (this pass runs once per block, before the loss)."""
        tq, tk = self.tiles(guide_q.device)
        score = guide_q.new_zeros(guide_q.shape[0])
        for i0 in range(0, guide_q.shape[0], tq):
            rows = slice(i0, i0 + tq)
            p, out = pos[rows], score[rows]
            for j0 in range(0, guide_k.shape[0], tk):
                inside = (p >= j0) & (p < j0 + tk)
                if not bool(inside.any()):
                    continue
                scores = _guide_tile(guide_q, guide_k, rows, slice(j0, j0 + tk))
                idx = (p - j0).clamp(0, scores.shape[1] - 1)[:, None]
                torch.where(inside, scores.gather(1, idx).squeeze(1), out, out=out)
        return score
