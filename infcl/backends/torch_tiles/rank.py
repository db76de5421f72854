"""The retrieval ranks' two passes on the torch tiles (contract: :mod:`infcl.contract`; any device).

A row's rank is the number of columns ahead of its best positive: scoring strictly higher, or equal
and with a lower global column index (the order of a *stable* descending sort). The threshold (the
best positive's score) and every score compared with it come from the same tile product: pass 1 reads
the positives' scores off the tiles, pass 2 recomputes the same tiles (same walk, same shapes, same
operations: bit-identical) and counts. Nothing here computes a dot product outside a tile.

Per block (``Block.q`` the local rows, ``Block.k`` the held k block; no scale: ranks of q @ k.T),
with ``row_index`` / ``col_index`` the global indices of the block's rows and columns:

``best_positives(block, row_index, col_index, symmetric) -> (rows, cols or None)``, each a :class:`Best`:
    the best positive's score and global index (the lowest index among equal scores) and the number of
    positives, over this block, per row (and, ``symmetric``, per column). The positives: the one-hot of
    ``block.pos`` (and, for the columns, the rows whose positive is that column), or, with
    ``block.masks.multi_positive`` ("any"), every entry with ``q_ids[i] == k_ids[j]``. Only tiles that hold a positive
    are multiplied (a diagonal's pass 1 costs a sliver of one GEMM); deciding which is one host read per
    tile.

``ahead_counts(block, rows, cols, row_index, col_index) -> (rows, cols or None)``, each an :class:`Ahead`:
    per row (column), the columns (rows) of the block ahead of its best positive (``rows`` / ``cols``:
    the global :class:`Best` thresholds), leaving out the entries with the row's id when ids are given
    without ``multi_positive`` (duplicates of the positive are not counted against it), and in how many
    of its scores are not finite (NaN or infinite; only whether it is 0 matters). One GEMM
    per tile; the count is one comparison into a float tile and a float sum per direction (ties below
    the best's index by the threshold's next float down; lines whose best lies in the tile get their
    ties counted on their own line of the tile).

Memory: the block's q and k in the accumulation dtype (copies only for low-precision inputs), a few
tiles, O(B) outputs.
"""

from typing import Optional, Tuple

import torch

from ...contract import NO_INDEX, Ahead, Best, Block, Tensor, any_positive
from .walk import Tile, TileSizes, Walk, positives


def _tile_best(values: Tensor, index: Tensor, dim: int) -> Tuple[Tensor, Tensor]:
    """(max along ``dim``, the lowest ``index`` where it is reached) of a tile whose non-positives are -inf;
    ``index`` broadcasts to the tile."""
    top = torch.amax(values, dim=dim)
    at_top = values == top.unsqueeze(dim)
    first = torch.where(at_top, index, NO_INDEX).amin(dim=dim)
    return top, first


def _merge_tile(acc: Best, part: Best, where) -> None:
    """Merge a tile's bests into the block's accumulator at ``where`` (a slice of rows or columns)."""
    view = Best(acc.score[where], acc.index[where], acc.count[where])
    view.merge_(part)


