"""One rank of the loss-option ring tests (issue 56: label smoothing, Matryoshka prefixes), started by
tests/test_options_ring.py.

``python -m workers.options_ring_worker BACKEND...`` (3 processes) runs every case of :func:`option_cases` on
rings of 2 and 3 ranks with every backend and writes the results; tests/test_options_ring.py compares them
with the float64 truth of one process (``F.cross_entropy(..., label_smoothing=eps)`` on the global logits).
"""

import functools
import sys
import zlib
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from helpers import ring_cases
from helpers.distributed import run_on_rings
from helpers.options_truth import kept_truth, masked_truth
from helpers.support import reduce_masked_truth
from infcl import Matryoshka, cal_inf_loss
from workers.ring_worker import run_cases

MAIN_WORLD = 3
WEIGHTS = (1.0, 0.5, 2.0)
RINGS = {2: (1, 2), 3: (0, 1, 2)}


@dataclass(frozen=True)
class OptionRingCase(ring_cases.RingCase):
    label_smoothing: float = 0.0
    matryoshka: Optional[Tuple[int, ...]] = None  # prefix dims (weights WEIGHTS[:K], renormalized)
    ids: Optional[str] = None  # ids: "one" (multi_positive None), "mean" or "sum"
    guide: bool = False  # a guide (integer-valued guide features, ties; margin 0; never truncated)

    @property
    def multi_positive(self) -> Optional[str]:
        return None if self.ids == "one" else self.ids


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
        replace(base, name="ls-ids-sym-mean-positives", label_smoothing=0.25, ids="mean"),
        replace(base, name="ls-ids-sym-sum-positives", label_smoothing=0.35, ids="sum"),
        replace(base, name="ls-guide-sym-mean", label_smoothing=0.2, guide=True),
        replace(base, name="ls-guide-ids-sym-sum", label_smoothing=0.3, ids="sum", guide=True),
        replace(
            base,
            name="ls-guide-ids-one-hardneg-none",
            symmetric=False,
            k_sizes=hard,
            reduction="none",
            label_smoothing=0.25,
            ids="one",
            guide=True,
        ),
        replace(
            base,
            name="ls-ids-one-hardneg-none",
            symmetric=False,
            k_sizes=hard,
            reduction="none",
            label_smoothing=0.15,
            ids="one",
        ),
        replace(base, name="mat-sym-perm-mean", matryoshka=(6, 2, 4)),
        # The mask options in the fused pass (torch tiles, native) or one call per prefix (the others).
        replace(base, name="mat-ids-sym-mean-positives", matryoshka=(6, 3), ids="mean"),
        replace(
            base,
            name="mat-guide-ids-one-hardneg-none-f32",
            symmetric=False,
            k_sizes=hard,
            reduction="none",
            dtype=torch.float32,
            matryoshka=(2, 6, 4),
            ids="one",
            guide=True,
        ),
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


def case_ids(case: OptionRingCase):
    """Global (q_ids, k_ids) of an ids case: few classes, each row's labelled column carrying its id."""
    g = ring_cases.global_inputs(case)
    gen = torch.Generator().manual_seed(zlib.crc32(f"ids/{case.name}/{case.world}".encode()))
    q_ids = torch.randint(0, 3, (g.q.shape[0],), generator=gen)
    k_ids = torch.randint(0, 3, (g.k.shape[0],), generator=gen)
    k_ids[g.labels] = q_ids
    return q_ids, k_ids


def case_guide(case: OptionRingCase):
    """Global integer-valued guide features (exact scores) of a guide case, each third row's labelled column's
    copied onto the next column: a tie with its threshold at margin 0 (kept)."""
    g = ring_cases.global_inputs(case)
    gen = torch.Generator().manual_seed(zlib.crc32(f"guide/{case.name}/{case.world}".encode()))
    gq = torch.randint(-2, 3, (g.q.shape[0], 3), generator=gen).double()
    gk = torch.randint(-2, 3, (g.k.shape[0], 3), generator=gen).double()
    for i in range(0, g.q.shape[0], 3):
        gk[(int(g.labels[i]) + 1) % g.k.shape[0]] = gk[g.labels[i]]
    return gq, gk


def _ids_losses(case: OptionRingCase, q, k, labels, params) -> list:
    q_ids, k_ids = case_ids(case) if case.ids else (None, None)
    guide = case_guide(case) if case.guide else None
    losses = []
    for s, (scale,) in enumerate(params):
        multi, eps = case.multi_positive, case.label_smoothing
        if guide is None:
            rows, cols = masked_truth(q, k, labels, scale, q_ids, k_ids, multi, eps, case.symmetric)
        else:
            rows, cols = kept_truth(
                q, k, labels, scale, q_ids, k_ids, multi, guide, 0.0, "absolute", eps, case.symmetric
            )
        qo, ko, nq, nk = case.q_offsets[s], case.k_offsets[s], case.q_sizes[s], case.k_sizes[s]
        local_cols = None if cols is None else cols[ko : ko + nk]
        losses.append(reduce_masked_truth(rows[qo : qo + nq], local_cols, case.reduction))
    return losses


def _local_losses(case: OptionRingCase, q, k, labels, params) -> list:
    if case.matryoshka:
        return _prefix_losses(case, q, k, labels, params)
    if case.ids or case.guide:
        return _ids_losses(case, q, k, labels, params)
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
    ids = {}
    if case.ids:
        q_ids, k_ids = case_ids(case)
        qo, ko = case.q_offsets[rank], case.k_offsets[rank]
        ids = {
            "q_ids": q_ids[qo : qo + case.q_sizes[rank]],
            "k_ids": k_ids[ko : ko + case.k_sizes[rank]],
            "multi_positive": case.multi_positive,
        }
    if case.guide:
        gq, gk = case_guide(case)
        qo, ko = case.q_offsets[rank], case.k_offsets[rank]
        ids["guide"] = (
            gq[qo : qo + case.q_sizes[rank]].to(case.dtype),
            gk[ko : ko + case.k_sizes[rank]].to(case.dtype),
        )
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
        **ids,
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
