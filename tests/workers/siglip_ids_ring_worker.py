"""One rank of the ring tests of the sigmoid loss with ids (issue 56), started by tests/test_siglip_ids_ring.py
through helpers/distributed.py.

``python -m workers.siglip_ids_ring_worker BACKEND...`` (3 processes) runs :func:`cases` on rings of 1, 2 and 3
ranks (the ring of 2 is a subgroup whose group ranks differ from the global ranks) with every backend (a name
ending in ring_worker.TINY_SUFFIX: the torch tiles shrunk so each block spans several tiles) and writes the
results. Shards are uneven (Bq != Bk on every rank, and unequal across ranks); each rank passes its local ids,
drawn from a few classes, so positives repeat within and across ranks and some rows have none.
"""

import sys
import zlib
from typing import Dict, NamedTuple, Tuple

import torch

from helpers.distributed import run_on_rings
from infcl import cal_siglip_loss
from infcl.backends.torch_tiles import TorchTilesBackend
from workers.ring_worker import TINY_SUFFIX

MAIN_WORLD = 3
RINGS = {1: (0,), 2: (1, 2), 3: (0, 1, 2)}
Q_SIZES = {1: (7,), 2: (5, 9), 3: (4, 9, 6)}
K_SIZES = {1: (11,), 2: (8, 3), 3: (6, 2, 9)}
DIM = 6
N_CLASSES = 5
SCALE, BIAS = 7.0, -3.0
TINY_TILES = (2, 3)
DTYPES = (torch.float64, torch.float32)


class Inputs(NamedTuple):
    """The global batch of a ring (the same in every process): features, ids and each rank's upstream gradient."""

    q: torch.Tensor
    k: torch.Tensor
    q_ids: torch.Tensor
    k_ids: torch.Tensor
    upstream: Tuple[float, ...]


def global_inputs(world: int) -> Inputs:
    gen = torch.Generator().manual_seed(zlib.crc32(f"siglip-ids/{world}".encode()))
    nq, nk = sum(Q_SIZES[world]), sum(K_SIZES[world])
    q = torch.randn(nq, DIM, generator=gen, dtype=torch.float64) / DIM**0.5
    k = torch.randn(nk, DIM, generator=gen, dtype=torch.float64) / DIM**0.5
    q_ids = torch.randint(0, N_CLASSES + 1, (nq,), generator=gen)  # class N_CLASSES: rows without a positive
    k_ids = torch.randint(0, N_CLASSES, (nk,), generator=gen)
    upstream = tuple(-0.7 + 0.9 * r for r in range(world))  # mixed signs, non-unit
    return Inputs(q, k, q_ids, k_ids, upstream)


def shard(sizes: Tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _run(world: int, rank: int, group, backend, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    g = global_inputs(world)
    qs, ks = shard(Q_SIZES[world], rank), shard(K_SIZES[world], rank)
    q = g.q[qs].to(dtype).requires_grad_()
    k = g.k[ks].to(dtype).requires_grad_()
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    scale = torch.tensor(SCALE, dtype=pdtype, requires_grad=True)
    bias = torch.tensor(BIAS, dtype=pdtype, requires_grad=True)
    loss = cal_siglip_loss(
        q, k, scale, bias, q_ids=g.q_ids[qs], k_ids=g.k_ids[ks], reduction="sum", group=group, backend=backend
    )
    (loss * g.upstream[rank]).backward()
    return {"loss": loss.detach(), "dq": q.grad, "dk": k.grad, "dscale": scale.grad, "dbias": bias.grad}


def scenarios(backends):
    def run(rank: int, world: int, group) -> dict:
        out = {}
        for backend in backends:
            # the torch tiles shrunk: a backend object the call takes (ring_worker.TINY_SUFFIX names it)
            route = TorchTilesBackend(*TINY_TILES) if backend == "torch" + TINY_SUFFIX else backend
            for dtype in DTYPES:
                out[(backend, str(dtype))] = _run(world, rank, group, route, dtype)
        return out

    return run


if __name__ == "__main__":
    run_on_rings(MAIN_WORLD, RINGS, scenarios(sys.argv[1:]))
