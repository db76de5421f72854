"""One rank of the MaxSim ring test, started by tests/test_maxsim_ring.py through tests/helpers/distributed.py.

``python -m workers.maxsim_ring_worker`` (3 processes) runs every case of :data:`CASES` on the rings of 1, 2 and 3
ranks (``RINGS``) on the torch tiles (shrunk: each block spans several ragged tiles), and one case on the Triton
kernels (interpreted without a GPU). Each rank passes its uneven
shard of the queries and of the documents, each shard at its own padded lengths (``LENGTHS``: the queries' Lq and
the documents' Lk differ per rank), and writes its local loss and gradients; the test compares them with the
float64 truth of the whole set (:func:`global_inputs`, padded to the longest lengths as masked tokens).
"""

from dataclasses import dataclass
from typing import Tuple

import torch

from helpers.distributed import run_on_rings
from infcl import cal_maxsim_loss
from infcl.backends.torch_tiles import TorchTilesBackend

MAIN_WORLD = 3
RINGS = {1: (0,), 2: (1, 2), 3: (0, 1, 2)}
TINY_TOKEN_TILES = (9, 20)
# The backend every call passes: the torch tiles with TINY_TOKEN_TILES.
TINY = TorchTilesBackend(token_tiles=TINY_TOKEN_TILES)
# Uneven shards per world size: (queries per rank, documents per rank); documents beyond the queries are negatives.
SHARDS = {1: ((11,), (17,)), 2: ((7, 4), (5, 12)), 3: ((2, 5, 4), (8, 3, 6))}
# Padded lengths per world size: (Lq per rank, Lk per rank); the whole set's are the longest.
LENGTHS = {1: ((6,), (9,)), 2: ((4, 6), (9, 5)), 3: ((6, 3, 5), (7, 9, 4))}
DIM = 6


@dataclass(frozen=True)
class MaxSimCase:
    name: str
    dtype: torch.dtype = torch.float32
    ids: bool = False
    length_normalize: bool = False
    backend: str = "torch"  # "torch": TINY; "triton": the Triton kernels (interpreted without a GPU)


CASES = (
    MaxSimCase("fp32"),
    MaxSimCase("ids-meanmaxsim-fp64", torch.float64, ids=True, length_normalize=True),
    MaxSimCase("bf16", torch.bfloat16),
    MaxSimCase("triton-ids-fp32", ids=True, backend="triton"),
)
SCALE = 1.5


def global_inputs(case: MaxSimCase):
    """The whole set: q [11, 6, D], docs [17, 9, D] in the case's dtype, their masks (every rank's padding masked,
    at every world size), labels [11] and ids (or None)."""
    n, m = sum(SHARDS[1][0]), sum(SHARDS[1][1])
    gen = torch.Generator().manual_seed(len(case.name))
    q = torch.randn(n, 6, DIM, generator=gen, dtype=torch.float64).to(case.dtype)
    docs = torch.randn(m, 9, DIM, generator=gen, dtype=torch.float64).to(case.dtype)
    q_mask = torch.rand(n, 6, generator=gen) > 0.25
    docs_mask = torch.rand(m, 9, generator=gen) > 0.25
    for world, (rows, cols) in SHARDS.items():  # a shard's own padding is masked in the whole set too
        lq, lk = LENGTHS[world]
        for rank in range(world):
            q_mask[_span(rows, rank), lq[rank] :] = False
            docs_mask[_span(cols, rank), lk[rank] :] = False
    q_mask[:, 0] = True
    docs_mask[:, 0] = True
    labels = torch.randint(0, m, (n,), generator=gen)
    q_ids = k_ids = None
    if case.ids:
        q_ids = torch.randint(0, 4, (n,), generator=gen)
        k_ids = torch.randint(0, 4, (m,), generator=gen)
    return q, docs, q_mask, docs_mask, labels, q_ids, k_ids


def _span(sizes: Tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _run(case: MaxSimCase, rank: int, world: int, group):
    q, docs, q_mask, docs_mask, labels, q_ids, k_ids = global_inputs(case)
    (rows, cols), (lq, lk) = SHARDS[world], LENGTHS[world]
    mine, theirs = _span(rows, rank), _span(cols, rank)
    q_local = q[mine, : lq[rank]].clone().requires_grad_()
    docs_local = docs[theirs, : lk[rank]].clone().requires_grad_()
    scale = torch.tensor(
        SCALE, dtype=torch.float64 if case.dtype == torch.float64 else torch.float32, requires_grad=True
    )
    loss = cal_maxsim_loss(
        q_local,
        docs_local,
        labels[mine],
        scale,
        q_mask=q_mask[mine, : lq[rank]],
        docs_mask=docs_mask[theirs, : lk[rank]],
        length_normalize=case.length_normalize,
        q_ids=None if q_ids is None else q_ids[mine],
        k_ids=None if k_ids is None else k_ids[theirs],
        group=group,
        backend=TINY if case.backend == "torch" else case.backend,
    )
    loss.backward()
    return {"loss": loss.detach(), "dq": q_local.grad, "dd": docs_local.grad, "dscale": scale.grad}


def st_inputs():
    """sentence-transformers' layout over the whole set: queries [11, 6, D] and two document columns (positive,
    negative) [11, 9, D] each, with masks; each rank's shard holds its queries' own documents."""
    n = sum(SHARDS[1][0])
    gen = torch.Generator().manual_seed(99)
    q = torch.randn(n, 6, DIM, generator=gen, dtype=torch.float64)
    columns = [torch.randn(n, 9, DIM, generator=gen, dtype=torch.float64) for _ in range(2)]
    q_mask = torch.rand(n, 6, generator=gen) > 0.25
    masks = [torch.rand(n, 9, generator=gen) > 0.25 for _ in range(2)]
    q_mask[:, 0] = True
    for m in masks:
        m[:, 0] = True
    return q, columns, q_mask, masks


def _run_st_gather(rank: int, world: int, group):
    """The multi-vector drop-in's loss with gather_across_devices=True: its labels' offsets over uneven shards."""
    from types import SimpleNamespace

    from infcl.sentence_transformers.multi_vector import maxsim_ranking_loss

    q, columns, q_mask, masks = st_inputs()
    mine = _span(SHARDS[world][0], rank)
    loss_obj = SimpleNamespace(
        gather_across_devices=True,
        group=group,
        scale=1.5,
        similarity_fct=None,
        model=SimpleNamespace(similarity_fn_name="maxsim"),
        backend=TINY,
    )
    q_local = q[mine].clone().requires_grad_()
    cols_local = [c[mine].clone().requires_grad_() for c in columns]
    loss = maxsim_ranking_loss(loss_obj, q_local, q_mask[mine], cols_local, [m[mine] for m in masks])
    loss.backward()
    return {"loss": loss.detach(), "dq": q_local.grad, "dcols": [c.grad for c in cols_local]}


def scenarios(rank, world, group):
    results = {case.name: _run(case, rank, world, group) for case in CASES}
    results["st-gather"] = _run_st_gather(rank, world, group)
    return results


if __name__ == "__main__":
    run_on_rings(MAIN_WORLD, RINGS, scenarios)
