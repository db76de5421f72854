"""Train a tiny two-tower (CLIP-style) model with the ring loss over CPU processes (gloo).

    torchrun --nproc_per_node=4 examples/train_ring.py

Each rank draws its own local batch of synthetic (image, text) pairs: both views are noisy linear
images of a shared latent vector, so matching pairs can be learned. Every rank computes the CLIP loss of
its local pairs against the whole global batch with ``cal_inf_loss(..., symmetric=True)``: the k blocks
travel around the ring, no rank ever holds all features. DDP averages the gradients, which makes them
the gradients of the global-mean loss (see README, "Across ranks"). Rank 0 prints the global loss.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from infcl import cal_inf_loss

LATENT, IMAGE_IN, TEXT_IN, EMBED = 16, 32, 24, 16
NOISE = 0.3  # per-view noise on top of the shared latent: the task is learnable but not trivial
LOGIT_SCALE_INIT = 2.659  # log(1 / 0.07), CLIP's initial temperature
LOGIT_SCALE_MAX = 4.6052  # log(100): CLIP clamps the scale at 100
PG_TIMEOUT = timedelta(seconds=60)  # a dead or hung rank raises after this long instead of hanging


class TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.image = torch.nn.Sequential(torch.nn.Linear(IMAGE_IN, 64), torch.nn.GELU(), torch.nn.Linear(64, EMBED))
        self.text = torch.nn.Sequential(torch.nn.Linear(TEXT_IN, 64), torch.nn.GELU(), torch.nn.Linear(64, EMBED))
        self.logit_scale = torch.nn.Parameter(torch.tensor(LOGIT_SCALE_INIT))

    def forward(self, image, text):
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1), self.logit_scale.exp()


def synthetic_pairs(n: int, gen: torch.Generator, mix_image: torch.Tensor, mix_text: torch.Tensor):
    """``n`` matching (image, text) pairs: noisy linear views of one latent vector per pair."""
    z = torch.randn(n, LATENT, generator=gen)
    image = z @ mix_image + NOISE * torch.randn(n, IMAGE_IN, generator=gen)
    text = z @ mix_text + NOISE * torch.randn(n, TEXT_IN, generator=gen)
    return image, text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="pairs per rank (the global batch is world x this)")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)  # torchrun's env:// rendezvous on localhost
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model = DistributedDataParallel(TwoTower())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    shared = torch.Generator().manual_seed(1)  # the data distribution: the same on every rank
    mix_image, mix_text = (
        torch.randn(LATENT, IMAGE_IN, generator=shared),
        torch.randn(LATENT, TEXT_IN, generator=shared),
    )
    local = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own samples

    if rank == 0:
        print(
            f"{world} ranks x {args.batch} pairs = global batch {world * args.batch}; symmetric CLIP loss on the ring"
        )
    first = None
    for step in range(args.steps):
        image, text = synthetic_pairs(args.batch, local, mix_image, mix_text)
        img, txt, scale = model(image, text)
        loss = cal_inf_loss(img, txt, scale=scale, symmetric=True)  # this rank's rows vs the global batch
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages: the gradient of the global-mean loss
        optimizer.step()
        with torch.no_grad():
            model.module.logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world
        first = float(global_loss) if first is None else first
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {float(global_loss):.4f}  logit scale {float(scale.detach()):.2f}")
    if rank == 0:
        print(f"loss fell from {first:.4f} to {float(global_loss):.4f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
