"""examples/hf_trainer_clip.py: transformers' Trainer (on Accelerate, 2 gloo ranks) training a CLIPModel with
infcl's loss, plain and under GradCache, gives every parameter the gradient of transformers' own materialized
CLIP loss of the global batch (tests/workers/hf_trainer_worker.py). Needs transformers and accelerate."""

import tempfile

import pytest
import torch

from helpers.distributed import describe, launch
from helpers.support import TOLERANCE, assert_close_verbose

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORLD = 2
FP32 = TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def outcomes():
    with tempfile.TemporaryDirectory() as out_dir:
        outcomes = launch(WORLD, "workers.hf_trainer_worker", out_dir, pg_timeout_s=60.0, deadline_s=240.0)
    assert all(o.returncode == 0 and o.results is not None for o in outcomes), describe(outcomes)
    return outcomes


@pytest.mark.parametrize("run", ("plain", "gradcache-4"))
def test_trainer_gradients_are_the_global_batch_loss_gradients(outcomes, run):
    for outcome in outcomes:
        results = outcome.results
        assert results["world"] == WORLD
        want, got = results["reference"], results[run]
        assert set(got) == set(want), sorted(set(want) ^ set(got))
        assert float(want["clip.logit_scale"].abs()) > 1e-4, "trivial scale gradient"
        for name, grad in want.items():
            assert_close_verbose(got[name], grad, *FP32, f"rank {outcome.rank} {run} {name}")
