"""One rank of the top-k ring test, started by tests/test_topk_ring.py through tests/helpers/distributed.py.

``python -m workers.topk_ring_worker`` (3 processes) runs every case of :data:`CASES` on the rings of 1, 2 and
3 ranks (``RINGS``), on the torch tiles (shrunk: each block spans several ragged tiles), the native kernel and
the Triton kernel (under the interpreter without a GPU: the ranks inherit TRITON_INTERPRET), each rank passing
its uneven shard of the rows and of the corpus (``SHARDS``), and writes each rank's local result. The test
compares the rows gathered in rank order with the float64 truth of the whole set.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from helpers.distributed import run_on_rings
from helpers.topk_truth import quarter_features
from infcl import topk_scores
from infcl.backends import unavailable_reason
from infcl.backends.torch_tiles import TorchTilesBackend

MAIN_WORLD = 3
RINGS = {1: (0,), 2: (1, 2), 3: (0, 1, 2)}
TINY_TILES = (5, 7)
BACKENDS = ("torch",) + tuple(
    name for name in ("cpu", "triton") if unavailable_reason(name, torch.device("cpu")) is None
)
# Uneven shards per world size: (rows per rank, corpus rows per rank).
SHARDS = {1: ((23,), (61,)), 2: ((15, 8), (10, 51)), 3: ((5, 11, 7), (30, 9, 22))}


@dataclass(frozen=True)
class TopKCase:
    name: str
    n: int
    dtype: torch.dtype = torch.float32
    ties: bool = True  # quarter features: exact scores, ties everywhere; else random float64
    ids: Optional[int] = None  # ids from this many classes
    labels: bool = False  # exclude_labels with a global column per row (some -1)
    largest: bool = True
    nan: bool = False  # a NaN in one corpus row (on the last rank's shard for every ring size)


CASES = (
    TopKCase("ties-fp32", 9),
    TopKCase("ids-labels-bf16", 7, torch.bfloat16, ids=6, labels=True),
    TopKCase("random-fp64-smallest", 5, torch.float64, ties=False, largest=False),
    TopKCase("n-beyond-the-corpus", 70, ids=4),
    TopKCase("nan-column-fp16", 4, torch.float16, ids=5, nan=True),
)
DIM = 7


def global_inputs(case: TopKCase):
    """(q [23, D], k [61, D], labels or None, q_ids or None, k_ids or None): the whole set."""
    n, m = sum(SHARDS[1][0]), sum(SHARDS[1][1])
    seed = len(case.name)
    if case.ties:
        q, k = quarter_features(n, DIM, seed, case.dtype), quarter_features(m, DIM, seed + 1, case.dtype)
        k[40] = k[2]  # an exact duplicate on another shard
    else:
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(n, DIM, generator=gen, dtype=torch.float64).to(case.dtype)
        k = torch.randn(m, DIM, generator=gen, dtype=torch.float64).to(case.dtype)
    if case.nan:
        k[m - 3, 1] = float("nan")
    gen = torch.Generator().manual_seed(seed + 2)
    labels = torch.randint(-1, m, (n,), generator=gen) if case.labels else None
    q_ids = k_ids = None
    if case.ids is not None:
        q_ids = torch.randint(0, case.ids, (n,), generator=gen)
        k_ids = torch.randint(0, case.ids + 2, (m,), generator=gen)
    if case.nan:
        k_ids[m - 3] = q_ids[0]  # row 0 leaves the NaN column out
    return q, k, labels, q_ids, k_ids


def shard(t, sizes: Tuple[int, ...], rank: int):
    if t is None:
        return None
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def _run(case: TopKCase, rank: int, world: int, group, backend):
    q, k, labels, q_ids, k_ids = global_inputs(case)
    rows, cols = SHARDS[world]
    got = topk_scores(
        shard(q, rows, rank),
        shard(k, cols, rank),
        case.n,
        labels=shard(labels, rows, rank),
        exclude_labels=case.labels,
        q_ids=shard(q_ids, rows, rank),
        k_ids=shard(k_ids, cols, rank),
        largest=case.largest,
        group=group,
        backend=backend,
    )
    return {"scores": got.scores, "indices": got.indices}


def scenarios(rank, world, group):
    # "torch": the torch tiles shrunk to TINY_TILES, from the call.
    routes = {name: TorchTilesBackend(*TINY_TILES) if name == "torch" else name for name in BACKENDS}
    return {(case.name, name): _run(case, rank, world, group, routes[name]) for case in CASES for name in BACKENDS}


if __name__ == "__main__":
    run_on_rings(MAIN_WORLD, RINGS, scenarios)
