"""The softmax (InfoNCE / CLIP) loss's per-block steps in the ring loop.

Forward rows are ``[3, Bq]``: the row stats (max, log-sum relative to it; :mod:`infcl.lse`) and the
positive logit, which only the block holding a row's positive sets (the others add 0). For the
symmetric loss each block also yields ``[3, Bk]`` column partials — the column stats over this rank's
rows and the column's positive logit, scattered from the rows whose positive lies in the block (the
same tile value, not a second dot product) — that travel home to the block's owner.

Backward: the rows carry ``[3, Bq]`` (max, rel, upstream gradient); for the symmetric loss the same
per column travels ahead with k. The one loss parameter is the scale: each block returns its row part
(this rank's loss) and its column part (credited to the block's owner).

Losses: row_i = (m_i - pos_i) + r_i, which is never negative (pos_i is one of the tile values the
max was taken over, and r_i >= 0).
"""

from typing import Optional, Tuple

import torch

from ..backends.base import Block, BlockBackend, Tensor
from ..lse import MAX, REL, empty_stats, lse_merge
from ..stats import HAS_POS, HIT, POS_LOGIT

POS = 2  # row of the positive logit in a forward partial


def _merge(acc: Tensor, part: Tensor) -> None:
    lse_merge(acc[:2], part[:2])
    acc[POS] += part[POS]


def _scatter_to_columns(row_pos: Tensor, pos: Tensor, size: int) -> Tensor:
    """col[c] = row_pos[i] for the row i whose positive is column c of this block (0 for none).

    Rows whose positive is elsewhere go to a spare slot past the end, so the scatter needs no mask
    (labels are a permutation under the symmetric loss: each column gets at most one row).
    """
    out = row_pos.new_zeros(size + 1)
    out.scatter_(0, torch.where(pos >= 0, pos, size), row_pos)
    return out[:size]


def row_losses(stats: Tensor) -> Tensor:
    """(m - pos) + r from a ``[3, n]`` forward result, NaN wherever the log-sum-exp is not finite.

    An infinite log-sum-exp means an infinite logit in that row (or column); F.cross_entropy turns
    every such row into NaN, and so do we: never a silent inf or finite number from non-finite features.
    """
    m, rel = stats[MAX], stats[REL]
    finite = torch.isfinite(m) & torch.isfinite(rel)
    return torch.where(finite, (m - stats[POS]) + rel, float("nan"))


class SoftmaxRing:
    """:class:`infcl.ring.driver.RingLoss` for the softmax loss, one direction or symmetric."""

    n_params = 1

    def __init__(self, symmetric: bool):
        self.symmetric = symmetric
        self.col_rows = 3 if symmetric else 0

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.cat((empty_stats(n, dtype, device), torch.zeros(1, n, dtype=dtype, device=device)))

    merge_rows = staticmethod(_merge)
    merge_cols = staticmethod(_merge)

    def forward_step(self, backend: BlockBackend, q: Tensor, k: Tensor, scale: Tensor, pos: Tensor):
        rows, col_stats = backend.forward_block(Block(q=q, k=k, scale=scale, pos=pos), self.symmetric)
        if not self.symmetric:
            return rows, None
        cols = torch.cat((col_stats, _scatter_to_columns(rows[POS], pos, k.shape[0])[None]))
        return rows, cols

    def backward_step(
        self, backend: BlockBackend, q: Tensor, k: Tensor, scale: Tensor, pos: Tensor,
        rows: Tensor, ahead: Optional[Tensor], dq: Tensor, dk: Tensor,
    ) -> Tensor:
        block = Block(
            q=q, k=k, scale=scale, pos=pos, row_stats=rows[:2], g_row=rows[2],
            col_stats=None if ahead is None else ahead[:2], g_col=None if ahead is None else ahead[2],
        )
        return backend.backward_block(block, dq, dk).view(2, 1)


def backward_rows(stats: Tensor, grad: Tensor) -> Tensor:
    """``[3, n]`` (max, rel, upstream gradient) for the backward from a forward result and its gradient."""
    return torch.cat((stats[:2], grad.to(stats.dtype)[None]))


def split(rows: Tensor, cols: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """The per-row and per-column losses of a forward result."""
    return row_losses(rows), (None if cols is None else row_losses(cols))


def _info(stats: Tensor) -> Tensor:
    """``[3, n]`` per-row info (:mod:`infcl.stats`) of a plain forward result: the positive is the row's
    top-1 when it equals the max (it is one of the values the max was taken over)."""
    info = stats.new_empty(3, stats.shape[1])
    info[HIT] = (stats[POS] >= stats[MAX]).to(stats.dtype)
    info[POS_LOGIT] = stats[POS]
    info[HAS_POS] = 1
    return info


def infos(rows: Tensor, cols: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """The per-row (and per-column) infos of a forward result."""
    return _info(rows), (None if cols is None else _info(cols))
