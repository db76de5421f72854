"""``python -m infcl.open_clip_train``: the loss it builds from open_clip_train's arguments.

The parts that need no torchvision run everywhere: which loss each argument set gives, that it computes
open_clip's own loss for those arguments (open_clip's loss module loaded by file), that every argument
open_clip's ``create_loss`` reads is read, and that importing the switch imports no open_clip.

The whole trainer (examples/open_clip_train_check.py: open_clip_train.main with open_clip's loss and with the
switch, 1 and 2 gloo ranks, the logged losses and the final weights compared) needs open_clip_train and
torchvision: it runs when ``INFCL_OPEN_CLIP_PYTHON`` names an interpreter that has them (about 2 minutes per
setting on 2 cores), and is skipped otherwise.
"""

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers.distributed import REPO_ROOT
from helpers.support import TOLERANCE, assert_close_verbose, open_clip_loss_module
from infcl import InfCLIPLoss, InfSigLipLoss
from infcl.distill import InfDistillClipLoss
from infcl.open_clip_train import InfCoCaLoss, infcl_loss

FP32 = TOLERANCE[torch.float32]
OPEN_CLIP_PYTHON = os.environ.get("INFCL_OPEN_CLIP_PYTHON")


def trainer_args(**overrides) -> argparse.Namespace:
    """open_clip_train's parsed arguments that create_loss reads, at open_clip's defaults, after init_distributed."""
    args = dict(
        distill=False,
        model="ViT-B-32",
        coca_caption_loss_weight=2.0,
        coca_contrastive_loss_weight=1.0,
        siglip=False,
        loss_dist_impl=None,
        local_loss=False,
        gather_with_grad=False,
        rank=0,
        world_size=1,
        horovod=False,
    )
    args.update(overrides)
    return argparse.Namespace(**args)


def features(n=12, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [F.normalize(torch.randn(n, d, generator=gen), dim=-1).requires_grad_() for _ in range(2)]


def loss_and_grads(loss_fn, *extra, **kwargs):
    image, text = features()
    scale = torch.tensor(14.0, requires_grad=True)
    losses = loss_fn(image, text, *extra, logit_scale=scale, output_dict=True, **kwargs)
    total = sum(losses.values())
    total.backward()
    return [total.detach(), image.grad, text.grad, scale.grad]


@pytest.mark.parametrize("local_loss", (False, True))
@pytest.mark.parametrize("gather_with_grad", (False, True))
def test_clip_arguments_give_open_clip_loss(local_loss, gather_with_grad):
    args = trainer_args(local_loss=local_loss, gather_with_grad=gather_with_grad)
    ours = infcl_loss(args)
    assert type(ours) is InfCLIPLoss
    assert (ours.local_loss, ours.gather_with_grad) == (local_loss, gather_with_grad)
    theirs = open_clip_loss_module().ClipLoss(
        local_loss=local_loss, gather_with_grad=gather_with_grad, cache_labels=True, rank=0, world_size=1
    )
    for name, got, want in zip(("loss", "image", "text", "scale"), loss_and_grads(ours), loss_and_grads(theirs)):
        assert_close_verbose(got, want, *FP32, name)


@pytest.mark.parametrize("dist_impl", (None, "gather"))
def test_siglip_arguments_give_open_clip_loss(dist_impl):
    ours = infcl_loss(trainer_args(siglip=True, loss_dist_impl=dist_impl))
    assert type(ours) is InfSigLipLoss
    theirs = open_clip_loss_module().SigLipLoss(rank=0, world_size=1, dist_impl=dist_impl)
    bias = torch.tensor(-3.0)
    for name, got, want in zip(
        ("loss", "image", "text", "scale"),
        loss_and_grads(ours, logit_bias=bias),
        loss_and_grads(theirs, logit_bias=bias),
    ):
        assert_close_verbose(got, want, *FP32, name)
    with pytest.raises(ValueError, match="dist_impl"):
        infcl_loss(trainer_args(siglip=True, loss_dist_impl="ring"))


def test_coca_arguments_give_open_clip_loss():
    args = trainer_args(model="coca_ViT-B-32", coca_caption_loss_weight=1.5, coca_contrastive_loss_weight=0.5)
    ours = infcl_loss(args)
    assert type(ours) is InfCoCaLoss
    theirs = open_clip_loss_module().CoCaLoss(caption_loss_weight=1.5, clip_loss_weight=0.5, cache_labels=True)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 7, 30, generator=gen)
    labels = torch.randint(0, 30, (12, 7), generator=gen)
    labels[:, -2:] = 0  # padding, ignored
    results = []
    for loss_fn in (ours, theirs):
        caption_logits = logits.clone().requires_grad_()
        results.append(loss_and_grads(loss_fn, logits=caption_logits, labels=labels) + [caption_logits.grad])
        parts = loss_fn(*features(), caption_logits, labels, torch.tensor(14.0), output_dict=True)
        results[-1].append(sorted(parts))
    assert results[0][-1] == results[1][-1] == ["caption_loss", "contrastive_loss"]
    for name, got, want in zip(("loss", "image", "text", "scale", "logits"), results[0][:-1], results[1][:-1]):
        assert_close_verbose(got, want, *FP32, name)


