"""InfCLIPLoss / InfSigLipLoss as drop-ins for open_clip's real ClipLoss / SigLipLoss call signatures.

The ring runs (1 and 3 gloo ranks, tests/workers/open_clip_worker.py) compare against open_clip's own
``ClipLoss(local_loss=True, gather_with_grad=True)``, loaded by file, with and without ``logit_bias``.
"""

import inspect

import pytest
import torch

from helpers.distributed import launch, results_by_ring
from helpers.support import TOLERANCE, assert_close_verbose, open_clip_loss_module, tiled_backends
from infcl import InfCLIPLoss, InfSigLipLoss
from workers.open_clip_worker import FLAGS, MAIN_WORLD, RINGS

BACKENDS = ("reference",) + tuple(tiled_backends())
FP32 = TOLERANCE[torch.float32]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    open_clip_loss_module()  # skips without open_clip
    outcomes = launch(
        MAIN_WORLD,
        "workers.open_clip_worker",
        str(tmp_path_factory.mktemp("open-clip")),
        list(BACKENDS),
        pg_timeout_s=60.0,
        deadline_s=170.0,
    )
    return results_by_ring(outcomes, RINGS)


@pytest.mark.parametrize("world", tuple(RINGS))
@pytest.mark.parametrize("with_bias", (False, True))
def test_clip_loss_matches_open_clip(spawned, world, with_bias):
    """Per rank: the loss and the image, text, logit_scale (and logit_bias) gradients equal ClipLoss's."""
    for rank, results in enumerate(spawned(world)):
        want = results[("open_clip", with_bias)]
        assert want["keys"] == ["contrastive_loss"]
        assert float(want["scale"].abs()) > 1e-4, "trivial scale gradient"
        for backend in BACKENDS:
            got = results[(backend, with_bias)]
            assert got["keys"] == want["keys"]
            for key in ("loss", "image", "text", "scale"):
                assert_close_verbose(got[key], want[key], *FP32, f"world={world} rank={rank} {backend} {key}")
            if with_bias:
                # The bias cancels in every softmax: exactly 0 here; open_clip's autograd sums P - Y to round-off.
                assert torch.equal(got["bias"], torch.zeros(())), f"{backend} dbias {got['bias']}"
                assert float(want["bias"].abs()) < 1e-5, f"open_clip's dbias {want['bias']}"


@pytest.mark.parametrize("name", ("clip", "siglip", "distill"))
def test_default_drop_ins_match_open_clips_defaults(spawned, name):
    """Built with no arguments, under an initialized 3-rank world: the drop-in's loss and every gradient equal
    open_clip's built with none (``world_size=1``: each rank's local batch alone), rank by rank. Before, the
    defaults ringed over the world and trained at another gradient scale than ``ClipLoss()``."""
    ranks = spawned(MAIN_WORLD)
    for rank, results in enumerate(ranks):
        want, got = (results[("defaults", name)][side] for side in ("open_clip", "infcl"))
        for key in ("loss", "image", "text", "scale"):  # ours in float32 against open_clip's formula in float64
            assert_close_verbose(got[key].double(), want[key], *FP32, f"{name} defaults rank={rank} {key}")
    # Each rank's own batch: the three ranks' losses differ (a ring's global loss would be one value).
    assert len({float(r[("defaults", name)]["open_clip"]["loss"]) for r in ranks}) == len(ranks)


@pytest.mark.parametrize("world", tuple(RINGS))
@pytest.mark.parametrize("local_loss, gather_with_grad", FLAGS)
def test_clip_loss_flags_match_open_clip(spawned, world, local_loss, gather_with_grad):
    """open_clip's other (local_loss, gather_with_grad) settings: per rank the loss and the feature gradients
    equal ClipLoss's; the scale gradient's average over ranks (what DDP applies) equals theirs."""
    ranks = spawned(world)
    for rank, results in enumerate(ranks):
        want, got = (results[(name, local_loss, gather_with_grad)] for name in ("open_clip", "torch"))
        for key in ("loss", "image", "text"):
            assert_close_verbose(got[key], want[key], *FP32, f"world={world} rank={rank} {key}")
    want, got = (
        torch.stack([r[(name, local_loss, gather_with_grad)]["scale"] for r in ranks]).mean(0)
        for name in ("open_clip", "torch")
    )
    assert_close_verbose(got, want, *FP32, f"world={world} mean scale gradient")


@pytest.mark.parametrize("world", tuple(RINGS))
def test_clip_local_loss_without_gather_raises_on_a_ring(spawned, world):
    for results in spawned(world):
        if world == 1:  # one rank: every setting is the same loss
            assert results["local_without_gather"] == "no error"
        else:
            assert "gather_with_grad=True" in results["local_without_gather"]


def test_clip_forward_accepts_open_clip_signature():
    """Every parameter of open_clip's ClipLoss.forward, by name and in order, so ``**model_out`` works."""
    theirs = list(inspect.signature(open_clip_loss_module().ClipLoss.forward).parameters)
    ours = list(inspect.signature(InfCLIPLoss.forward).parameters)
    assert ours[: len(theirs)] == theirs
    image, text = torch.randn(6, 8), torch.randn(6, 8)
    model_out = {
        "image_features": image,
        "text_features": text,
        "logit_scale": torch.tensor(10.0),
        "logit_bias": torch.tensor(-3.0),
    }
    loss = InfCLIPLoss()(**model_out)
    assert_close_verbose(loss, InfCLIPLoss()(image, text, torch.tensor(10.0)), 0.0, 0.0, "bias cancels")


@pytest.mark.parametrize("bias", (float("nan"), float("inf")))
def test_clip_non_finite_bias_gives_nan(bias):
    loss = InfCLIPLoss()(torch.randn(5, 4), torch.randn(5, 4), torch.tensor(3.0), torch.tensor(bias))
    assert torch.isnan(loss)


def test_clip_bad_bias_is_named():
    with pytest.raises(ValueError, match="logit_bias must be a scalar"):
        InfCLIPLoss()(torch.randn(5, 4), torch.randn(5, 4), torch.tensor(3.0), torch.zeros(5))
    with pytest.raises(TypeError, match="logit_bias must be a floating-point"):
        InfCLIPLoss()(torch.randn(5, 4), torch.randn(5, 4), torch.tensor(3.0), torch.tensor(1))


def test_siglip_constructor_accepts_open_clip_arguments_and_chunk_size():
    theirs = [p for p in inspect.signature(open_clip_loss_module().SigLipLoss.__init__).parameters if p != "self"]
    ours = inspect.signature(InfSigLipLoss.__init__).parameters
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    image, text = torch.randn(6, 8), torch.randn(6, 8)
    scale, bias = torch.tensor(10.0), torch.tensor(-5.0)
    plain = InfSigLipLoss()(image, text, scale, bias)
    for chunk in (None, 1, 4096):
        got = InfSigLipLoss(chunk_size=chunk)(image, text, scale, bias)
        assert_close_verbose(got, plain, 0.0, 0.0, f"chunk={chunk}")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="chunk_size must be None or a positive int"):
            InfSigLipLoss(chunk_size=bad)
