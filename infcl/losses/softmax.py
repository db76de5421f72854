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

With mask options (:mod:`infcl.masks`), :class:`MaskedSoftmaxRing`: forward partials are ``[6, n]`` for
rows and columns alike (the tiles find each column's positives themselves, so nothing is scattered),
the ids, guide features and column thresholds travel with k (``k_side``), and the backward rows and
``ahead`` are ``[6, n]``: (max, rel, upstream gradient, positives' max, positives' rel, positive count).
The guide thresholds come first, from :class:`GuideScores` on the same ring loop (see there).
"""

from typing import Optional, Tuple

import torch

from ..backends.base import Block, BlockBackend, Tensor
from ..lse import MAX, REL, empty_stats, lse_merge
from ..masks import MASKED_ROWS, POS_COUNT, POS_MAX, POS_REL, POS_SUM, empty_masked, merge_masked
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
    k_side = ()  # nothing travels with k but k

    def __init__(self, symmetric: bool):
        self.symmetric = symmetric
        self.col_rows = 3 if symmetric else 0

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.cat((empty_stats(n, dtype, device), torch.zeros(1, n, dtype=dtype, device=device)))

    merge_rows = staticmethod(_merge)
    merge_cols = staticmethod(_merge)

    def forward_step(self, backend: BlockBackend, q: Tensor, k: Tensor, scale: Tensor, pos: Tensor, k_side=()):
        rows, col_stats = backend.forward_block(Block(q=q, k=k, scale=scale, pos=pos), self.symmetric)
        if not self.symmetric:
            return rows, None
        cols = torch.cat((col_stats, _scatter_to_columns(rows[POS], pos, k.shape[0])[None]))
        return rows, cols

    def backward_step(
        self, backend: BlockBackend, q: Tensor, k: Tensor, scale: Tensor, pos: Tensor,
        rows: Tensor, ahead: Optional[Tensor], dq: Tensor, dk: Tensor, k_side=(),
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


# --- the mask options (infcl.masks) ------------------------------------------------------------------

# Rows per step of GuideScores: bounds its gathered labelled-column features (and their products) to a few
# chunk x D' temporaries instead of two more copies of the guide.
GUIDE_CHUNK = 1024
GRAD = 2  # row of the upstream gradient in backward rows (plain [3, n] and masked [6, n] alike)
B_POS_MAX, B_POS_REL, B_POS_COUNT = 3, 4, 5  # the positives' rows in masked backward rows


class GuideScores:
    """:class:`infcl.ring.driver.RingLoss` (forward only) for the guide score of each row's labelled
    column, G[i, labels[i]] = guide_q[i] . guide_k[labels[i]], and, symmetric, of each column's labelled
    row (the same number: labels are a permutation), run on the one ring loop with the guide features as
    q and k before the loss's own pass.

    Why a pass of its own: a row's threshold decides its exclusions in every block, including those the
    ring brings before the block holding its labelled column. The pass moves only the guide features
    (O(B * D') per step, no GEMM: one dot product per row, in the block holding its labelled column).
    The dot product rounds differently from the tiles' guide GEMM, so a column whose score ties the
    threshold exactly (a duplicate of the labelled column at margin 0) may fall either way; the labelled
    column itself is a positive, never excluded.
    """

    n_params = 0
    k_side = ()

    def __init__(self, symmetric: bool):
        self.symmetric = symmetric
        self.col_rows = 1 if symmetric else 0

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.zeros(1, n, dtype=dtype, device=device)

    merge_rows = merge_cols = staticmethod(Tensor.add_)

    def forward_step(self, backend, guide_q: Tensor, guide_k: Tensor, scale, pos: Tensor, k_side=()):
        score = guide_q.new_zeros(guide_q.shape[0])
        for i0 in range(0, guide_q.shape[0], GUIDE_CHUNK):
            rows = slice(i0, i0 + GUIDE_CHUNK)
            picked = guide_k[pos[rows].clamp(min=0)]  # [chunk, D']: the labelled columns' features
            score[rows] = torch.where(pos[rows] >= 0, (guide_q[rows] * picked).sum(dim=1), 0)
        cols = _scatter_to_columns(score, pos, guide_k.shape[0])[None] if self.symmetric else None
        return score[None], cols


class MaskedSoftmaxRing:
    """:class:`infcl.ring.driver.RingLoss` for the softmax loss with mask options; the rows' ids, guide
    features and thresholds stay here, the columns' travel with k (``k_side``)."""

    n_params = 1

    def __init__(self, symmetric: bool, multi_positive, q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold):
        self.symmetric = symmetric
        self.col_rows = MASKED_ROWS if symmetric else 0
        self.multi_positive = multi_positive
        self.kind = "sum" if multi_positive == "sum" else "mean"
        self.rows_side = {"q_ids": q_ids, "guide_q": guide_q, "row_threshold": row_threshold}
        side = {"k_ids": k_ids, "guide_k": guide_k, "col_threshold": col_threshold if symmetric else None}
        self.k_side_names = tuple(name for name, t in side.items() if t is not None)
        self.k_side = tuple(side[name] for name in self.k_side_names)

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return empty_masked(n, dtype, device)

    def merge_rows(self, acc: Tensor, part: Tensor) -> None:
        merge_masked(acc, part, self.kind)

    merge_cols = merge_rows

    def _block(self, k_side, **fields) -> Block:
        columns = dict(zip(self.k_side_names, k_side))
        return Block(**fields, **self.rows_side, **columns, multi_positive=self.multi_positive)

    def forward_step(self, backend: BlockBackend, q: Tensor, k: Tensor, scale: Tensor, pos: Tensor, k_side=()):
        return backend.forward_block(self._block(k_side, q=q, k=k, scale=scale, pos=pos), self.symmetric)

    def backward_step(
        self, backend: BlockBackend, q: Tensor, k: Tensor, scale: Tensor, pos: Tensor,
        rows: Tensor, ahead: Optional[Tensor], dq: Tensor, dk: Tensor, k_side=(),
    ) -> Tensor:
        fields = dict(q=q, k=k, scale=scale, pos=pos, row_stats=rows[:2], g_row=rows[GRAD])
        fields.update(_positive_fields(rows, "row", self.kind))
        if ahead is not None:
            fields.update(col_stats=ahead[:2], g_col=ahead[GRAD], **_positive_fields(ahead, "col", self.kind))
        return backend.backward_block(self._block(k_side, **fields), dq, dk).view(2, 1)


def _positive_fields(rows: Tensor, side: str, kind: str) -> dict:
    if kind == "sum":
        return {f"{side}_pos_stats": rows[B_POS_MAX : B_POS_REL + 1]}
    return {f"{side}_pos_count": rows[B_POS_COUNT]}


def masked_losses(stats: Tensor, kind: str) -> Tensor:
    """Row losses of a ``[6, n]`` masked forward result: (m - mean of the positives) + r ("mean", and one
    positive) or (m - pm) + (r - pr) ("sum"); NaN for rows without a positive or with a non-finite lse."""
    m, rel, count = stats[MAX], stats[REL], stats[POS_COUNT]
    if kind == "sum":
        loss = (m - stats[POS_MAX]) + (rel - stats[POS_REL])
    else:
        loss = (m - stats[POS_SUM] / count) + rel
    keep = torch.isfinite(m) & torch.isfinite(rel) & (count > 0)
    return torch.where(keep, loss, float("nan"))


def masked_info(stats: Tensor) -> Tensor:
    """``[3, n]`` per-row info (:mod:`infcl.stats`) of a masked forward result; NaN for rows without a positive."""
    count = stats[POS_COUNT]
    valid = count > 0
    info = stats.new_empty(3, stats.shape[1])
    info[HIT] = torch.where(valid, (stats[POS_MAX] >= stats[MAX]).to(stats.dtype), float("nan"))
    info[POS_LOGIT] = torch.where(valid, stats[POS_SUM] / count, float("nan"))
    info[HAS_POS] = valid.to(stats.dtype)
    return info


def masked_backward_rows(stats: Tensor, grad: Tensor) -> Tensor:
    """``[6, n]`` masked backward rows from a forward result and its upstream gradient.

    A row without a positive has no loss: its gradient is 0 and its stats are made harmless (m = +inf,
    so every P = exp(S - m - r) is 0, and one phantom positive) so that no NaN reaches the tiles.
    """
    valid = stats[POS_COUNT] > 0
    out = torch.empty_like(stats)
    out[MAX] = torch.where(valid, stats[MAX], float("inf"))
    out[REL] = torch.where(valid, stats[REL], 0)
    out[GRAD] = torch.where(valid, grad.to(stats.dtype), 0)
    out[B_POS_MAX] = torch.where(valid, stats[POS_MAX], 0)
    out[B_POS_REL] = torch.where(valid & (stats[POS_REL] > float("-inf")), stats[POS_REL], 0)
    out[B_POS_COUNT] = torch.where(valid, stats[POS_COUNT], 1)
    return out
