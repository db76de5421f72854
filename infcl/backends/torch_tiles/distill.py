"""The distillation loss on the torch tiles (the math: :mod:`infcl.losses.distill`; contract: :mod:`infcl.contract`;
any device).

Each tile of the student's S = scale * q @ k.T is walked beside the same tile of the teacher's
T = teacher_scale * tq @ tk.T (the teacher's rows and columns are the student's; its width may differ).
Forward: per row (and, symmetric, per column) the tile's partials (student stats, teacher stats, cross),
merged into the block's packed ``[5, n]`` by :func:`infcl.lse.cross_merge_`. Backward: S and T recomputed
bit-identically, dS = g * (softmax(S) - softmax(T)) formed in the tile from the global stats, dq += scale *
dS @ k, dk += scale * dS.T @ q, and the student scale's gradient as the sum of dS * (q @ k.T), split into
the rows' and the columns' terms.

GEMMs per block: forward 2 (S and T), backward 4 (S and T again, dq, dk). Memory: the block's features
in the accumulation dtype, a handful of tiles, O(B) partials.
"""

from typing import Optional, Tuple

import torch

from ...contract import CROSS, DISTILL_ROWS, STUDENT, TEACHER, Block, Teacher, Tensor
from ...lse import MAX, REL, cross_merge_, empty_stats, exp_, tile_stats
from .walk import TileSizes, Walk


def _tile_partials(s: Tensor, t: Tensor, dim: int, scratch: Tensor, spare: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """One tile's (student stats, teacher stats, cross) along ``dim`` (1: per row, 0: per column); ``scratch``,
    ``spare``: tile buffers."""
    student, teacher = tile_stats(s, dim, scratch, spare), tile_stats(t, dim, scratch, spare)
    weights = exp_(torch.sub(t, teacher[MAX].unsqueeze(dim), out=scratch))
    gaps = torch.sub(student[MAX].unsqueeze(dim), s, out=spare)  # >= 0: no cancellation below
    return student, teacher, weights.mul_(gaps).sum(dim=dim)


def _gap_from_logs(a: Tensor, b: Tensor) -> Tensor:
    """exp(a) - exp(b) as -sign(a - b) * exp(max(a, b)) * expm1(-|a - b|): two probabilities near 1 keep the
    digits of their difference."""
    d = a - b
    return torch.expm1(-d.abs()).mul_(torch.maximum(a, b).exp_()).mul_(torch.sign(d)).neg_()


def _probability_gap(
    out: Tensor, s: Tensor, t: Tensor, student: Tensor, teacher: Tensor, dim: int, scratch: Tensor
) -> Tensor:
    """out = softmax(S) - softmax(T) over the tile along ``dim`` (1: rows, 0: columns), from the global stats
    broadcast to it ([2, n, 1] rows or [2, 1, n] columns); ``scratch``: a tile buffer.

    With a = (s - m) - r and b = (t - mT) - rT, out = exp(a) - exp(b). A plain difference loses digits only
    where both probabilities exceed 1/2, which makes the entry its line's maximum in S: each line's tile
    maximum is recomputed by :func:`_gap_from_logs` (there a = -r exactly when it is the global maximum).
    """
    a = torch.sub(s, student[MAX], out=out).sub_(student[REL])
    b = torch.sub(t, teacher[MAX], out=scratch).sub_(teacher[REL])
    top = torch.argmax(s, dim=dim, keepdim=True)
    exact = _gap_from_logs(a.gather(dim, top), b.gather(dim, top))
    return exp_(a).sub_(exp_(b)).scatter_(dim, top, exact)


class DistillTiles(TileSizes):
    """The distillation loss's block operations on the torch tiles."""

    def distill_forward_block(self, block: Block, teacher: Teacher, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        walk = Walk(block, self.tiles(block.q.device))
        rows = _empty_packed(walk.q.shape[0], walk.acc, walk.device)
        cols = _empty_packed(walk.k.shape[0], walk.acc, walk.device) if symmetric else None
        tq, tk = teacher.q.to(walk.acc), teacher.k.to(walk.acc)
        s_buf, t_buf, scratch, spare = walk.buffers(4)
        for tile in walk:
            s = torch.mm(tile.qi, tile.kj.T, out=tile.view(s_buf)).mul_(block.scale)  # the backward repeats these
            t = torch.mm(tq[tile.rows], tk[tile.cols].T, out=tile.view(t_buf)).mul_(teacher.scale)
            _merge_at(rows, tile.rows, _tile_partials(s, t, 1, tile.view(scratch), tile.view(spare)))
            if symmetric:
                _merge_at(cols, tile.cols, _tile_partials(s, t, 0, tile.view(scratch), tile.view(spare)))
        return rows, cols

    def distill_backward_block(self, block: Block, teacher: Teacher, dq: Tensor, dk: Tensor) -> Tensor:
        walk = Walk(block, self.tiles(block.q.device))
        symmetric = block.symmetric
        tq, tk = teacher.q.to(walk.acc), teacher.k.to(walk.acc)
        dscale = walk.zeros(2)
        raw_buf, s_buf, t_buf, ds_buf, col_buf, scratch = walk.buffers(6)
        for tile in walk:
            raw = torch.mm(tile.qi, tile.kj.T, out=tile.view(raw_buf))
            s = tile.view(s_buf).copy_(raw).mul_(block.scale)  # bit-identical to the forward's tile
            t = torch.mm(tq[tile.rows], tk[tile.cols].T, out=tile.view(t_buf)).mul_(teacher.scale)
            r = tile.rows
            scratch_tile = tile.view(scratch)
            row_stats = block.row_stats[:, r, None]
            ds = _probability_gap(tile.view(ds_buf), s, t, row_stats[STUDENT], row_stats[TEACHER], 1, scratch_tile)
            ds.mul_(block.g_row[r, None])
            dscale[0] += torch.mul(ds, raw, out=scratch_tile).sum()
            if symmetric:
                c = tile.cols
                col_stats = block.col_stats[:, None, c]
                pc = _probability_gap(tile.view(col_buf), s, t, col_stats[STUDENT], col_stats[TEACHER], 0, scratch_tile)
                pc.mul_(block.g_col[None, c])
                dscale[1] += torch.mul(pc, raw, out=scratch_tile).sum()
                ds.add_(pc)
            dq[tile.rows].addcmul_(ds @ tile.kj, block.scale)
            dk[tile.cols].addcmul_(ds.T @ tile.qi, block.scale)
        return dscale


def _empty_packed(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Packed ``[5, n]`` partials over no columns (the identity of :func:`infcl.lse.cross_merge_`)."""
    packed = torch.empty(DISTILL_ROWS, n, dtype=dtype, device=device)
    packed[STUDENT] = packed[TEACHER] = empty_stats(n, dtype, device)
    packed[CROSS] = 0
    return packed


def _merge_at(acc: Tensor, where: slice, part: Tuple[Tensor, Tensor, Tensor]) -> None:
    """Merge a tile's partials into the packed ``acc`` at ``where`` (a slice of its rows or columns)."""
    cross_merge_((acc[STUDENT, where], acc[TEACHER, where], acc[CROSS, where]), part)
