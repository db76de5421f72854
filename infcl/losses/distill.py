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
"""

from typing import NamedTuple, Optional

import torch

from ..backends.base import Block, Tensor
from ..lse import MAX, REL, empty_stats, lse_merge
from ..ring.driver import ParamGrads


class Teacher(NamedTuple):
    """The teacher's side of one block: its row features, the held block's features and its scale."""

    q: Tensor  # [Bq, D_T] accumulation dtype
    k: Tensor  # [Bk, D_T] accumulation dtype
    scale: Tensor  # 0-d accumulation dtype


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

    def _rescaled_cross(self, student_max: Tensor, teacher_max: Tensor) -> Tensor:
        """``cross`` relative to other maxima (>= these): (cross + (M - m) * exp(rT)) * exp(mT - MT); 0 if empty."""
        m, (mt, rt) = self.student[MAX], self.teacher
        shifted = (self.cross + (student_max - m) * torch.exp(rt)) * torch.exp(mt - teacher_max)
        return torch.where(m == float("-inf"), 0.0, shifted)

    def merge_(self, part: "DistillPartials") -> None:
        """Merge partials over a disjoint set of columns in place."""
        student_max = torch.maximum(self.student[MAX], part.student[MAX])
        teacher_max = torch.maximum(self.teacher[MAX], part.teacher[MAX])
        cross = self._rescaled_cross(student_max, teacher_max) + part._rescaled_cross(student_max, teacher_max)
        self.cross.copy_(cross)
        lse_merge(self.student, part.student)
        lse_merge(self.teacher, part.teacher)

    def losses(self) -> Tensor:
        """cross / exp(rT) + r per row; NaN wherever a log-sum-exp or the cross sum is not finite."""
        loss = self.cross / torch.exp(self.teacher[REL]) + self.student[REL]
        finite = torch.isfinite(self.student).all(dim=0) & torch.isfinite(self.teacher).all(dim=0)
        return torch.where(finite & torch.isfinite(self.cross), loss, float("nan"))


class DistillUpstream(NamedTuple):
    """What the backward needs per row (or column): both global stats and the upstream gradient."""

    student: Tensor  # [2, n]
    teacher: Tensor  # [2, n]
    grad: Tensor  # [n]


class DistillRing:
    """:class:`infcl.ring.driver.RingLoss` for the distillation loss, one direction or symmetric.

    ``backend``: an object with ``distill_forward_block(block, teacher, symmetric)`` and
    ``distill_backward_block(block, teacher, rows, cols, dq, dk)`` (:mod:`infcl.backends.distill_tiles`).
    """

    n_params = 1  # the student's scale

    def __init__(self, symmetric: bool, teacher_q: Tensor, teacher_k: Tensor, teacher_scale: Tensor):
        self.symmetric = symmetric
        self.teacher_q, self.teacher_scale = teacher_q, teacher_scale
        self.k_side = (teacher_k,)

    def _teacher(self, k_side) -> Teacher:
        (teacher_k,) = k_side
        return Teacher(self.teacher_q, teacher_k, self.teacher_scale)

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> DistillPartials:
        return DistillPartials.empty(n, dtype, device)

    @staticmethod
    def merge(acc: DistillPartials, part: DistillPartials) -> None:
        acc.merge_(part)

    def forward_step(self, backend, block: Block, k_side=()):
        return backend.distill_forward_block(block, self._teacher(k_side), self.symmetric)

    def backward_step(
        self,
        backend,
        block: Block,
        rows: DistillUpstream,
        cols: Optional[DistillUpstream],
        dq: Tensor,
        dk: Tensor,
        k_side=(),
    ) -> ParamGrads:
        dscale = backend.distill_backward_block(block, self._teacher(k_side), rows, cols, dq, dk)
        return ParamGrads(own=dscale[:1], owner=dscale[1:])  # the rows' term, the columns' term
