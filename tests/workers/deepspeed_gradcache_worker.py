"""One rank of tests/test_gradcache_deepspeed.py: DeepSpeedGradCache steps under ZeRO 1, 2 and 3.

``python -m workers.deepspeed_gradcache_worker`` (2 processes, started by tests/helpers/distributed.py) runs,
for every scenario of ``SCENARIOS``, one DeepSpeed step of a tiny two-tower model (infcl's CLIP loss through the
ring, a learnable logit scale, the local batch in uneven chunks) and writes what the parent compares with the
materialized float64 loss of the global batch: the loss, every parameter's full gradient before
``engine.step()``, every parameter after it, and the calls of DeepSpeed's reducing collectives during the
GradCache step.
"""

import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from helpers.distributed import finish, init_worker
from infcl import cal_inf_loss

IMAGE_DIM, TEXT_DIM, HIDDEN, EMBED = 12, 10, 16, 8
LOCAL_ROWS, CHUNK = 5, 2  # chunks of 2, 2 and 1 rows per rank
LR = 0.5
MODEL_SEED, DATA_SEED = 0, 1
# (name, ZeRO stage, which modules GradCache calls: the engine routing by keyword or the engine's towers, chunk)
SCENARIOS = (
    ("zero1-engine", 1, "engine", CHUNK),
    ("zero2-engine", 2, "engine", CHUNK),
    ("zero2-engine-one-chunk", 2, "engine", LOCAL_ROWS),  # the reductions of a step without chunks
    ("zero2-towers", 2, "towers", CHUNK),
    ("zero3-engine", 3, "engine", CHUNK),
)
# deepspeed.comm's reducing collectives, counted during cache_step (the ring's own traffic is torch.distributed's).
REDUCING_OPS = (
    "all_reduce",
    "all_reduce_coalesced",
    "inference_all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
)


class Normalize(nn.Module):
    def forward(self, x):
        return F.normalize(x, dim=-1)


class TwoTower(nn.Module):
    """Image and text MLP towers (normalized embeddings out) and a learnable logit scale;
    ``forward(images=...)`` or ``forward(texts=...)`` runs that tower."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(IMAGE_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, EMBED), Normalize())
        self.text = nn.Sequential(nn.Linear(TEXT_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, EMBED), Normalize())
        # Shape [1] as open_clip's: DeepSpeed 0.19.8's initial broadcast views each parameter as bytes, which a
        # 0-d parameter refuses ("self.dim() cannot be 0 to view Float as Byte").
        self.logit_scale = nn.Parameter(torch.full((1,), 2.0))

    def forward(self, images=None, texts=None):
        tower, x = (self.image, images) if images is not None else (self.text, texts)
        return tower(x)


def make_model() -> TwoTower:
    torch.manual_seed(MODEL_SEED)
    return TwoTower()


def global_batch(world: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(DATA_SEED)
    images = torch.randn(world * LOCAL_ROWS, IMAGE_DIM, generator=gen, dtype=torch.float64)
    texts = torch.randn(world * LOCAL_ROWS, TEXT_DIM, generator=gen, dtype=torch.float64)
    return images.to(dtype), texts.to(dtype)


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": LOCAL_ROWS,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # plain torch SGD: the update is w - LR * grad, easy to check
        "gradient_clipping": 0.0,  # DeepSpeed's default, 1.0, would rescale that update by 1 / |grad|
        "steps_per_print": 10**9,
    }


def full_params(engine, stage: int) -> dict:
    import deepspeed

    params = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


@contextmanager
def counting_reductions(counts: dict):
    """Count the calls of every deepspeed.comm reducing collective (``REDUCING_OPS``) inside the block."""
    import deepspeed.comm as ds_comm

    saved = {name: getattr(ds_comm, name) for name in REDUCING_OPS}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(ds_comm, name, counted(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(ds_comm, name, fn)


def run(stage: int, models_kind: str, chunk: int, rank: int, world: int) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from infcl.gradcache.deepspeed import DeepSpeedGradCache

    model = make_model()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=ds_config(stage)
    )

    def clip_loss(image_emb, text_emb):
        return cal_inf_loss(image_emb, text_emb, scale=engine.module.logit_scale.exp(), symmetric=True)

    images, texts = global_batch(world)
    rows = slice(rank * LOCAL_ROWS, (rank + 1) * LOCAL_ROWS)
    if models_kind == "engine":
        models, inputs = [engine, engine], ({"images": images[rows]}, {"texts": texts[rows]})
    else:
        models, inputs = [engine.module.image, engine.module.text], (images[rows], texts[rows])
    before = full_params(engine, stage)
    gc = DeepSpeedGradCache(engine, models, chunk_sizes=chunk, loss_fn=clip_loss)
    reductions = {}
    with counting_reductions(reductions):
        loss = gc.cache_step(*inputs)
    grads = {}
    for name, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        grads[name] = None if g is None else g.detach().clone()
    engine.step()
    return {
        "loss": loss,
        "before": before,
        "grads": grads,
        "after": full_params(engine, stage),
        "reductions": reductions,
    }


def main():
    rank, world = init_worker()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for name, stage, models_kind, chunk in SCENARIOS:
        try:
            results[name] = run(stage, models_kind, chunk, rank, world)
        except Exception as exc:  # the parent reports every scenario's outcome
            import traceback

            results[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    finish(results)


if __name__ == "__main__":
    main()
