"""The sigmoid loss on the ring: 2, 3 and 4 CPU processes (gloo) against one float64 process and open_clip.

One spawn of 4 processes (tests/workers/siglip_ring_worker.py) runs everything on rings of 2, 3 and 4 ranks and
writes all results; the tests below only read them.

Convention checked (as cal_inf_loss's, see docs/ring.md): rank r returns the loss L_r of its rows
against every rank's text; image_r.grad and text_r.grad are d(sum_s L_s)/d(rank r's copy); scale.grad and
bias.grad on rank r are dL_r/dscale and dL_r/dbias, which summed over ranks are the full derivatives --
exactly open_clip's SigLipLoss(rank, world_size), so DDP's averaging gives the global-mean gradient.
"""

import functools

import pytest
import torch

from helpers import ring_cases
from helpers.distributed import launch, results_by_ring
from helpers.support import TOLERANCE, assert_close_verbose, interpreting_triton, siglip_magnitudes, tiled_backends
from infcl.backends import unavailable_reason
from workers.ring_worker import TINY_SUFFIX
from workers.siglip_ring_worker import MAIN_WORLD, OPEN_CLIP_IMPLS, RINGS

WORLDS = tuple(RINGS)
# Under the interpreter the Triton kernels run on CPU tensors; the ring's blocks are tiny, so they are cheap.
TRITON = ("triton",) if interpreting_triton() and unavailable_reason("triton", torch.device("cpu")) is None else ()
BACKENDS = ("reference", "torch", "torch" + TINY_SUFFIX) + tuple(b for b in tiled_backends() if b != "torch") + TRITON
CASE_NAMES = tuple(c.name for c in ring_cases.sigmoid_cases(2))
GRADS = ("dq", "dk", "dparams")
FP32 = TOLERANCE[torch.float32]
# Generous bounds on a healthy run, only there so that a hang fails instead of blocking the suite.
PG_TIMEOUT_S = 60.0
DEADLINE_S = 170.0


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """``spawned(world)`` -> the results of the ring of ``world`` ranks, one dict per group rank."""
    outcomes = launch(
        MAIN_WORLD,
        "workers.siglip_ring_worker",
        str(tmp_path_factory.mktemp("siglip-ring")),
        list(BACKENDS),
        pg_timeout_s=PG_TIMEOUT_S,
        deadline_s=DEADLINE_S,
    )
    return results_by_ring(outcomes, RINGS)


@functools.lru_cache(maxsize=None)
def _magnitudes(case):
    """Per rank, the float64 sum of |terms| of (loss, dq, dk, dparams) (see support.siglip_magnitudes):
    rank r's rows give its loss, dq and dparams; every rank's rows add to each text row's dk."""
    g = ring_cases.global_inputs(case)
    parts = []
    for r, (qo, nq) in enumerate(zip(case.q_offsets, case.q_sizes)):
        rows = slice(qo, qo + nq)
        parts.append(
            siglip_magnitudes(
                g.q[rows], g.k, ring_cases.SCALE, ring_cases.BIAS, g.labels[rows], case.reduction, g.upstream[r]
            )
        )
    dk = sum(p[2] for p in parts)
    return [
        {"loss": p[0], "dq": p[1], "dk": dk[ko : ko + nk], "dparams": torch.stack(p[3:])}
        for p, ko, nk in zip(parts, case.k_offsets, case.k_sizes)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_ring_matches_single_process(spawned, world, name, backend):
    case = next(c for c in ring_cases.sigmoid_cases(world) if c.name == name)
    truth = ring_cases.sigmoid_truth(case)
    atol, rtol = TOLERANCE[case.dtype]
    ranks = spawned(world)
    for r, (results, sizes) in enumerate(zip(ranks, _magnitudes(case))):
        got = results["cases"][(name, backend)]
        got["dparams"] = torch.stack((got["dscale"], got["dbias"]))
        what = f"{name} {backend} world={world} rank={r}"
        assert got["loss_dtype"] == case.dtype, f"{what}: loss dtype {got['loss_dtype']}"
        want = {"loss": truth.loss[r], "dq": truth.dq[r], "dk": truth.dk[r], "dparams": truth.dparams[r]}
        for key in ("loss",) + GRADS:
            assert_close_verbose(got[key], want[key], atol, rtol, f"{what} {key}", magnitude=sizes[key])
    # Summed over ranks, the per-replica parameter gradients are the full derivative of sum_s L_s.
    total = sum(res["cases"][(name, backend)]["dparams"].double() for res in ranks)
    size = sum(s["dparams"] for s in _magnitudes(case))
    assert_close_verbose(
        total, truth.dparams_full, atol, rtol, f"{name} {backend} world={world} sum of dparams", magnitude=size
    )


@pytest.mark.parametrize("world", WORLDS)
def test_equals_open_clip_siglip_loss(spawned, world):
    """Per rank: loss and the gradients of image, text, scale and bias equal open_clip's
    SigLipLoss(rank, world_size)."""
    for r, results in enumerate(spawned(world)):
        runs = results["open_clip"]
        if runs is None:
            pytest.skip("open_clip is not installed")
        reference = runs[f"open_clip-{OPEN_CLIP_IMPLS[0]}"]
        assert abs(float(reference["bias"])) > 1e-3 and abs(float(reference["scale"])) > 1e-3, "trivial gradients"
        for name, run in runs.items():
            for key, value in run.items():
                assert_close_verbose(value, reference[key], *FP32, f"world={world} rank={r} {name} {key}")


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_averaging_gives_global_mean_gradient(spawned, world):
    truth = ring_cases.siglip_mean_loss_grads(world)
    for r, results in enumerate(spawned(world)):
        for key, expected in truth.items():
            assert_close_verbose(results["ddp"][key], expected, *FP32, f"DDP world={world} rank={r} {key}")


@pytest.mark.parametrize("world", WORLDS)
def test_one_rank_bad_labels_raise_on_every_rank(spawned, world):
    for r, results in enumerate(spawned(world)):
        err = results["bad_labels"]
        assert err is not None and err[0] == "ValueError", f"rank {r}: {err}"
        assert "labels must be column indices" in err[1] and f"on rank {world - 1}" in err[1], err[1]