class RankTiles(TileSizes):
    """The two passes on the torch tiles."""

    def _walk(self, block: Block) -> Walk:
        return Walk(block, self.tiles(block.q.device))

    def best_positives(self, block: Block, row_index: Tensor, col_index: Tensor, symmetric: bool):
        walk = self._walk(block)
        rows = Best.empty(walk.q.shape[0], walk.acc, walk.device)
        cols = Best.empty(walk.k.shape[0], walk.acc, walk.device) if symmetric else None
        if not any_positive(block):
            holding = _by_tile(torch.arange(walk.q.shape[0], device=walk.device), block.pos, walk)
        (buf,) = walk.buffers(1)
        for tile in walk:
            if any_positive(block):
                positive = block.masks.q_ids[tile.rows, None] == block.masks.k_ids[None, tile.cols]
                if not bool(positive.any()):
                    continue
                s = walk.scores(tile, buf)  # pass 2 repeats exactly this product
                _id_bests(rows, cols, s, positive, tile, row_index, col_index)
                continue
            if (tile.rows.start, tile.cols.start) not in holding:
                continue
            s = walk.scores(tile, buf)
            inside, idx = positives(block.pos, tile)
            _label_bests(rows, cols, s, inside, idx, tile, row_index, col_index)
        return rows, cols

    def ahead_counts(self, block: Block, rows: Best, cols: Optional[Best], row_index: Tensor, col_index: Tensor):
        walk = self._walk(block)
        out_rows = _zero_counts(walk.q.shape[0], walk.device)
        out_cols = None if cols is None else _zero_counts(walk.k.shape[0], walk.device)
        if block.masks is not None and not any_positive(block):
            return self._ahead_counts_excluding(walk, block, rows, cols, row_index, col_index, out_rows, out_cols)
        # Ties count as ahead below the best's index: there the test is s >= score, i.e. s > lower, the next
        # float below it in the same dtype (exact). A line whose best lies inside the tile's span ("straddling")
        # takes the strict test and a count of its tied entries below the best's index.
        r_lower = torch.nextafter(rows.score, rows.score.new_tensor(float("-inf")))
        r_straddling = _by_tile(torch.arange(walk.q.shape[0], device=walk.device), rows.index - col_index[0], walk)
        if cols is not None:
            c_lower = torch.nextafter(cols.score, cols.score.new_tensor(float("-inf")))
            c_straddling = _by_tile(cols.index - row_index[0], torch.arange(walk.k.shape[0], device=walk.device), walk)
        buf, counted = walk.buffers(2)
        for tile in walk:
            s = walk.scores(tile, buf)  # bit-identical to pass 1's tile
            r, c = tile.rows, tile.cols
            key = (r.start, c.start)
            last_col = col_index[c][-1]
            threshold = torch.where(rows.index[r] > last_col, r_lower[r], rows.score[r])
            out_rows.ahead[r] += torch.gt(s, threshold[:, None], out=tile.view(counted)).sum(dim=1).to(torch.int64)
            bad = torch.isfinite(s).logical_not_()
            out_rows.nonfinite[r] += bad.sum(dim=1)
            if key in r_straddling:
                lines = r_straddling[key]
                _count_ties(out_rows.ahead, lines, s[lines - r.start], rows, col_index[None, c])
            if cols is None:
                continue
            last_row = row_index[r][-1]
            threshold = torch.where(cols.index[c] > last_row, c_lower[c], cols.score[c])
            out_cols.ahead[c] += torch.gt(s, threshold[None, :], out=tile.view(counted)).sum(dim=0).to(torch.int64)
            out_cols.nonfinite[c] += bad.sum(dim=0)
            if key in c_straddling:
                lines = c_straddling[key]
                _count_ties(out_cols.ahead, lines, s[:, lines - c.start].T, cols, row_index[None, r])
        return out_rows, out_cols

    def _ahead_counts_excluding(self, walk, block, rows, cols, row_index, col_index, out_rows, out_cols):
        """With ids (one positive per row): the same counts, entries with the row's id left out, on full
        bool tiles (the fast path's float count cannot leave entries out)."""
        buf, ahead_buf = walk.buffers(2)
        ahead_buf = ahead_buf.view(torch.uint8)[: ahead_buf.numel()].view(torch.bool)
        for tile in walk:
            s = walk.scores(tile, buf)  # bit-identical to pass 1's tile
            same = block.masks.q_ids[tile.rows, None] == block.masks.k_ids[None, tile.cols]
            ahead = tile.view(ahead_buf)
            _ahead(ahead, s, rows.score[tile.rows, None], rows.index[tile.rows, None], col_index[None, tile.cols], same)
            out_rows.ahead[tile.rows] += ahead.sum(dim=1)
            bad = torch.isfinite(s).logical_not_()
            out_rows.nonfinite[tile.rows] += bad.sum(dim=1)
            if cols is not None:
                _ahead(
                    ahead, s, cols.score[None, tile.cols], cols.index[None, tile.cols], row_index[tile.rows, None], same
                )
                out_cols.ahead[tile.cols] += ahead.sum(dim=0)
                out_cols.nonfinite[tile.cols] += bad.sum(dim=0)
        return out_rows, out_cols


def _zero_counts(n: int, device: torch.device) -> "Ahead":
    return Ahead(*(torch.zeros(n, dtype=torch.int64, device=device) for _ in Ahead._fields))


