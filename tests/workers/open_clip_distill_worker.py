"""One rank of the open_clip DistillClipLoss flags test, started by tests/test_open_clip_distill_flags.py.

``python -m workers.open_clip_distill_worker`` (2 processes) runs open_clip's real ``DistillClipLoss`` (loaded by file)
and :class:`infcl.distill.InfDistillClipLoss` with each ``(local_loss, gather_with_grad)`` setting that
``infcl.open_clip_train`` passes on (FLAGS) on the same shards, and writes both losses and the gradients of the
student's image, text and logit_scale.
"""

import torch
import torch.nn.functional as F

from helpers import open_clip_loss
from helpers.distributed import run_on_rings
from infcl.distill import InfDistillClipLoss

WORLD = 2
RINGS = {2: (0, 1)}
PAIRS_PER_RANK = 10
DIM = 12
SCALES = (14.0, 9.0)  # student, teacher
# open_clip's (local_loss, gather_with_grad) settings; (False, False) is its default, (True, False) raises here.
FLAGS = ((True, True), (False, True), (False, False))


def _shard(rank: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    image, text = (F.normalize(torch.randn(WORLD * PAIRS_PER_RANK, DIM, generator=gen), dim=-1) for _ in range(2))
    rows = slice(rank * PAIRS_PER_RANK, (rank + 1) * PAIRS_PER_RANK)
    return image[rows], text[rows]


def _step(loss_fn, rank):
    image, text = (x.clone().requires_grad_() for x in _shard(rank, 5))
    scale = torch.tensor(SCALES[0], requires_grad=True)
    teacher_image, teacher_text = _shard(rank, 6)
    out = loss_fn(image, text, scale, teacher_image, teacher_text, torch.tensor(SCALES[1]), output_dict=True)
    sum(out.values()).backward()
    return {**{k: v.detach() for k, v in out.items()}, "image": image.grad, "text": text.grad, "scale": scale.grad}


def scenarios(rank, world, group):
    module = open_clip_loss.load()
    if module is None:
        return None
    results = {}
    for flags in FLAGS:
        kwargs = dict(local_loss=flags[0], gather_with_grad=flags[1], rank=rank, world_size=world)
        results[("open_clip",) + flags] = _step(module.DistillClipLoss(**kwargs), rank)
        results[("infcl",) + flags] = _step(InfDistillClipLoss(**kwargs, group=group), rank)
    return results


if __name__ == "__main__":
    run_on_rings(WORLD, RINGS, scenarios)
