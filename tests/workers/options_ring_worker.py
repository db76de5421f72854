"""One rank of the loss-option ring tests (issue 56: label smoothing, Matryoshka prefixes), started by
tests/test_options_ring.py.

``python -m workers.options_ring_worker BACKEND...`` (3 processes) runs every case of :func:`option_cases` on
rings of 2 and 3 ranks with every backend and writes the results; tests/test_options_ring.py compares them
with the float64 truth of one process (``F.cross_entropy(..., label_smoothing=eps)`` on the global logits).
"""

import functools
import sys
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from helpers import ring_cases
from helpers.distributed import run_on_rings
from infcl import Matryoshka, cal_inf_loss
from workers.ring_worker import run_cases

MAIN_WORLD = 3
WEIGHTS = (1.0, 0.5, 2.0)
RINGS = {2: (1, 2), 3: (0, 1, 2)}


@dataclass(frozen=True)
class OptionRingCase(ring_cases.RingCase):
    label_smoothing: float = 0.0
    matryoshka: Optional[Tuple[int, ...]] = None  # prefix dims (weights WEIGHTS[:K], renormalized)


def option_cases(world: int) -> List[OptionRingCase]:
    uneven, hard = ring_cases.UNEVEN_Q[world], ring_cases.HARD_NEG_K[world]
    base = OptionRingCase("", world, uneven, uneven, True, "custom", "mean", torch.float64, "scaled")
    return [
        replace(base, name="ls-sym-perm-mean", label_smoothing=0.2),
        replace(
            base,
            name="ls-sym-default-none-f32",
            labels="default",
            reduction="none",
            dtype=torch.float32,
            label_smoothing=0.1,
            noncontig=True,
        ),
        replace(base, name="ls-one-hardneg-sum", symmetric=False, k_sizes=hard, reduction="sum", label_smoothing=0.3),
        replace(base, name="mat-sym-perm-mean", matryoshka=(6, 2, 4)),
        replace(
            base,
            name="mat-one-hardneg-none-f32",
            symmetric=False,
            k_sizes=hard,
            reduction="none",
            dtype=torch.float32,
            matryoshka=(3, 6),
            noncontig=True,
        ),
    ]


def _prefix_losses(case: OptionRingCase, q, k, labels, params) -> list:
    """sum_k w_k * (the local loss of prefix k, F.normalize'd)."""
    total = None
    for m, w in zip(case.matryoshka, WEIGHTS):
        plain = replace(case, matryoshka=None)
        qm, km = F.normalize(q[:, :m], dim=-1), F.normalize(k[:, :m], dim=-1)
        losses = [w * loss for loss in _local_losses(plain, qm, km, labels, params)]
        total = losses if total is None else [a + b for a, b in zip(total, losses)]
    return total


def _local_losses(case: OptionRingCase, q, k, labels, params) -> list:
    if case.matryoshka:
        return _prefix_losses(case, q, k, labels, params)
    inverse = torch.argsort(labels) if case.symmetric else None
    eps, losses = case.label_smoothing, []
    for s, (scale,) in enumerate(params):
        qo, ko, nq, nk = case.q_offsets[s], case.k_offsets[s], case.q_sizes[s], case.k_sizes[s]
        per = F.cross_entropy(
            scale * q[qo : qo + nq] @ k.T, labels[qo : qo + nq], reduction="none", label_smoothing=eps
        )
        if case.symmetric:
            logits = scale * k[ko : ko + nk] @ q.T
            per = (per + F.cross_entropy(logits, inverse[ko : ko + nk], reduction="none", label_smoothing=eps)) / 2
        losses.append({"mean": per.mean, "sum": per.sum, "none": lambda p=per: p}[case.reduction]())
    return losses


@functools.lru_cache(maxsize=None)
def truth(case: OptionRingCase) -> ring_cases.Truth:
    return ring_cases._truth(case, _local_losses, (ring_cases.SCALE,))


def _run_case(case: OptionRingCase, backend, rank, group):
    q_leaf, k_leaf, q, k, labels, upstream = ring_cases.local_inputs(case, rank)
    scale = torch.tensor(ring_cases.SCALE, dtype=case.dtype, requires_grad=True)
    loss = cal_inf_loss(
        q,
        k,
        labels,
        scale,
        symmetric=case.symmetric,
        reduction=case.reduction,
        group=group,
        backend=backend,
        label_smoothing=case.label_smoothing,
        matryoshka=None if case.matryoshka is None else Matryoshka(case.matryoshka, WEIGHTS[: len(case.matryoshka)]),
    )
    loss.backward(upstream.to(loss.dtype))
    dq, dk = (q_leaf.grad.T, k_leaf.grad.T) if case.noncontig else (q_leaf.grad, k_leaf.grad)
    return {"loss": loss.detach(), "dq": dq, "dk": dk, "dscale": scale.grad}


def main(backends):
    run_on_rings(
        MAIN_WORLD,
        RINGS,
        lambda rank, size, group: {"cases": run_cases(rank, size, group, backends, cases=option_cases, run=_run_case)},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
