"""One rank of the masked ring tests (issue 23), started by tests/test_masks_ring.py through helpers/distributed.py.

``python -m workers.masks_ring_worker BACKEND...`` (3 processes) runs every case of :func:`mask_cases` on rings of 2
and 3 ranks (the ring of 2 is a subgroup whose group ranks differ from the global ranks) with every backend
(a name ending in ring_worker.TINY_SUFFIX: the torch tiles shrunk so each block spans several tiles) and
writes the results. Each rank passes its local ids and guide features; labels are global. Ids come from
a few classes, so they repeat within and across ranks.
"""

import functools
import sys
import zlib
from dataclasses import dataclass, replace
from typing import List, Optional

import torch

from helpers import ring_cases
from helpers.distributed import run_on_rings
from helpers.support import masked_truth_directions, reduce_masked_truth
from infcl import cal_inf_loss
from workers.ring_worker import run_cases

MAIN_WORLD = 3
RINGS = {2: (1, 2), 3: (0, 1, 2)}
N_CLASSES = 4  # ids from few classes: duplicates within a rank and across ranks
GUIDE_DIM = 5
MARGINS = {"absolute": 0.25, "relative": 0.3}


@dataclass(frozen=True)
class MaskRingCase(ring_cases.RingCase):
    multi_positive: Optional[str] = None
    ids: bool = True
    guide: Optional[str] = None  # None | "absolute" | "relative" (the margin strategy)
    partnerless: bool = False  # k ids drawn independently: some rows and columns have no positive


def mask_cases(world: int) -> List[MaskRingCase]:
    uneven, hard = ring_cases.UNEVEN_Q[world], ring_cases.HARD_NEG_K[world]
    base = MaskRingCase("", world, uneven, uneven, True, "default", "mean", torch.float64, "scaled")
    return [
        replace(base, name="m-sym-mean-ids", multi_positive="mean"),
        replace(
            base,
            name="m-sym-none-ids-guide-abs-sum",
            labels="custom",
            reduction="sum",
            guide="absolute",
            noncontig=True,
        ),
        replace(base, name="m-sym-sum-partnerless-mean", multi_positive="sum", partnerless=True),
        replace(
            base,
            name="m-sym-mean-guide-rel-none-f32",
            multi_positive="mean",
            guide="relative",
            reduction="none",
            dtype=torch.float32,
        ),
        replace(
            base,
            name="m-one-sum-hardneg-guide-rel-none",
            symmetric=False,
            k_sizes=hard,
            labels="custom",
            multi_positive="sum",
            guide="relative",
            reduction="none",
        ),
        replace(
            base,
            name="m-one-guide-only-hardneg-mean",
            symmetric=False,
            k_sizes=hard,
            labels="custom",
            ids=False,
            guide="absolute",
        ),
    ]


def mask_inputs(case: MaskRingCase):
    """Global (q_ids, k_ids, guide_q, guide_k) of a case (None where unused), the same in every process."""
    g = ring_cases.global_inputs(case)
    gen = torch.Generator().manual_seed(zlib.crc32(f"masks/{case.name}/{case.world}".encode()))
    nq, nk = g.q.shape[0], g.k.shape[0]
    q_ids = torch.randint(0, N_CLASSES, (nq,), generator=gen)
    k_ids = torch.randint(0, N_CLASSES + (3 if case.partnerless else 0), (nk,), generator=gen)
    if case.partnerless:
        q_ids = q_ids + 2  # classes 0 and 1 only on the k side, 4 only on the q side
    else:
        k_ids[g.labels] = q_ids  # each row's labelled column carries its id (paired data)
    guide_q = torch.randn(nq, GUIDE_DIM, generator=gen, dtype=torch.float64)
    guide_k = torch.randn(nk, GUIDE_DIM, generator=gen, dtype=torch.float64)
    return (q_ids, k_ids) if case.ids else (None, None), (guide_q, guide_k) if case.guide else None


