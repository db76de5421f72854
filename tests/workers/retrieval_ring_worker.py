"""One rank of the retrieval ring test, started by tests/test_retrieval.py through tests/helpers/distributed.py.

``python -m workers.retrieval_ring_worker`` (2 processes) runs every case of :data:`CASES` on the ring of 2 ranks by
each route of :data:`ROUTES` (``backend="auto"``, and the torch tiles shrunk so that each block spans several tiles)
and writes each rank's metrics and local ranks.
The cases are global inputs (:func:`global_inputs`) cut into uneven shards: the test compares with a
float64 argsort truth of the whole set.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from helpers.distributed import run_on_rings
from infcl.backends.torch_tiles import TorchTilesBackend
from infcl.metrics import retrieval_metrics

MAIN_WORLD = 2
RINGS = {2: (0, 1)}
TINY_TILES = (5, 7)
# The backend each run passes, by name: "auto" (the native kernel where it is built), and the torch tiles with
# TINY_TILES (each block spans several tiles).
ROUTES = {"auto": "auto", "torch-tiny": TorchTilesBackend(*TINY_TILES)}


@dataclass(frozen=True)
class RetrievalCase:
    name: str
    q_sizes: Tuple[int, ...]  # image rows per rank
    k_sizes: Tuple[int, ...]  # text rows per rank
    labels: bool = False  # a global permutation instead of the diagonal
    ids: Optional[int] = None  # ids from this many classes (repeating within and across ranks)
    any_positive: bool = False
    ties: bool = False  # small integer features: exact ties everywhere
    dtype: torch.dtype = torch.float64


CASES = (
    RetrievalCase("diagonal-uneven", (9, 14), (9, 14)),
    RetrievalCase("labels-ties-fp32", (11, 6), (11, 6), labels=True, ties=True, dtype=torch.float32),
    RetrievalCase("ids-exclude", (10, 13), (10, 13), ids=6, ties=True),
    RetrievalCase("any-positive-coco", (6, 4), (17, 23), ids=9, any_positive=True),
)
DIM = 6


def global_inputs(case: RetrievalCase):
    """(image [N, D], text [M, D], labels [N] or None, image ids, text ids): the whole set."""
    gen = torch.Generator().manual_seed(len(case.name) * 7 + sum(case.q_sizes))
    n, m = sum(case.q_sizes), sum(case.k_sizes)
    if case.ties:
        image = torch.randint(-1, 2, (n, DIM), generator=gen).to(case.dtype)
        text = torch.randint(-1, 2, (m, DIM), generator=gen).to(case.dtype)
    else:
        image = torch.randn(n, DIM, generator=gen, dtype=torch.float64).to(case.dtype)
        text = (image[torch.arange(m) % n] + torch.randn(m, DIM, generator=gen, dtype=torch.float64)).to(case.dtype)
    labels = torch.randperm(m, generator=gen) if case.labels else None
    q_ids = k_ids = None
    if case.ids is not None:
        q_ids = torch.randint(0, case.ids, (n,), generator=gen)
        k_ids = torch.randint(0, case.ids + 2, (m,), generator=gen)  # some ids without an image: partnerless
    return image, text, labels, q_ids, k_ids


def _shard(t, sizes, rank):
    if t is None:
        return None
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def _run(case: RetrievalCase, rank: int, group, backend):
    image, text, labels, q_ids, k_ids = global_inputs(case)
    metrics, ranks = retrieval_metrics(
        _shard(image, case.q_sizes, rank),
        _shard(text, case.k_sizes, rank),
        _shard(labels, case.q_sizes, rank),
        q_ids=_shard(q_ids, case.q_sizes, rank),
        k_ids=_shard(k_ids, case.k_sizes, rank),
        any_positive=case.any_positive,
        return_ranks=True,
        group=group,
        backend=backend,
    )
    return {"metrics": metrics, "ranks": ranks}


def scenarios(rank, world, group):
    return {f"{case.name}/{route}": _run(case, rank, group, ROUTES[route]) for case in CASES for route in ROUTES}


if __name__ == "__main__":
    run_on_rings(MAIN_WORLD, RINGS, scenarios)
