"""Issue 23 across ranks: ids, multiple positives and guides on gloo rings of 2 and 3 ranks vs one float64 process.

One spawn of 3 processes (tests/workers/masks_ring_worker.py) runs every case on both rings with every backend;
the tests only read the results. Uneven local batches, hard-negative columns, ids repeating across
ranks, guide features passed per rank; labels are global. Convention as tests/test_ring.py: rank r
returns its local loss, q_r.grad and k_r.grad are d(sum_s L_s)/d(rank r's copy), scale.grad is dL_r/dscale.
"""

import pytest

from helpers.distributed import launch, results_by_ring
from helpers.support import TOLERANCE, assert_close_verbose, assert_ring_matches, tiled_backends
from workers import masks_ring_worker as worker
from workers.ring_worker import TINY_SUFFIX

# The reference, the torch tiles (also shrunk, so masks cut across tile edges) and the native kernel where built.
BACKENDS = ("reference", "torch", "torch" + TINY_SUFFIX) + tuple(b for b in tiled_backends() if b != "torch")
CASE_NAMES = tuple(c.name for c in worker.mask_cases(2))
PG_TIMEOUT_S = 60.0
DEADLINE_S = 300.0  # generous: only there so that a hang fails instead of blocking the suite


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    outcomes = launch(
        worker.MAIN_WORLD,
        "workers.masks_ring_worker",
        str(tmp_path_factory.mktemp("masks_ring")),
        list(BACKENDS),
        pg_timeout_s=PG_TIMEOUT_S,
        deadline_s=DEADLINE_S,
    )
    return results_by_ring(outcomes, worker.RINGS)


def _case(world, name):
    return next(c for c in worker.mask_cases(world) if c.name == name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("world", tuple(worker.RINGS))
def test_masked_ring_matches_single_process(spawned, world, name, backend):
    case = _case(world, name)
    truth = worker.truth(case)
    atol, rtol = TOLERANCE[case.dtype]
    assert_ring_matches(spawned(world), (name, backend), truth, atol, rtol, f"{name} {backend} world={world}")


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("world", tuple(worker.RINGS))
def test_masked_ring_stats_match_reference(spawned, world, backend):
    # The tiles' stats (read off their forward partials) against the reference's (materialized logits).
    for r, results in enumerate(spawned(world)):
        for name in CASE_NAMES:
            ours, ref = results["cases"][(name, backend)]["stats"], results["cases"][(name, "reference")]["stats"]
            present = 4 if _case(world, name).symmetric else 2
            assert all(t is not None for t in ours[:present] + ref[:present]), (ours, ref)
            assert all(t is None for t in ours[present:] + ref[present:]), (ours, ref)
            for i, (a, b) in enumerate(zip(ours[:present], ref[:present])):
                assert_close_verbose(a, b, 1e-6, 1e-6, f"{name} {backend} world={world} rank={r} stats[{i}]")


@pytest.mark.parametrize("what", ("ids", "guide-width"))
@pytest.mark.parametrize("world", tuple(worker.RINGS))
def test_options_differing_between_ranks_raise_on_every_rank(spawned, world, what):
    # The ids and guide features travel with k: a rank passing other kinds would hang the ring, so the
    # layout exchange compares them and every rank raises the same ValueError.
    for r, results in enumerate(spawned(world)):
        err = results["mismatch"][what]
        assert err is not None and err[0] == "ValueError", f"rank {r}: {err}"
        assert "must be passed alike on every rank" in err[1] and f"rank {world - 1}" in err[1], err[1]
