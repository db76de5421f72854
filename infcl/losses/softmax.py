"""The softmax (InfoNCE / CLIP) loss's per-block steps in the ring loop, on named per-row tensors.

Every phase moves its own named tuple of ``[n]`` / ``[2, n]`` tensors (one field per meaning, items on
the last dim; stats are (max, log-sum relative to it), :mod:`infcl.lse`), never a packed tensor whose
rows change meaning between phases:

- forward, :class:`SoftmaxPartials` (stats, positive): a row's stats over the columns seen so far and
  its positive logit, which only the block holding the positive sets (the others add 0). The backend's
  packed ``[3, Bq]`` rows are unpacked into it where they are received (:meth:`SoftmaxPartials.unpack`).
  For the symmetric loss each block also yields column partials of the same kind — the column stats over
  this rank's rows and the column's positive logit, scattered from the rows whose positive lies in the
  block (the same tile value, not a second dot product) — that travel home to the block's owner.
- backward, :class:`SoftmaxUpstream` (stats, grad): a row's global stats and the upstream gradient of its
  loss; for the symmetric loss the same per column travels with k. The one loss parameter is the scale:
  each block returns its row part (this rank's loss) and its column part (credited to the block's owner).

Losses: row_i = (m_i - pos_i) + r_i, which is never negative (pos_i is one of the tile values the
max was taken over, and r_i >= 0).

With mask options (:mod:`infcl.masks`), :class:`MaskedSoftmaxSteps`: the forward moves
:class:`MaskedPartials` (stats, the positives' stats, their logits' sum and their count) for rows and
columns alike (the tiles find each column's positives themselves, so nothing is scattered), the ids, guide
features and column thresholds travel with k (``k_side``), and the backward moves :class:`MaskedUpstream`
(stats, grad, the positives' global stats and count). The guide thresholds come first, from
:class:`GuideScores` on the same ring loop (see there).
"""

from dataclasses import replace
from typing import NamedTuple, Optional, Tuple

import torch

from ..contract import Block, BlockBackend, Tensor
from ..lse import MAX, REL, empty_stats, lse_merge
from ..masks import MaskOptions, empty_masked, masked_fields, merge_masked_fields
from ..ring.driver import MergedParts, ParamGrads, SummedParts
from ..stats import row_info

POS = 2  # row of the positive logit in the backend's packed [3, Bq] forward rows (infcl.contract)


def _scatter_to_columns(row_values: Tensor, pos: Tensor, size: int) -> Tensor:
    """col[c] = row_values[i] for the row i whose positive is column c of this block (0 for none).

    Rows whose positive is elsewhere go to a spare slot past the end, so the scatter needs no mask
    (labels are a permutation under the symmetric loss: each column gets at most one row).
    """
    out = row_values.new_zeros(size + 1)
    out.scatter_(0, torch.where(pos >= 0, pos, size), row_values)
    return out[:size]


def _nan_unless(keep: Tensor, loss: Tensor) -> Tensor:
    return torch.where(keep, loss, float("nan"))


def _finite(stats: Tensor) -> Tensor:
    """Whether a log-sum-exp is finite: an infinite one means an infinite logit in that row (or column);
    F.cross_entropy turns every such row into NaN, and so do we: never a silent inf or finite number from
    non-finite features."""
    return torch.isfinite(stats[MAX]) & torch.isfinite(stats[REL])


class SoftmaxUpstream(NamedTuple):
    """What the backward needs per row (or column): the global stats and the upstream gradient."""

    stats: Tensor  # [2, n] global (max, rel)
    grad: Tensor  # [n] upstream gradient of each row's loss

    def block_fields(self, side: str) -> dict:
        """The :class:`Block` fields of one direction (``side``: "row" or "col")."""
        return {f"{side}_stats": self.stats, f"g_{side}": self.grad}


