"""The sigmoid loss with ids on the ring: 1, 2 and 3 CPU processes (gloo) with uneven shards against one
float64 truth built without infcl (issue 56).

One spawn of 3 processes (tests/workers/siglip_ids_ring_worker.py) runs every backend on rings of 1, 2 and 3
ranks; each rank passes its local ids, which travel with their k block. Convention (as without ids, see
test_siglip_ring.py): rank r returns L_r, its rows against every rank's text; the features' gradients are
those of sum_s g_s L_s, scale's and bias's those of g_r L_r alone.
"""

import functools

import pytest
import torch

from helpers.distributed import launch, results_by_ring
from helpers.support import (
    TOLERANCE,
    assert_close_verbose,
    interpreting_triton,
    siglip_magnitudes,
    siglip_truth,
    tiled_backends,
)
from infcl.backends import unavailable_reason
from workers.ring_worker import TINY_SUFFIX
from workers.siglip_ids_ring_worker import DTYPES, K_SIZES, MAIN_WORLD, Q_SIZES, RINGS, global_inputs, shard

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORLDS = tuple(RINGS)
TRITON = ("triton",) if interpreting_triton() and unavailable_reason("triton", torch.device("cpu")) is None else ()
BACKENDS = ("reference", "torch", "torch" + TINY_SUFFIX) + tuple(b for b in tiled_backends() if b != "torch") + TRITON
KEYS = ("loss", "dq", "dk", "dscale", "dbias")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    outcomes = launch(
        MAIN_WORLD,
        "workers.siglip_ids_ring_worker",
        str(tmp_path_factory.mktemp("siglip-ids-ring")),
        list(BACKENDS),
        pg_timeout_s=60.0,
        deadline_s=240.0,
    )
    return results_by_ring(outcomes, RINGS)


@functools.lru_cache(maxsize=None)
def magnitudes(world: int):
    """Per rank, each output's sum of |terms| in float64 (support.siglip_magnitudes): rank r's rows give its
    loss, dq and parameter gradients; every rank's rows add to each text row's dk."""
    g = global_inputs(world)
    parts = []
    for r in range(world):
        qs = shard(Q_SIZES[world], r)
        upstream = torch.tensor(g.upstream[r], dtype=torch.float64)
        ids = (g.q_ids[qs], g.k_ids)
        parts.append(siglip_magnitudes(g.q[qs], g.k, 7.0, -3.0, None, "sum", upstream, ids))
    dk = sum(p[2] for p in parts)
    return [dict(zip(KEYS, (p[0], p[1], dk[shard(K_SIZES[world], r)], p[3], p[4]))) for r, p in enumerate(parts)]


@functools.lru_cache(maxsize=None)
def truth(world: int):
    """Per rank, in float64 on the materialized logits: (L_r, dq_r, dk_r, dscale_r, dbias_r)."""
    g = global_inputs(world)
    q, k = g.q.clone().requires_grad_(), g.k.clone().requires_grad_()
    scale = torch.tensor(7.0, dtype=torch.float64, requires_grad=True)
    bias = torch.tensor(-3.0, dtype=torch.float64, requires_grad=True)
    losses = []
    for r in range(world):
        qs = shard(Q_SIZES[world], r)
        losses.append(siglip_truth(q[qs], k, scale, bias, reduction="sum", ids=(g.q_ids[qs], g.k_ids)))
    total = sum(u * loss for u, loss in zip(g.upstream, losses))
    dq, dk = torch.autograd.grad(total, (q, k), retain_graph=True)
    out = []
    for r, loss in enumerate(losses):
        dscale, dbias = torch.autograd.grad(g.upstream[r] * loss, (scale, bias), retain_graph=True)
        qs, ks = shard(Q_SIZES[world], r), shard(K_SIZES[world], r)
        out.append({"loss": loss.detach(), "dq": dq[qs], "dk": dk[ks], "dscale": dscale, "dbias": dbias})
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", WORLDS)
def test_ring_with_ids_matches_float64_truth(spawned, world, backend, dtype):
    atol, rtol = TOLERANCE[dtype]
    for r, (results, want, size) in enumerate(zip(spawned(world), truth(world), magnitudes(world))):
        got = results[(backend, str(dtype))]
        assert got["loss"].dtype == dtype
        for key in KEYS:
            what = f"{backend} world={world} rank={r} {key}"
            assert_close_verbose(got[key], want[key], atol, rtol, what, magnitude=size[key])


def test_some_rows_have_no_positive_and_some_several():
    """The cases exercise what ids add: rows without a positive and rows with several, across ranks."""
    g = global_inputs(3)
    matches = (g.q_ids[:, None] == g.k_ids[None, :]).sum(dim=1)
    assert (matches == 0).any() and (matches > 1).any()
