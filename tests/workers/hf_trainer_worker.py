"""One rank of tests/test_hf_trainer.py (started through tests/helpers/distributed.py): examples/hf_trainer_clip.py's
``InfCLTrainer`` for one step on the global batch, plain and under GradCache, and the reference.

Every rank builds the same tiny CLIPModel. The reference is transformers' own materialized CLIP loss
(``CLIPModel(..., return_loss=True)``) of the whole global batch in this one process; the Trainer runs on the
process group this rank joined (Accelerate takes it over), each rank holding its shard of the batch. What goes back
is every parameter's gradient as the optimizer would see it (after DDP's averaging), from a callback.
"""

import os
import sys

import torch
from transformers import CLIPModel, TrainerCallback

from helpers.distributed import REPO_ROOT, finish, init_worker

sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
from hf_trainer_clip import CLIPTowers, InfCLTrainer, RandomPairs, tiny_clip_config, training_arguments  # noqa: E402

PER_RANK = 6
# GradCache chunk size: one that does not divide the local batch (6 = 4 + 2).
CHUNKS = (4,)


class GradientsBeforeStep(TrainerCallback):
    """Keeps a copy of every parameter's gradient just before the optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def fresh_model() -> CLIPTowers:
    torch.manual_seed(0)
    return CLIPTowers(CLIPModel(tiny_clip_config()))


def reference(data: RandomPairs) -> dict:
    """transformers' CLIP loss (the B x B logits) of the whole batch and its gradients, one process."""
    model = fresh_model()
    out = model.clip(
        pixel_values=data.pixel_values, input_ids=data.input_ids, attention_mask=data.attention_mask, return_loss=True
    )
    out.loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def trainer_step(data: RandomPairs, out_dir: str, chunk) -> dict:
    capture = GradientsBeforeStep()
    args = training_arguments(out_dir, PER_RANK, 1, max_grad_norm=0.0, learning_rate=0.0, logging_steps=100)
    trainer = InfCLTrainer(
        model=fresh_model(),
        args=args,
        train_dataset=data,
        gradcache_chunk=chunk,
        infcl_backend="torch",
        callbacks=[capture],
    )
    trainer.train()
    return capture.grads


def main() -> None:
    rank, world = init_worker()
    # Accelerate (inside TrainingArguments / Trainer) reads the launcher's variables and uses the started group.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ["INFCL_TEST_PORT"],
    )
    data = RandomPairs(PER_RANK * world)
    out_dir = os.path.join(os.environ["INFCL_TEST_OUT"], f"trainer{rank}")
    results = {"world": world, "reference": reference(data), "plain": trainer_step(data, out_dir, None)}
    for chunk in CHUNKS:
        results[f"gradcache-{chunk}"] = trainer_step(data, out_dir, chunk)
    finish(results)


if __name__ == "__main__":
    main()
