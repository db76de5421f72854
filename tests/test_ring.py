"""The ring over ranks: 2, 3 and 4 CPU processes (gloo) against one process in float64.

One spawn of 4 processes runs every case and scenario on rings of 2, 3 and 4 ranks (tests/workers/ring_worker.py:
the smaller rings are subgroups) and writes all results; the tests below only read them. The failure
scenarios each spawn their own group of 2 or 3 processes, which they break.

Convention checked (see docs/ring.md): rank r returns its local loss L_r; q_r.grad and
k_r.grad are d(sum_s L_s)/d(rank r's copy); scale.grad on rank r is dL_r/dscale, which summed over
ranks is the full derivative.
"""

import re

import pytest
import torch

from helpers import ring_cases
from helpers.distributed import describe, launch, results_by_ring
from helpers.support import TOLERANCE, assert_close_verbose, assert_ring_matches, tiled_backends
from workers.ring_worker import FAILING_RANK, MAIN_WORLD, OVERLAP_CASES, RINGS, TINY_SUFFIX

WORLDS = tuple(RINGS)
BACKENDS = ("reference", "torch", "torch" + TINY_SUFFIX) + tuple(b for b in tiled_backends() if b != "torch")
CASE_NAMES = tuple(c.name for c in ring_cases.ring_cases(2))
# Generous bounds on a healthy run, only there so that a hang fails instead of blocking the suite.
MAIN_PG_TIMEOUT_S = 60.0
MAIN_DEADLINE_S = 170.0
# The failure tests' process-group timeout: short, so a hung peer is detected within seconds.
FAIL_PG_TIMEOUT_S = 5.0
FAIL_DEADLINE_S = 150.0  # bounds the survivors' start-up too; a passing run takes seconds
FP32 = TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """``spawned(world)`` -> the results of the ring of ``world`` ranks, one dict per group rank."""
    outcomes = launch(
        MAIN_WORLD,
        "workers.ring_worker",
        str(tmp_path_factory.mktemp("ring")),
        ["main", *BACKENDS],
        pg_timeout_s=MAIN_PG_TIMEOUT_S,
        deadline_s=MAIN_DEADLINE_S,
    )
    return results_by_ring(outcomes, RINGS)


