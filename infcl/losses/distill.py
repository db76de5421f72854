"""The distillation loss's per-block steps in the ring loop (open_clip's ``DistillClipLoss`` term), on named
per-row tensors.

Per direction, row i of the student logits S = scale * q @ k.T against the teacher's T = teacher_scale *
tq @ tk.T (same rows and columns, any teacher width):

    loss_i = lse_j(S_ij) - sum_j softmax(T)_ij * S_ij = sum_j softmax(T)_ij * (m_i - S_ij) + r_i

with (m_i, r_i) the student row's stats (:mod:`infcl.lse`). The second form has no cancellation: every
term is non-negative. A row's forward partials over a set of columns, :class:`DistillPartials`, are the
student's stats, the teacher's stats (mT, rT) and ``cross`` = sum_j exp(T_ij - mT) * (m - S_ij) over
that set, relative to the set's own maxima. Two partials over disjoint sets merge with the one LSE
helper (:func:`infcl.lse.lse_merge`) for both stats, and ``cross`` rescaled to the merged maxima:
``(cross + (M - m) * exp(rT)) * exp(mT - MT)`` for each side (again sums of non-negative terms).
At the end loss = cross / exp(rT) + r.

The backward recomputes the tiles and forms dS = g * (softmax(S) - softmax(T)) inside each tile as
exp(a) - exp(b) with a = (S - m) - r and b = (T - mT) - rT, and at each line's maximum of S (the only
entry where both probabilities can exceed 1/2) as ``-sign(a - b) * exp(max(a, b)) * expm1(-|a - b|)``, so
two near-1 probabilities (a confident student and teacher on the same column) keep their difference's
digits; dq, dk and the student scale's gradient follow as for the softmax loss. The teacher gets no
gradient. The symmetric loss (both directions, open_clip's) takes the column partials from the same
tiles; the teacher's k block travels with k (``k_side``).

The backends return the forward partials packed, ``[5, n]`` (:data:`infcl.contract.DISTILL_ROWS`), and take
the backward's global stats packed, ``[4, n]`` (the student's, then the teacher's); :func:`partials` and
:class:`DistillUpstream` name them here.
"""

from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from ..contract import CROSS, STUDENT, TEACHER, Block, DistillBlockBackend, Teacher, Tensor
from ..lse import REL, cross_merge_, empty_stats
from ..ring.driver import MergedParts, ParamGrads


class DistillPartials(NamedTuple):
    """The distillation loss's forward partials of ``n`` rows (or columns) over a set of columns (rows)."""

    student: Tensor  # [2, n] (max, rel) of S
    teacher: Tensor  # [2, n] (max, rel) of T
    cross: Tensor  # [n] sum exp(T - teacher max) * (student max - S), >= 0

    @classmethod
    def empty(cls, n: int, dtype: torch.dtype, device: torch.device) -> "DistillPartials":
        """Partials over no columns: the identity of :meth:`merge_`."""
        cross = torch.zeros(n, dtype=dtype, device=device)
        return cls(empty_stats(n, dtype, device), empty_stats(n, dtype, device), cross)

    def merge_(self, part: "DistillPartials") -> None:
        """Merge partials over a disjoint set of columns in place (:func:`infcl.lse.cross_merge_`)."""
        cross_merge_(self, part)

    def losses(self) -> Tensor:
        """cross / exp(rT) + r per row; NaN wherever a log-sum-exp or the cross sum is not finite."""
        loss = self.cross / torch.exp(self.teacher[REL]) + self.student[REL]
        finite = torch.isfinite(self.student).all(dim=0) & torch.isfinite(self.teacher).all(dim=0)
        return torch.where(finite & torch.isfinite(self.cross), loss, float("nan"))


def partials(packed: Tensor) -> DistillPartials:
    """A backend's packed ``[5, n]`` (m, r, mT, rT, cross) as :class:`DistillPartials` (views)."""
    return DistillPartials(packed[STUDENT], packed[TEACHER], packed[CROSS])


class DistillUpstream(NamedTuple):
    """What the backward needs per row (or column): both global stats and the upstream gradient."""

    stats: Tensor  # [4, n] the student's (max, rel), then the teacher's
    grad: Tensor  # [n]


class DistillSteps(MergedParts):
    """:class:`infcl.ring.driver.RingLoss` for the distillation loss, one direction or symmetric, on a
    :class:`infcl.contract.DistillBlockBackend`."""

    n_params = 1  # the student's scale
    parts = DistillPartials

    def __init__(self, symmetric: bool, teacher_q: Tensor, teacher_k: Tensor, teacher_scale: Tensor):
        self.symmetric = symmetric
        self.teacher_q, self.teacher_scale = teacher_q, teacher_scale
        self.k_side = (teacher_k,)

    def _teacher(self, k_side) -> Teacher:
        (teacher_k,) = k_side
        return Teacher(self.teacher_q, teacher_k, self.teacher_scale)

    def forward_step(self, backend: DistillBlockBackend, block: Block, k_side=()):
        rows, cols = backend.distill_forward_block(block, self._teacher(k_side), self.symmetric)
        return partials(rows), (partials(cols) if self.symmetric else None)

    def backward_step(
        self,
        backend: DistillBlockBackend,
        block: Block,
        rows: DistillUpstream,
        cols: Optional[DistillUpstream],
        dq: Tensor,
        dk: Tensor,
        k_side=(),
    ) -> ParamGrads:
        block = replace(block, row_stats=rows.stats, g_row=rows.grad)
        if cols is not None:
            block = replace(block, col_stats=cols.stats, g_col=cols.grad)
        dscale = backend.distill_backward_block(block, self._teacher(k_side), dq, dk)
        return ParamGrads(own=dscale[:1], owner=dscale[1:])  # the rows' term, the columns' term
