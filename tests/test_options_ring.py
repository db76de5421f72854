"""Issue 56's loss options (label smoothing, Matryoshka prefixes) on gloo rings of 2 and 3 ranks vs one float64 process.

One spawn of 3 processes (tests/workers/options_ring_worker.py) runs every case on both rings with every
backend; the tests only read the results. Convention as tests/test_ring.py: rank r returns its local loss,
q_r.grad and k_r.grad are d(sum_s L_s)/d(rank r's copy), scale.grad is dL_r/dscale.
"""

import pytest

from helpers.distributed import launch, results_by_ring
from helpers.support import TOLERANCE, assert_ring_matches, tiled_backends
from workers import options_ring_worker as worker
from workers.ring_worker import TINY_SUFFIX

BACKENDS = ("reference", "torch" + TINY_SUFFIX) + tuple(tiled_backends())
CASE_NAMES = tuple(c.name for c in worker.option_cases(2))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("options_ring"))
    outcomes = launch(worker.MAIN_WORLD, "workers.options_ring_worker", out, list(BACKENDS), 60.0, 300.0)
    return results_by_ring(outcomes, worker.RINGS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("world", tuple(worker.RINGS))
def test_option_ring_matches_single_process(spawned, world, name, backend):
    case = next(c for c in worker.option_cases(world) if c.name == name)
    atol, rtol = TOLERANCE[case.dtype]
    assert_ring_matches(spawned(world), (name, backend), worker.truth(case), atol, rtol, f"{name} {backend} w={world}")
