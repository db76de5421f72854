"""GradCache under DeepSpeed ZeRO: the two-tower model of gradcache_two_tower.py, one ZeRO step per batch.

    torchrun --nproc_per_node 2 examples/gradcache_deepspeed.py [--zero-stage 2] [--batch 512] [--chunk 64]
    PYTHONPATH=. /work/venvs/ds/bin/python -m torch.distributed.run --nproc_per_node 2 \
        examples/gradcache_deepspeed.py         # here: the DeepSpeed venv, this checkout's infcl

(in an environment with DeepSpeed; on CPUs DeepSpeed picks its CPU accelerator and this script gloo). Every rank
embeds its ``--batch`` pairs ``--chunk`` rows at a time; ``cal_inf_loss``'s ring gives every rank's rows the
whole global batch as negatives. :class:`infcl.gradcache.deepspeed.DeepSpeedGradCache` runs each step inside
``engine.coalesce_grad_reduction()`` and back-propagates each chunk through ``engine.backward``, so ZeRO
reduces (ZeRO-2: reduce-scatters) the gradients once per step, into its partitions, and ``engine.step()``
updates on the gradient of the global-batch loss. The temperature lives in the engine's module, so it is
reduced and stepped with the towers.
"""

import argparse
import math

import torch
import torch.distributed as dist
from gradcache_two_tower import (  # examples/ is sys.path[0]
    IMAGE_SIZE,
    LATENT_DIM,
    ClipObjective,
    ImageTower,
    TextTower,
    synthetic_pairs,
)
from torch import nn

from infcl.gradcache.deepspeed import DeepSpeedGradCache


class TwoTowerClip(nn.Module):
    """The towers and the CLIP objective (its learnable temperature) in one module, which DeepSpeed wraps."""

    def __init__(self):
        super().__init__()
        self.image, self.text, self.objective = ImageTower(), TextTower(), ClipObjective()
        # Shape [1], as open_clip's: DeepSpeed 0.19.8's initial broadcast views each parameter as bytes, which a
        # 0-d parameter refuses ("self.dim() cannot be 0 to view Float as Byte").
        self.objective.log_scale = nn.Parameter(self.objective.log_scale.detach().reshape(1))


def main():
    import deepspeed

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--batch", type=int, default=512, help="pairs per rank")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TwoTowerClip()
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,  # one cache_step is one step; the chunks are the accumulation
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,  # torch's AdamW (DeepSpeed's CPU Adam is a JIT-built op)
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gc = DeepSpeedGradCache(
        engine, [engine.module.image, engine.module.text], chunk_sizes=args.chunk, loss_fn=engine.module.objective
    )

    gen = torch.Generator().manual_seed(args.seed)
    # The same image map on every rank, as gradcache_two_tower.py draws it; then each rank's own pairs.
    image_map = torch.randn(LATENT_DIM, 3 * IMAGE_SIZE * IMAGE_SIZE, generator=gen) / math.sqrt(LATENT_DIM)
    gen.manual_seed(args.seed + 1 + rank)
    if rank == 0:
        print(f"ZeRO-{args.zero_stage}, {world} ranks x {args.batch} pairs, chunk {args.chunk}")
    for step in range(args.steps):
        images, tokens = synthetic_pairs(args.batch, image_map, gen)
        loss = gc.cache_step(images, tokens)  # this rank's share of the global-batch loss
        engine.step()
        dist.all_reduce(loss)
        if rank == 0:
            print(
                f"step {step}: global-batch loss {loss.item() / world:.4f} (log of the global batch: "
                f"{math.log(world * args.batch):.3f})"
            )


if __name__ == "__main__":
    main()