@pytest.mark.parametrize("local_loss", (False, True))
def test_distill_arguments_give_open_clip_loss(local_loss):
    args = trainer_args(distill=True, local_loss=local_loss, gather_with_grad=local_loss)
    ours = infcl_loss(args)
    assert type(ours) is InfDistillClipLoss
    assert (ours.local_loss, ours.gather_with_grad) == (local_loss, local_loss)
    theirs = open_clip_loss_module().DistillClipLoss(
        local_loss=local_loss, gather_with_grad=local_loss, cache_labels=True, rank=0, world_size=1
    )
    image, text = (x.detach() for x in features(seed=1))
    teacher = dict(dist_image_features=image, dist_text_features=text, dist_logit_scale=torch.tensor(9.0))
    results = [loss_and_grads(fn, **teacher) for fn in (ours, theirs)]
    for name, got, want in zip(("loss", "image", "text", "scale"), *results):
        assert_close_verbose(got, want, *FP32, name)


def test_horovod_raises():
    for args in (trainer_args(horovod=True), trainer_args(horovod=True, distill=True)):
        with pytest.raises(ValueError, match="--horovod"):
            infcl_loss(args)


def test_reads_every_argument_open_clip_create_loss_reads():
    """open_clip's create_loss source (read as text: importing open_clip needs torchvision) against ours."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None:
        pytest.skip("open_clip is not installed")
    with open(os.path.join(spec.submodule_search_locations[0], "factory.py")) as f:
        source = f.read()
    create_loss = re.search(r"\ndef create_loss\(args\):\n(.*?)\n(?=\S)", source, re.S).group(1)
    theirs = set(re.findall(r"args\.(\w+)", create_loss))
    ours = set(re.findall(r"args\.(\w+)", inspect.getsource(infcl_loss)))
    assert theirs and theirs <= ours, sorted(theirs - ours)
    assert set(vars(trainer_args())) == theirs | {"horovod"}


def test_import_leaves_open_clip_alone():
    code = "import sys, infcl, infcl.open_clip_train; print(sorted(m for m in sys.modules if 'open_clip' in m))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['infcl.open_clip_train']"


@pytest.mark.skipif(not OPEN_CLIP_PYTHON, reason="INFCL_OPEN_CLIP_PYTHON (an interpreter with open_clip_train) unset")
@pytest.mark.parametrize("flags", ([], ["--local-loss", "--gather-with-grad"], ["--siglip"]), ids=" ".join)
def test_open_clip_trainer_matches_its_own_loss(flags):
    script = os.path.join(REPO_ROOT, "examples", "open_clip_train_check.py")
    done = subprocess.run([OPEN_CLIP_PYTHON, script, *flags], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