def _by_tile(local_row: Tensor, local_col: Tensor, walk: Walk) -> dict:
    """{(tile's first row, tile's first column): the lines in it}: group lines by the tile holding the entry
    (local_row[l], local_col[l]) of each line l (entries outside the block are dropped). ``local_row`` or
    ``local_col`` is the lines' own arange (rows or columns), the other their partner. One host read."""
    nq, nk = walk.q.shape[0], walk.k.shape[0]
    inside = (local_col >= 0) & (local_col < nk) & (local_row >= 0) & (local_row < nq)
    lines = torch.arange(local_row.shape[0], device=local_row.device)[inside]
    if lines.numel() == 0:
        return {}
    starts_r = torch.div(local_row[inside], walk.tq, rounding_mode="floor") * walk.tq
    starts_c = torch.div(local_col[inside], walk.tk, rounding_mode="floor") * walk.tk
    keys = (starts_r * nk + starts_c).cpu()
    order = torch.argsort(keys, stable=True)
    keys, lines = keys[order], lines[order.to(lines.device)]
    unique, counts = torch.unique_consecutive(keys, return_counts=True)
    groups = torch.split(lines, counts.tolist())
    return {(int(key) // nk, int(key) % nk): group for key, group in zip(unique.tolist(), groups)}


def _count_ties(ahead: Tensor, lines: Tensor, entries: Tensor, best: "Best", other_index: Tensor) -> None:
    """Add, for each line (row or column) whose best lies inside the tile, its ``entries`` (that line's scores
    over the tile, one line per row) equal to its best's score and with a lower ``other_index``."""
    tied = (entries == best.score[lines, None]) & (other_index < best.index[lines, None])
    ahead.index_add_(0, lines, tied.sum(dim=1))


def _ahead(out: Tensor, s: Tensor, score: Tensor, index: Tensor, other_index: Tensor, same: Optional[Tensor]) -> Tensor:
    """out = the entries of ``s`` ahead of ``score`` (broadcast): greater, or equal with a lower ``other_index``
    than ``index``; entries marked ``same`` are never ahead. In place in the bool tile ``out``."""
    torch.eq(s, score, out=out).logical_and_(other_index < index).logical_or_(s > score)
    if same is not None:
        out.logical_and_(~same)
    return out


def _label_bests(
    rows: Best,
    cols: Optional[Best],
    s: Tensor,
    inside: Tensor,
    idx: Tensor,
    tile: Tile,
    row_index: Tensor,
    col_index: Tensor,
) -> None:
    """One positive per row (``block.pos``): its score off the tile, and for the columns the same entry
    (labels are a permutation, so a column has at most one such row)."""
    score = s.gather(1, idx).squeeze(1)
    column = idx.squeeze(1) + tile.cols.start
    found = Best(
        torch.where(inside, score, float("-inf")),
        torch.where(inside, col_index[column], NO_INDEX),
        inside.to(torch.int64),
    )
    _merge_tile(rows, found, tile.rows)
    if cols is None:
        return
    n = tile.kj.shape[0]
    spare = torch.where(inside, idx.squeeze(1), n)  # rows whose positive is elsewhere go to a spare slot
    col_found = Best.empty(n + 1, s.dtype, s.device)
    col_found.score.scatter_(0, spare, found.score)
    col_found.index.scatter_(0, spare, torch.where(inside, row_index[tile.rows], NO_INDEX))
    col_found.count.scatter_add_(0, spare, found.count)
    _merge_tile(cols, Best(*(t[:n] for t in col_found)), tile.cols)


def _id_bests(
    rows: Best, cols: Optional[Best], s: Tensor, positive: Tensor, tile: Tile, row_index: Tensor, col_index: Tensor
) -> None:
    """Every same-id entry is a positive: the best of them per row (and column)."""
    values = s.masked_fill(~positive, float("-inf"))
    for dim, index, where in ((1, col_index[None, tile.cols], tile.rows), (0, row_index[tile.rows, None], tile.cols)):
        if dim == 0 and cols is None:
            break
        top, first = _tile_best(values, index, dim)
        count = positive.sum(dim=dim)
        _merge_tile(rows if dim == 1 else cols, Best(top, torch.where(count > 0, first, NO_INDEX), count), where)