class SoftmaxPartials(NamedTuple):
    """The plain softmax loss's forward partials of ``n`` rows (or columns) over a set of columns (rows)."""

    stats: Tensor  # [2, n] (max, rel) of the logits
    positive: Tensor  # [n] the positive logit where the set holds it, else 0

    @classmethod
    def empty(cls, n: int, dtype: torch.dtype, device: torch.device) -> "SoftmaxPartials":
        """Partials over no columns: the identity of :meth:`merge_`."""
        return cls(empty_stats(n, dtype, device), torch.zeros(n, dtype=dtype, device=device))

    @classmethod
    def unpack(cls, rows: Tensor) -> "SoftmaxPartials":
        """Views of a backend's packed ``[3, n]`` forward rows (stats, then the positive logit)."""
        return cls(rows[MAX : REL + 1], rows[POS])

    def merge_(self, part: "SoftmaxPartials") -> None:
        """Merge partials over a disjoint set of columns in place."""
        lse_merge(self.stats, part.stats)
        self.positive.add_(part.positive)

    def losses(self) -> Tensor:
        """(m - pos) + r per row, NaN wherever the log-sum-exp is not finite."""
        return _nan_unless(_finite(self.stats), (self.stats[MAX] - self.positive) + self.stats[REL])

    def info(self) -> Tensor:
        """``[3, n]`` per-row info (:mod:`infcl.stats`): the positive is the row's top-1 when it equals the
        max (it is one of the values the max was taken over)."""
        return row_info(self.positive >= self.stats[MAX], self.positive, torch.ones_like(self.positive))