def _case(world, name):
    return next(c for c in ring_cases.ring_cases(world) if c.name == name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_ring_matches_single_process(spawned, world, name, backend):
    case = _case(world, name)
    truth = ring_cases.truth(case)
    atol, rtol = TOLERANCE[case.dtype]
    ranks = spawned(world)
    for r, results in enumerate(ranks):
        dtype = results["cases"][(name, backend)]["loss_dtype"]
        assert dtype == case.dtype, f"{name} {backend} world={world} rank={r}: loss dtype {dtype}"
    # Each rank's dscale is that of its own loss; summed over ranks, the full derivative of sum_s L_s.
    assert_ring_matches(ranks, (name, backend), truth, atol, rtol, f"{name} {backend} world={world}")


def _indices(events, kind, stream=None):
    return [i for i, e in enumerate(events) if e[0] == kind and (stream is None or e[1] == stream)]


@pytest.mark.parametrize("direction", ("forward", "backward"))
@pytest.mark.parametrize("name", OVERLAP_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_next_block_is_posted_before_compute(spawned, world, name, direction):
    """The k exchange for step i+1 is committed before step i's compute and waited for after it."""
    k_stream, acc_stream = ("k-forward", "columns") if direction == "forward" else ("k-backward", "dk")
    symmetric = name.startswith("sym")
    for r, results in enumerate(spawned(world)):
        events = results["overlap"][name][direction]
        compute = _indices(events, "compute")
        commits, waits = _indices(events, "commit", k_stream), _indices(events, "wait", k_stream)
        assert len(compute) == world and len(commits) == len(waits) == world - 1, events
        for i in range(world - 1):
            assert f"{direction} step {i} " in events[commits[i]][2], events[commits[i]]
            assert commits[i] < compute[i] < waits[i] < compute[i + 1], f"rank {r} step {i}: {events}"
        if direction == "forward" and not symmetric:
            assert not _indices(events, "commit", acc_stream), "one-directional forward has no column partials"
            continue
        # The accumulators of step i travel while step i+1 computes; all W batches arrive home.
        acc_commits, acc_waits = _indices(events, "commit", acc_stream), _indices(events, "wait", acc_stream)
        assert len(acc_commits) == len(acc_waits) == world, events
        for i in range(world - 1):
            assert compute[i] < acc_commits[i] < compute[i + 1] < acc_waits[i], f"rank {r} step {i}: {events}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("what", ("dim", "dtype"))
def test_mismatch_raises_value_error_on_every_rank(spawned, world, what):
    for r, results in enumerate(spawned(world)):
        err = results["mismatch"][what]
        assert err is not None and err[0] == "ValueError", f"rank {r}: {err}"
        assert "every rank" in err[1] and "rank 0" in err[1] and f"rank {world - 1}" in err[1], err[1]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("what,match", (("labels", "labels must be column indices"), ("sizes", "symmetric=True needs")))
def test_one_rank_bad_data_raises_value_error_on_every_rank(spawned, world, what, match):
    # Data-dependent problems on one rank fail every rank at once (they travel with the layout
    # exchange), naming the rank, instead of leaving the other ranks to hang until the timeout.
    for r, results in enumerate(spawned(world)):
        err = results["mismatch"][what]
        assert err is not None and err[0] == "ValueError", f"rank {r}: {err}"
        assert match in err[1] and f"on rank {world - 1}" in err[1], err[1]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "what,kind,match",
    (("empty", "ValueError", "q is an empty batch"), ("label-dtype", "TypeError", "labels must be an integer tensor")),
)
def test_one_rank_bad_arguments_stop_every_rank(spawned, world, what, kind, match):
    # An argument that fails the last rank's own checks raises there, and every other rank raises a
    # ValueError naming it at the layout exchange instead of waiting for the process group's timeout.
    for r, results in enumerate(spawned(world)):
        err = results["mismatch"][what]
        assert err is not None, f"rank {r} raised nothing"
        if r == world - 1:
            assert err[0] == kind and match in err[1], f"rank {r}: {err}"
        else:
            assert err[0] == "ValueError" and f"on rank {world - 1} of this ring" in err[1], f"rank {r}: {err}"


@pytest.mark.parametrize("world", WORLDS)
def test_equals_open_clip_local_loss_gather_with_grad(spawned, world):
    """Per rank: loss and every parameter gradient equal ClipLoss(local_loss=True, gather_with_grad=True)."""
    for r, results in enumerate(spawned(world)):
        ours, theirs = results["open_clip"]["infcl"], results["open_clip"]["open_clip"]
        assert set(ours) == set(theirs)
        for key in ours:
            assert_close_verbose(ours[key], theirs[key], *FP32, f"world={world} rank={r} {key}")


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_averaging_gives_global_mean_gradient(spawned, world):
    """Under DDP our scale gradient is right; Inf-CL's extra all_reduce of dscale makes it W times too big."""
    truth = ring_cases.clip_mean_loss_grads(world)
    for r, results in enumerate(spawned(world)):
        ours, infcl_style = results["ddp"]["infcl"], results["ddp"]["infcl_with_dscale_all_reduce"]
        for key, expected in truth.items():
            assert_close_verbose(ours[key], expected, *FP32, f"DDP world={world} rank={r} {key}")
            if key != "logit_scale":
                assert_close_verbose(infcl_style[key], expected, *FP32, f"all-reduced world={world} rank={r} {key}")
        scale_truth = truth["logit_scale"]
        assert_close_verbose(infcl_style["logit_scale"], world * scale_truth, *FP32, f"world={world} W x dscale")
        assert abs(scale_truth) > 1e-3, "the scale gradient must be non-trivial for the comparison to mean anything"


# (scenario, world, what the survivors' error must name): rank 1 dies or hangs before the call or in step 1.
FAILURES = (
    ("die-before", 3, r"layout exchange before step 0"),
    ("die-forward", 2, r"forward step \d"),
    ("die-backward", 2, r"backward step \d"),
    ("hang-forward", 2, r"forward step \d"),
    ("hang-backward", 3, r"backward step \d"),
)


@pytest.mark.parametrize("scenario,world,step", FAILURES, ids=[f"{f[0]}-{f[1]}" for f in FAILURES])
def test_dead_or_hung_rank_raises_ring_error_on_the_others(tmp_path, scenario, world, step):
    survivors = [r for r in range(world) if r != FAILING_RANK]
    outcomes = launch(
        world,
        "workers.ring_worker",
        str(tmp_path),
        ["fail", scenario],
        pg_timeout_s=FAIL_PG_TIMEOUT_S,
        deadline_s=FAIL_DEADLINE_S,
        wait_for=survivors,
    )
    for r in survivors:
        o = outcomes[r]
        assert o.returncode == 0 and o.results is not None, (
            f"rank {r} did not report (a silent hang?)\n{describe(outcomes)}"
        )
        err = o.results["error"]
        assert err is not None and err[0] == "RingError", f"rank {r}: {err}\n{describe(outcomes)}"
        assert re.search(step, err[1]), f"rank {r}: error does not name the ring step: {err[1]}"
