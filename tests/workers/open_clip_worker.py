"""One rank of the open_clip ClipLoss drop-in test, started by tests/test_open_clip.py through helpers/distributed.py.

``python -m workers.open_clip_worker BACKEND...`` (3 processes) runs, on rings of 1 and 3 ranks, open_clip's real
``ClipLoss(local_loss=True, gather_with_grad=True, rank, world_size)`` (loaded by file) and
``InfCLIPLoss`` with every backend on the same shards, with and without ``logit_bias``, and writes each
loss and the gradients of image, text, logit_scale and logit_bias. Then open_clip's other
``(local_loss, gather_with_grad)`` settings (FLAGS) against ``InfCLIPLoss`` with the same flags on the
torch tiles, and whether ``local_loss=True, gather_with_grad=False`` raises. Last, every drop-in built with
no arguments against open_clip's built with none (``ClipLoss()``, ``SigLipLoss()``, ``DistillClipLoss()``: each
rank's local batch alone, whatever the process group holds).
"""

import sys

import torch
import torch.nn.functional as F

from helpers import open_clip_loss
from helpers.distributed import run_on_rings
from infcl import InfCLIPLoss, InfDistillClipLoss, InfSigLipLoss

MAIN_WORLD = 3
# open_clip gathers over the default group, so a ring of W must be global ranks 0..W-1.
RINGS = {1: (0,), 3: (0, 1, 2)}
PAIRS_PER_RANK = 24
DIM = 40
LOGIT_SCALE = 1 / 0.07  # open_clip's initial exp(logit_scale)
LOGIT_BIAS = -10.0  # SigLIP-initialised models carry such a bias
# open_clip's (local_loss, gather_with_grad) settings other than the default above; (False, False) is its own default.
FLAGS = ((False, True), (False, False))


def _shard(world: int, rank: int):
    """This rank's rows of a global batch of unit float32 features."""
    gen = torch.Generator().manual_seed(11 + world)
    n = world * PAIRS_PER_RANK
    image, text = (F.normalize(torch.randn(n, DIM, generator=gen), dim=-1) for _ in range(2))
    rows = slice(rank * PAIRS_PER_RANK, (rank + 1) * PAIRS_PER_RANK)
    return image[rows], text[rows]


def _step(loss_fn, world, rank, with_bias):
    image, text = (x.clone().requires_grad_() for x in _shard(world, rank))
    scale = torch.tensor(LOGIT_SCALE, requires_grad=True)
    leaves = {"image": image, "text": text, "scale": scale}
    kwargs = {}
    if with_bias:
        leaves["bias"] = kwargs["logit_bias"] = torch.tensor(LOGIT_BIAS, requires_grad=True)
    out = loss_fn(image, text, scale, output_dict=True, **kwargs)
    loss = out["contrastive_loss"]
    loss.backward()
    return {"loss": loss.detach(), "keys": sorted(out), **{k: v.grad.clone() for k, v in leaves.items()}}


def scenarios(rank, world, group, backends):
    module = open_clip_loss.load()
    if module is None:
        return None
    flags = {"local_loss": True, "gather_with_grad": True, "rank": rank, "world_size": world}
    losses = {"open_clip": module.ClipLoss(**flags)}
    for backend in backends:
        losses[backend] = InfCLIPLoss(**flags, group=group, backend=backend)
    results = {
        (name, with_bias): _step(loss_fn, world, rank, with_bias)
        for name, loss_fn in losses.items()
        for with_bias in (False, True)
    }
    for local_loss, gather_with_grad in FLAGS:
        flags = {"local_loss": local_loss, "gather_with_grad": gather_with_grad, "rank": rank, "world_size": world}
        theirs = module.ClipLoss(**flags)
        results[("open_clip", local_loss, gather_with_grad)] = _step(theirs, world, rank, False)
        ours = InfCLIPLoss(**flags, group=group, backend="torch")
        results[("torch", local_loss, gather_with_grad)] = _step(ours, world, rank, False)
    try:
        InfCLIPLoss(local_loss=True, gather_with_grad=False, rank=rank, world_size=world, group=group)(
            *_shard(world, rank), LOGIT_SCALE
        )
        results["local_without_gather"] = "no error"
    except ValueError as error:
        results["local_without_gather"] = str(error)
    for name, theirs, ours in (
        ("clip", module.ClipLoss(), InfCLIPLoss()),
        ("siglip", module.SigLipLoss(), InfSigLipLoss()),
        ("distill", module.DistillClipLoss(), InfDistillClipLoss()),
    ):
        results[("defaults", name)] = {
            "open_clip": _default_step(theirs, name, rank, torch.float64),  # upstream's formula, in float64
            "infcl": _default_step(ours, name, rank, torch.float32),
        }
    return results


def _default_step(loss_fn, name: str, rank: int, dtype: torch.dtype):
    """Loss (summed terms) and gradients of one drop-in built with no arguments, on this rank's own batch of a
    3-rank world (under the world group, never a subgroup: the defaults ignore the group), in ``dtype``."""
    image, text = (x.to(dtype).requires_grad_() for x in _shard(MAIN_WORLD, rank))
    scale = torch.tensor(LOGIT_SCALE, dtype=dtype, requires_grad=True)
    if name == "siglip":
        out = loss_fn(image, text, scale, torch.tensor(LOGIT_BIAS, dtype=dtype), output_dict=True)
    elif name == "distill":
        teacher = (x.flip(0).to(dtype) for x in _shard(MAIN_WORLD, rank))
        out = loss_fn(image, text, scale, *teacher, torch.tensor(LOGIT_SCALE / 2, dtype=dtype), output_dict=True)
    else:
        out = loss_fn(image, text, scale, output_dict=True)
    loss = sum(out.values())
    loss.backward()
    return {"loss": loss.detach(), "image": image.grad, "text": text.grad, "scale": scale.grad}


if __name__ == "__main__":
    backends = sys.argv[1:]
    run_on_rings(MAIN_WORLD, RINGS, lambda rank, world, group: scenarios(rank, world, group, backends))