class SoftmaxSteps(MergedParts):
    """:class:`infcl.ring.driver.RingLoss` for the softmax loss, one direction or symmetric."""

    n_params = 1
    k_side = ()  # nothing travels with k but k
    parts = SoftmaxPartials

    def __init__(self, symmetric: bool):
        self.symmetric = symmetric

    def _block(self, block: Block, k_side, **fields) -> Block:
        """The held block with this loss's fields (and, masked, its k-side tensors) added."""
        return replace(block, **fields)

    def forward_step(self, backend: BlockBackend, block: Block, k_side=()):
        rows, col_stats = backend.forward_block(block, self.symmetric)
        rows = SoftmaxPartials.unpack(rows)
        if not self.symmetric:
            return rows, None
        return rows, SoftmaxPartials(col_stats, _scatter_to_columns(rows.positive, block.pos, block.k.shape[0]))

    def _fields(self, upstream: SoftmaxUpstream, side: str) -> dict:
        return upstream.block_fields(side)

    def backward_step(
        self,
        backend: BlockBackend,
        block: Block,
        rows: SoftmaxUpstream,
        cols: Optional[SoftmaxUpstream],
        dq: Tensor,
        dk: Tensor,
        k_side=(),
    ) -> ParamGrads:
        fields = self._fields(rows, "row")
        if cols is not None:
            fields.update(self._fields(cols, "col"))
        dscale = self._backward_block(backend, self._block(block, k_side, **fields), dq, dk)
        return ParamGrads(own=dscale[:1], owner=dscale[1:])  # the rows' term, the columns' term

    @staticmethod
    def _backward_block(backend: BlockBackend, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        """The backend's backward block operation for this loss's blocks (MaxSim: its own)."""
        return backend.backward_block(block, dq, dk)

    # What the autograd Function calls with a forward result (infcl.function).

    def losses(self, part: SoftmaxPartials) -> Tensor:
        return part.losses()

    def saved(self, part: SoftmaxPartials) -> Tuple[Tensor, ...]:
        """What the backward keeps of a forward result: the stats."""
        return (part.stats,)

    def upstream(self, saved: Tuple[Tensor, ...], grad: Tensor) -> SoftmaxUpstream:
        """The backward's inputs from :meth:`saved` and the upstream gradient (an O(n) copy makes a mean's
        expanded, stride-0 gradient plain)."""
        (stats,) = saved
        return SoftmaxUpstream(stats.contiguous(), grad.to(stats.dtype).contiguous())


# --- the mask options (infcl.masks) ------------------------------------------------------------------


class GuideScore(NamedTuple):
    """GuideScores' forward partial: ``[n]`` the guide score of each row's labelled column (0 where the
    block does not hold it)."""

    score: Tensor


def _not_finite(features: Tensor) -> Tensor:
    """[n] bool: the rows with a NaN or an infinite entry."""
    return ~torch.isfinite(features).all(dim=1)


def _nan_where(bad: Tensor) -> Tensor:
    return torch.where(bad, float("nan"), 0.0)


class GuideScores(SummedParts):
    """:class:`infcl.ring.driver.RingLoss` (forward only) for the guide score of each row's labelled
    column, G[i, labels[i]] = guide_q[i] . guide_k[labels[i]], and, symmetric, of each column's labelled
    row (the same number: labels are a permutation), run on the one ring loop with the guide features as
    q and k before the loss's own pass.

    Why a pass of its own: a row's threshold decides its exclusions in every block, including those the
    ring brings before the block holding its labelled column. The pass moves only the guide features
    (O(B * D') per step). Each score is the backend's own guide-tile arithmetic
    (``backend.guide_label_scores``, contract: :mod:`infcl.contract`), never a separate dot
    product: a column whose guide features duplicate the labelled column's gets bit for bit the same
    score in the tiles, so at margin 0 the tie compares equal and the duplicate stays in the softmax
    (GISTEmbedLoss's rule, computed there from one matrix).
    """

    parts = GuideScore
    n_params = 0
    k_side = ()

    def __init__(self, symmetric: bool, feature_dtype: torch.dtype):
        self.symmetric = symmetric
        self.feature_dtype = feature_dtype  # the loss's features': the Triton guide product's precision follows it

    def forward_step(self, backend, block: Block, k_side=()):
        """``block``: the guide features as q and k (no scale)."""
        guide_q, guide_k, pos = block.q, block.k, block.pos
        score = backend.guide_label_scores(guide_q, guide_k, pos, self.feature_dtype)
        # NaN or inf in a guide row leaves that row's exclusions undefined: a NaN score (so a NaN threshold,
        # which MaskedSoftmaxSteps turns into a NaN loss) for each row and column whose exclusions it decides.
        bad_q, bad_k = _not_finite(guide_q), _not_finite(guide_k)
        rows = GuideScore(score + _nan_where(bad_q | bad_k.any()))
        if not self.symmetric:
            return rows, None
        cols = _scatter_to_columns(score, pos, guide_k.shape[0]) + _nan_where(bad_k | bad_q.any())
        return rows, GuideScore(cols)


class MaskedUpstream(NamedTuple):
    """What the masked backward needs per row (or column); a row without a positive carries harmless
    values (:meth:`MaskedPartials.upstream`)."""

    stats: Tensor  # [2, n] global (max, rel) over the columns not excluded
    grad: Tensor  # [n] upstream gradient of each row's loss
    pos_stats: Tensor  # [2, n] global (max, rel) of the positives' logits (read for "sum")
    pos_count: Tensor  # [n] the number of positives (read for "mean")

    def block_fields(self, side: str, kind: str) -> dict:
        """The :class:`Block` fields of one direction (``side``: "row" or "col") for the loss ``kind``."""
        positives = {f"{side}_pos_stats": self.pos_stats} if kind == "sum" else {f"{side}_pos_count": self.pos_count}
        return {f"{side}_stats": self.stats, f"g_{side}": self.grad, **positives}


class MaskedPartials(NamedTuple):
    """The masked softmax loss's forward partials of ``n`` rows (or columns), over a set of columns (rows)."""

    stats: Tensor  # [2, n] (max, rel) over the columns not excluded
    pos_stats: Tensor  # [2, n] the positives' max and ("sum" only) their log-sum relative to it
    pos_sum: Tensor  # [n] the sum of the positives' logits
    pos_count: Tensor  # [n] their number

    @classmethod
    def unpack(cls, rows: Tensor) -> "MaskedPartials":
        """Views of a backend's packed ``[6, n]`` masked forward rows (layout: :mod:`infcl.masks`)."""
        return cls(*masked_fields(rows))

    @classmethod
    def empty(cls, n: int, dtype: torch.dtype, device: torch.device) -> "MaskedPartials":
        """Partials over no columns: the identity of :meth:`merge_`."""
        return cls.unpack(empty_masked(n, dtype, device))

    def merge_(self, part: "MaskedPartials", kind: str) -> None:
        """Merge partials over a disjoint set of columns in place (:func:`infcl.masks.merge_masked_fields`)."""
        merge_masked_fields(self, part, kind)

    def losses(self, kind: str) -> Tensor:
        """Row losses: (m - mean of the positives) + r ("mean", and one positive) or (m - pm) + (r - pr)
        ("sum"); NaN for rows without a positive or with a non-finite lse."""
        (m, rel), (pos_max, pos_rel), count = self.stats, self.pos_stats, self.pos_count
        if kind == "sum":
            loss = (m - pos_max) + (rel - pos_rel)
        else:
            loss = (m - self.pos_sum / count) + rel
        return _nan_unless(_finite(self.stats) & (count > 0), loss)

    def info(self) -> Tensor:
        """``[3, n]`` per-row info (:mod:`infcl.stats`); NaN for rows without a positive."""
        valid = self.pos_count > 0
        hit = _nan_unless(valid, (self.pos_stats[MAX] >= self.stats[MAX]).to(self.pos_sum.dtype))
        return row_info(hit, _nan_unless(valid, self.pos_sum / self.pos_count), valid)

    def upstream(self, grad: Tensor) -> MaskedUpstream:
        """The backward's inputs from a global forward result and its upstream gradient.

        A row without a positive has no loss: its gradient is 0 and its stats are made harmless (m = +inf,
        so every P = exp(S - m - r) is 0, and one phantom positive) so that no NaN reaches the tiles.
        """
        valid = self.pos_count > 0
        (m, rel), (pos_max, pos_rel) = self.stats, self.pos_stats
        stats = torch.stack((torch.where(valid, m, float("inf")), torch.where(valid, rel, 0)))
        pos_rel = torch.where(valid & (pos_rel > float("-inf")), pos_rel, 0)
        pos_stats = torch.stack((torch.where(valid, pos_max, 0), pos_rel))
        grad = torch.where(valid, grad.to(m.dtype), 0)
        return MaskedUpstream(stats, grad, pos_stats, torch.where(valid, self.pos_count, 1))


def _poison(part: "MaskedPartials", threshold: Optional[Tensor]) -> None:
    """NaN into the max of the rows (columns) whose guide threshold is NaN, in place."""
    if threshold is not None:
        part.stats[MAX].add_(torch.where(torch.isnan(threshold), float("nan"), 0.0))


class MaskedSoftmaxSteps(SoftmaxSteps):
    """:class:`infcl.ring.driver.RingLoss` for the softmax loss with mask options (``masks``, thresholds set);
    the rows' side of the options stays here, the columns' side travels with k (``k_side``:
    :meth:`infcl.masks.MaskOptions.k_side`), and each step's block holds the options of the block held."""

    def __init__(self, symmetric: bool, masks: MaskOptions):
        super().__init__(symmetric)
        self.masks, self.kind = masks, masks.loss_kind
        self.k_side = masks.k_side()

    def _block(self, block: Block, k_side, **fields) -> Block:
        return replace(block, **fields, masks=self.masks.holding(k_side))

    parts = MaskedPartials  # also what the backend's packed rows unpack into

    def merge(self, acc: MaskedPartials, part: MaskedPartials) -> None:
        acc.merge_(part, self.kind)

    def forward_step(self, backend: BlockBackend, block: Block, k_side=()):
        """A NaN threshold (a guide with NaN or inf: :class:`GuideScores`) makes its row's (column's) max
        NaN in every block's partials: a NaN loss and NaN gradients, as NaN features give."""
        block = self._block(block, k_side)
        rows, cols = self._forward_block(backend, block)
        rows = self.parts.unpack(rows)
        _poison(rows, block.masks.row_threshold)
        if cols is None:
            return rows, None
        cols = self.parts.unpack(cols)
        _poison(cols, block.masks.col_threshold)
        return rows, cols

    def _forward_block(self, backend: BlockBackend, block: Block) -> Tuple[Tensor, Optional[Tensor]]:
        """The backend's forward block operation for this loss's blocks (Matryoshka prefixes: their own)."""
        return backend.forward_block(block, self.symmetric)

    def _fields(self, upstream: MaskedUpstream, side: str) -> dict:
        return upstream.block_fields(side, self.kind)

    def losses(self, part: MaskedPartials) -> Tensor:
        return part.losses(self.kind)

    def saved(self, part: MaskedPartials) -> Tuple[Tensor, ...]:
        return tuple(part)

    def upstream(self, saved: Tuple[Tensor, ...], grad: Tensor) -> MaskedUpstream:
        return MaskedPartials(*saved).upstream(grad)
