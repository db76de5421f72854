"""The one stable log-sum-exp merge used by every tile loop, ring step and backend.

A log-sum-exp over a set of logits is kept as *stats*: a ``[2, n]`` tensor whose row 0 is the running
maximum ``m`` and row 1 the log-sum relative to it, ``r = log sum exp(S - m) = log1p(rest)``, where
``rest`` sums exp(S - m) over every entry but one maximal one (whose term is exactly exp(0) = 1; other
entries equal to the maximum add their exact 1s). ``r`` is formed from ``rest`` by log1p, never as
log(1 + rest): a confident row, whose positive beats every negative by 25-55 logits, has rest ~ 1e-11
.. 1e-24, which 1 + rest would round away in float32 and float64 alike. ``r >= 0`` for a non-empty set.

The full value is ``m + r``, but nothing needs it rounded: the backward forms ``p = exp((S - m) - r)``,
where ``S - m`` is exact for the entries that matter (Sterbenz: S and m are the same rounded tile value,
bit-identically recomputed), and the positive's ``p - 1 = expm1(-r) = -rest / (1 + rest)`` to full
relative precision; the loss is ``(m - positive) + r``, which is never negative.

Every place that combines two partial stats (over disjoint column sets) calls :func:`lse_merge`;
nothing in infcl writes ``log(exp(a) + exp(b))`` by hand.
"""

from typing import Optional, Sequence

import torch

# Row indices of a stats tensor.
MAX, REL = 0, 1


def lse_merge(acc: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Merge the stats ``part`` into ``acc`` in place (both ``[2, ...]``) and return ``acc``.

    With M = max(m_a, m_b): r = logaddexp(r_a + (m_a - M), r_b + (m_b - M)). One of the shifts is
    exactly 0 and ``torch.logaddexp`` works as max + log1p(exp(-|a - b|)), so a tiny second partial is
    kept to full relative precision in ``r``. An empty partial (m = -inf) is the identity; NaN in either
    side stays NaN, and +inf becomes NaN (inf - inf), as ``F.cross_entropy`` gives for an infinite logit.
    """
    m_a, r_a = acc[MAX], acc[REL]
    m_b, r_b = part[MAX], part[REL]
    new_max = torch.maximum(m_a, m_b)
    # A set with no terms contributes -inf whatever the other's max (never -inf - -inf = NaN).
    shift_a = torch.where(m_a == float("-inf"), m_a, r_a + (m_a - new_max))
    shift_b = torch.where(m_b == float("-inf"), m_b, r_b + (m_b - new_max))
    torch.logaddexp(shift_a, shift_b, out=r_a)
    m_a.copy_(new_max)
    return acc


def _rescaled_cross(stats: torch.Tensor, teacher: torch.Tensor, cross: torch.Tensor, student_max, teacher_max):
    """``cross`` relative to other maxima (>= these): (cross + (M - m) * exp(rT)) * exp(mT - MT); 0 if empty."""
    m, (mt, rt) = stats[MAX], teacher
    shifted = (cross + (student_max - m) * torch.exp(rt)) * torch.exp(mt - teacher_max)
    return torch.where(m == float("-inf"), 0.0, shifted)


def cross_merge_(acc: Sequence[torch.Tensor], part: Sequence[torch.Tensor]) -> None:
    """Merge the distillation loss's partials ``part`` into ``acc`` in place, each (student stats ``[2, n]``,
    teacher stats ``[2, n]``, cross ``[n]``) over disjoint sets of columns (:mod:`infcl.losses.distill`): both
    stats by :func:`lse_merge`, each side's cross rescaled to the merged maxima (sums of non-negative terms)."""
    student, teacher, cross = acc
    p_student, p_teacher, p_cross = part
    student_max = torch.maximum(student[MAX], p_student[MAX])
    teacher_max = torch.maximum(teacher[MAX], p_teacher[MAX])
    merged = _rescaled_cross(student, teacher, cross, student_max, teacher_max) + _rescaled_cross(
        p_student, p_teacher, p_cross, student_max, teacher_max
    )
    cross.copy_(merged)
    lse_merge(student, p_student)
    lse_merge(teacher, p_teacher)


def empty_stats(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Stats of ``n`` empty sets: m = -inf, r = -inf (the identity of :func:`lse_merge`)."""
    return torch.full((2, n), float("-inf"), dtype=dtype, device=device)


# exp(x) = 2 ** (x * log2(e)); the Triton kernels multiply by the same constant.
LOG2_E = 1.4426950408889634


def exp_(x: torch.Tensor) -> torch.Tensor:
    """e ** x in place, for the tile loops' exponentials, whose arguments are all <= 0 (s - m, (s - m) - r).

    On CPU as exp2(x * log2(e)): torch's exp there is MKL's vector exp, which runs its generic path on
    every non-Intel CPU (AMD EPYC, Zen 3: 1.1 ns an element, against 0.7 for torch's exp2 and the multiply).
    The multiply's rounding moves a term by at most |x| * 2^-24 relative: under 1e-6 for every term above
    1e-7 of its line's largest (|x| < 16), under 6e-6 for the smallest normal ones; exp(0) = 2^0 = 1
    exactly, which :func:`tile_stats` counts on. Elsewhere (CUDA) torch's exp, one pass instead of two.
    """
    if x.device.type == "cpu":
        return x.mul_(LOG2_E).exp2_()
    return x.exp_()


def tile_stats(
    s: torch.Tensor, dim: int, scratch: Optional[torch.Tensor] = None, ones: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Stats ``[2, n]`` of a tile of logits ``s`` along ``dim`` (1: per row, 0: per column).

    m = max, r = log1p(rest): the terms exp(s - m) summed with one maximal entry's exp(0) = 1 left out, by
    value rather than by position: a term is exactly 1 where s = m (and where exp rounds a near-tie there,
    as any sum of the terms would have it), below 1 elsewhere, so floor() counts the ones, frac() leaves the
    rest, and rest = sum(frac) + (ones - 1): the other ties keep their exact 1s and a confident line's rest
    ~ 1e-20 never meets a 1. (No argmax: on CPU it costs more than the exp.) ``scratch`` and ``ones``:
    optional buffers of s's shape and dtype; ``ones`` may be ``s`` itself, overwritten, where the caller
    reads s no more (s is read only before the exponentials). A NaN in a line makes its m and r NaN; a +inf
    makes its r NaN (inf - inf), as ``F.cross_entropy`` gives.
    """
    m = torch.amax(s, dim=dim, keepdim=True)
    terms = exp_(torch.sub(s, m, out=scratch))
    count = torch.floor(terms, out=ones).sum(dim)
    rest = terms.frac_().sum(dim).add_(count.sub_(1.0))
    return torch.stack((m.squeeze(dim), rest.log1p_()))