def options(case: MaskRingCase, q_ids, k_ids, guide) -> dict:
    opts = {"multi_positive": case.multi_positive, "q_ids": q_ids, "k_ids": k_ids}
    if case.guide:
        opts.update(guide=guide, guide_margin=MARGINS[case.guide], guide_margin_strategy=case.guide)
    return opts


def _local_losses(case: MaskRingCase, q, k, labels, params) -> list:
    """Every rank's local loss (its rows and, symmetric, its columns, reduced locally) in float64."""
    (q_ids, k_ids), guide = mask_inputs(case)
    losses = []
    for s, (scale,) in enumerate(params):
        rows, cols = masked_truth_directions(
            q, k, labels, scale, symmetric=case.symmetric, **options(case, q_ids, k_ids, guide)
        )
        qo, ko, nq, nk = case.q_offsets[s], case.k_offsets[s], case.q_sizes[s], case.k_sizes[s]
        local_cols = None if cols is None else cols[ko : ko + nk]
        losses.append(reduce_masked_truth(rows[qo : qo + nq], local_cols, case.reduction))
    return losses


@functools.lru_cache(maxsize=None)
def truth(case: MaskRingCase) -> ring_cases.Truth:
    return ring_cases._truth(case, _local_losses, (ring_cases.SCALE,))


def _run_case(case: MaskRingCase, backend, rank, group):
    q_leaf, k_leaf, q, k, labels, upstream = ring_cases.local_inputs(case, rank)
    (q_ids, k_ids), guide = mask_inputs(case)
    qs = slice(case.q_offsets[rank], case.q_offsets[rank] + case.q_sizes[rank])
    ks = slice(case.k_offsets[rank], case.k_offsets[rank] + case.k_sizes[rank])
    local_guide = None if guide is None else (guide[0][qs].to(case.dtype), guide[1][ks].to(case.dtype))
    opts = options(case, None if q_ids is None else q_ids[qs], None if k_ids is None else k_ids[ks], local_guide)
    scale = torch.tensor(ring_cases.SCALE, dtype=case.dtype, requires_grad=True)
    loss, stats = cal_inf_loss(
        q,
        k,
        labels,
        scale,
        symmetric=case.symmetric,
        reduction=case.reduction,
        group=group,
        backend=backend,
        return_stats=True,
        **opts,
    )
    loss.backward(upstream.to(loss.dtype))
    dq, dk = (q_leaf.grad.T, k_leaf.grad.T) if case.noncontig else (q_leaf.grad, k_leaf.grad)
    return {"loss": loss.detach(), "dq": dq, "dk": dk, "dscale": scale.grad, "stats": tuple(stats)}


def run_mismatch(rank, world, group):
    """Mask options that differ between ranks (the last passes none, or another guide width): every rank raises."""
    out = {}
    for what in ("ids", "guide-width"):
        last = rank == world - 1
        q, k = torch.randn(3, ring_cases.DIM), torch.randn(3, ring_cases.DIM)
        opts = {"q_ids": torch.arange(3), "k_ids": torch.arange(3)}
        if what == "ids" and last:
            opts = {}
        if what == "guide-width":
            width = GUIDE_DIM + (1 if last else 0)
            opts["guide"] = (torch.randn(3, width), torch.randn(3, width))
        try:
            cal_inf_loss(q, k, group=group, backend="torch", **opts)
            out[what] = None
        except Exception as err:  # the test checks the exact type
            out[what] = (type(err).__name__, str(err))
    return out


def main(backends):
    def scenarios(rank, size, group):
        return {
            "cases": run_cases(rank, size, group, backends, cases=mask_cases, run=_run_case),
            "mismatch": run_mismatch(rank, size, group),
        }

    run_on_rings(MAIN_WORLD, RINGS, scenarios)


if __name__ == "__main__":
    main(sys.argv[1:])
