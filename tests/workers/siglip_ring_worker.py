"""One rank of the sigmoid-loss ring tests, started by tests/test_siglip_ring.py through tests/helpers/distributed.py.

``python -m workers.siglip_ring_worker BACKEND...`` (4 processes) runs, on rings of 2, 3 and 4 ranks, every
sigmoid ring case (tests/helpers/ring_cases.py) with every backend, open_clip's ``SigLipLoss(rank, world_size)``
(loaded by file; dist_impl "bidir" and "shift") against ``InfSigLipLoss`` on the same features, one
DDP step, and a call whose last rank has bad labels; all results go in one file per rank. The rings are
the first W ranks: open_clip's exchanges name global ranks in the default group, so its ring of W must
be ranks 0..W-1.
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from helpers import open_clip_loss, ring_cases
from helpers.distributed import run_on_rings
from infcl import InfSigLipLoss, cal_siglip_loss
from workers.ring_worker import TINY_SUFFIX, run_cases

MAIN_WORLD = 4
RINGS = {2: (0, 1), 3: (0, 1, 2), 4: (0, 1, 2, 3)}
OPEN_CLIP_IMPLS = ("bidir", "shift")


def _grads(loss, leaves, upstream=None) -> dict:
    """The loss and every leaf's gradient after ``loss.backward(upstream)``."""
    loss.backward(upstream)
    return {"loss": loss.detach(), **{name: leaf.grad.clone() for name, leaf in leaves.items()}}


def _run_case(case, backend, rank, group):
    q_leaf, k_leaf, q, k, labels, upstream = ring_cases.local_inputs(case, rank)
    scale = torch.tensor(ring_cases.SCALE, dtype=case.dtype, requires_grad=True)
    bias = torch.tensor(ring_cases.BIAS, dtype=case.dtype, requires_grad=True)
    loss = cal_siglip_loss(q, k, scale, bias, labels, reduction=case.reduction, group=group, backend=backend)
    out = _grads(loss, {"dq": q_leaf, "dk": k_leaf, "dscale": scale, "dbias": bias}, upstream.to(loss.dtype))
    if case.noncontig:
        out["dq"], out["dk"] = out["dq"].T, out["dk"].T
    return {**out, "loss_dtype": loss.dtype}


def _features(world: int, rank: int):
    """This rank's shard (PAIRS_PER_RANK rows) of a global batch of unit float32 features, D = DIM."""
    gen = torch.Generator().manual_seed(7 + world)
    n = world * ring_cases.PAIRS_PER_RANK
    image, text = (F.normalize(torch.randn(n, ring_cases.DIM, generator=gen), dim=-1) for _ in range(2))
    return image[ring_cases.rank_slice(rank)], text[ring_cases.rank_slice(rank)]


def run_open_clip(rank, world, group, backends):
    """open_clip's SigLipLoss and InfSigLipLoss on the same shards: loss and the four gradients, per loss."""
    module = open_clip_loss.load()
    if module is None:
        return None
    losses = {
        f"open_clip-{impl}": module.SigLipLoss(rank=rank, world_size=world, dist_impl=impl) for impl in OPEN_CLIP_IMPLS
    }
    for backend in backends:
        losses[f"infcl-{backend}"] = InfSigLipLoss(rank=rank, world_size=world, group=group, backend=backend)
    out = {}
    for name, loss_fn in losses.items():
        image, text = (x.clone().requires_grad_() for x in _features(world, rank))
        scale = torch.tensor(ring_cases.SCALE, requires_grad=True)
        bias = torch.tensor(ring_cases.BIAS, requires_grad=True)
        out[name] = _grads(
            loss_fn(image, text, scale, bias), {"image": image, "text": text, "scale": scale, "bias": bias}
        )
    return out


def run_ddp(rank, world, group):
    """One DDP backward of the ring sigmoid loss: the averaged parameter gradients."""
    x_img, x_txt = (x[ring_cases.rank_slice(rank)] for x in ring_cases.tower_data(world))
    ddp = DistributedDataParallel(ring_cases.SigLipTwoTower(), process_group=group)
    cal_siglip_loss(*ddp(x_img, x_txt), group=group, backend="torch").backward()
    return {name: p.grad.clone() for name, p in ddp.module.named_parameters()}


def run_bad_labels(rank, world, group):
    """Only the last rank's labels point past the global batch: every rank must raise at once."""
    image, text = torch.randn(3, ring_cases.DIM), torch.randn(3, ring_cases.DIM)
    labels = torch.tensor([0, 1, 3 * world]) if rank == world - 1 else torch.tensor([0, 1, 2])
    try:
        cal_siglip_loss(image, text, 10.0, -10.0, labels, group=group, backend="torch")
    except Exception as err:  # the test checks the type and message
        return (type(err).__name__, str(err))
    return None


def main(backends):
    plain = [b for b in backends if not b.endswith(TINY_SUFFIX) and b != "reference"]

    def scenarios(rank, size, group):
        return {
            "cases": run_cases(rank, size, group, backends, cases=ring_cases.sigmoid_cases, run=_run_case),
            "open_clip": run_open_clip(rank, size, group, plain),
            "ddp": run_ddp(rank, size, group),
            "bad_labels": run_bad_labels(rank, size, group),
        }

    run_on_rings(MAIN_WORLD, RINGS, scenarios)


if __name__ == "__main__":
    main(sys.argv[1:])
