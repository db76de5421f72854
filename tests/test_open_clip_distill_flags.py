"""InfDistillClipLoss against open_clip's DistillClipLoss for each (local_loss, gather_with_grad) setting that
``python -m infcl.open_clip_train --distill-model ...`` passes on, on 2 gloo ranks
(tests/workers/open_clip_distill_worker.py): per rank both losses and the feature gradients equal theirs; the
scale gradient's average over the ranks (what DDP applies) equals theirs."""

import pytest
import torch

from helpers.distributed import launch, results_by_ring
from helpers.support import TOLERANCE, assert_close_verbose, open_clip_loss_module
from workers.open_clip_distill_worker import FLAGS, RINGS, WORLD

FP32 = TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    open_clip_loss_module()  # skips without open_clip
    outcomes = launch(
        WORLD,
        "workers.open_clip_distill_worker",
        str(tmp_path_factory.mktemp("distill")),
        pg_timeout_s=60.0,
        deadline_s=170.0,
    )
    return results_by_ring(outcomes, RINGS)(WORLD)


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"local_loss={f[0]}-gather_with_grad={f[1]}")
def test_distill_flags_match_open_clip(ranks, flags):
    for rank, results in enumerate(ranks):
        want, got = results[("open_clip",) + flags], results[("infcl",) + flags]
        assert float(want["distill_loss"]) > 0 and float(want["image"].abs().max()) > 0
        for key in ("contrastive_loss", "distill_loss", "image", "text"):
            assert_close_verbose(got[key], want[key], *FP32, f"rank {rank} {key}")
    want, got = (torch.stack([r[(name,) + flags]["scale"] for r in ranks]).mean(0) for name in ("open_clip", "infcl"))
    assert_close_verbose(got, want, *FP32, "mean scale gradient")
