"""One rank of the distillation ring tests, started by tests/test_distill.py through tests/helpers/distributed.py.

``python -m workers.distill_ring_worker`` (3 processes): on rings of 1 and 3 ranks, open_clip's own
``DistillClipLoss(local_loss=True, gather_with_grad=True, rank, world_size)`` (loaded by file) and
``InfDistillClipLoss`` on the same shards, writing both losses and the student's gradients; on the ring
of 3, ``cal_distill_loss`` with uneven shards (one direction, per-row losses) beside one process's result.
"""

import torch
import torch.nn.functional as F

from helpers import open_clip_loss
from helpers.distributed import run_on_rings
from infcl.distill import InfDistillClipLoss, cal_distill_loss

MAIN_WORLD = 3
RINGS = {1: (0,), 3: (0, 1, 2)}  # open_clip gathers over the default group: a ring of W is ranks 0..W-1
PAIRS_PER_RANK = 16
DIM, TEACHER_DIM = 24, 32
LOGIT_SCALE, TEACHER_SCALE = 1 / 0.07, 60.0
Q_SIZES, K_SIZES = (5, 9, 7), (8, 6, 11)  # the uneven ring case


def _unit(n, dim, gen):
    return F.normalize(torch.randn(n, dim, generator=gen), dim=-1)


def _shard(world, rank):
    gen = torch.Generator().manual_seed(5 + world)
    n = world * PAIRS_PER_RANK
    image, text, t_image, t_text = (
        _unit(n, DIM, gen),
        _unit(n, DIM, gen),
        _unit(n, TEACHER_DIM, gen),
        _unit(n, TEACHER_DIM, gen),
    )
    rows = slice(rank * PAIRS_PER_RANK, (rank + 1) * PAIRS_PER_RANK)
    return image[rows], text[rows], t_image[rows], t_text[rows]


def _step(loss_fn, world, rank):
    image, text, t_image, t_text = _shard(world, rank)
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    t_image = t_image.clone().requires_grad_()  # the teacher gets no gradient from InfDistillClipLoss
    scale = torch.tensor(LOGIT_SCALE, requires_grad=True)
    out = loss_fn(image, text, scale, t_image, t_text, torch.tensor(TEACHER_SCALE), output_dict=True)
    (out["contrastive_loss"] + out["distill_loss"]).backward()
    return {
        "keys": sorted(out),
        **{key: value.detach() for key, value in out.items()},
        "image": image.grad,
        "text": text.grad,
        "scale": scale.grad,
        "teacher_grad": t_image.grad,
    }


def uneven_inputs():
    """The uneven ring case's global inputs (float64): q, k, teacher q, teacher k, per-row upstream gradient."""
    gen = torch.Generator().manual_seed(9)
    n, m = sum(Q_SIZES), sum(K_SIZES)
    shapes = ((n, DIM), (m, DIM), (n, 7), (m, 7), (n,))
    return tuple(torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes)


def run_uneven(q, k, tq, tk, upstream, group=None):
    """(per-row losses, dq, dk, dscale) of the one-directional loss with per-row upstream gradients."""
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    scale = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
    loss = cal_distill_loss(q, k, tq, tk, scale, 6.0, symmetric=False, reduction="none", group=group)
    loss.backward(upstream)
    return {"loss": loss.detach(), "dq": q.grad, "dk": k.grad, "dscale": scale.grad}


def _uneven(rank, group):
    q, k, tq, tk, upstream = uneven_inputs()
    qs = slice(sum(Q_SIZES[:rank]), sum(Q_SIZES[: rank + 1]))
    ks = slice(sum(K_SIZES[:rank]), sum(K_SIZES[: rank + 1]))
    return run_uneven(q[qs], k[ks], tq[qs], tk[ks], upstream[qs], group)


def scenarios(rank, world, group):
    module = open_clip_loss.load()
    flags = {"local_loss": True, "gather_with_grad": True, "rank": rank, "world_size": world}
    theirs, ours = module.DistillClipLoss(**flags), InfDistillClipLoss(**flags, group=group)
    out = {"open_clip": _step(theirs, world, rank), "infcl": _step(ours, world, rank)}
    if world == 3:
        out["ring"] = _uneven(rank, group)
    return out


if __name__ == "__main__":
    run_on_rings(MAIN_WORLD, RINGS, scenarios)
