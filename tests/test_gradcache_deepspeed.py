"""DeepSpeedGradCache (infcl/gradcache/deepspeed.py): GradCache steps as DeepSpeed ZeRO steps.

The first tests need no DeepSpeed (CI has none): a stand-in engine records what the adapter asks of it, and
its argument checks. The last two need DeepSpeed and are skipped without it; run them in the DeepSpeed venv
(docs/integrations.md, DeepSpeed section)::

    /work/venvs/ds/bin/python -m pytest tests/test_gradcache_deepspeed.py -q

One spawn of 2 gloo ranks (tests/workers/deepspeed_gradcache_worker.py, DeepSpeed's CPU accelerator) runs one
DeepSpeed step per scenario (ZeRO 1, 2, 3; GradCache calling the engine or its towers; ZeRO-2 without chunks,
for the count of reductions): a tiny two-tower model, infcl's CLIP loss through the ring (every rank sees the
global batch of 10 rows), a learnable logit scale, 5 rows per rank in chunks of 2, 2 and 1. Every parameter's
reduced gradient and its value after the SGD step must equal those of the materialized CLIP loss of the global
batch, computed here in float64, and the chunked ZeRO-2 step must call DeepSpeed's reducing collectives as
often as the step without chunks.
"""

import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.distributed import describe, launch
from infcl import cal_inf_loss
from infcl.gradcache.deepspeed import DeepSpeedGradCache
from workers import deepspeed_gradcache_worker as worker

WORLD = 2
# fp32 round-off of the ranks' float32 forward, ring loss and reduction against the float64 truth.
RTOL, ATOL = 1e-5, 1e-6


class StandInEngine:
    """The part of a DeepSpeedEngine the adapter uses; records backward calls and coalesce blocks."""

    def __init__(self, module: nn.Module, gas: int = 1):
        self.module, self.gas = module, gas
        self.events = []

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def gradient_accumulation_steps(self):
        return self.gas

    def backward(self, loss, scale_wrt_gas=True):
        self.events.append(("backward", scale_wrt_gas))
        loss.backward()

    @contextmanager
    def coalesce_grad_reduction(self):
        self.events.append("enter")
        yield
        self.events.append("exit")


def clip_loss(module):
    return lambda i, t: cal_inf_loss(i, t, scale=module.logit_scale.exp(), symmetric=True)


def test_chunk_backwards_go_through_engine_backward_inside_one_coalesce_block():
    module = worker.make_model()
    engine = StandInEngine(module)
    images, texts = worker.global_batch(1)
    gc = DeepSpeedGradCache(engine, [module.image, module.text], chunk_sizes=2, loss_fn=clip_loss(module))
    loss = gc.cache_step(images[:5], texts[:5])
    # 3 chunks per tower, none scaled by the accumulation steps, all inside one block.
    assert engine.events == ["enter"] + [("backward", False)] * 6 + ["exit"]
    plain = worker.make_model()
    truth = clip_loss(plain)(plain.image(images[:5]), plain.text(texts[:5]))
    truth.backward()
    torch.testing.assert_close(loss, truth.detach())
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, where=name: f"{where}: {m}")


def test_argument_errors_name_the_argument():
    module = worker.make_model()
    loss_fn = clip_loss(module)
    with pytest.raises(ValueError, match="gradient_accumulation_steps 1"):
        DeepSpeedGradCache(StandInEngine(module, gas=2), [module.image, module.text], 2, loss_fn)
    with pytest.raises(ValueError, match=r"models\[1\] is Linear"):
        DeepSpeedGradCache(StandInEngine(module), [module.image, nn.Linear(2, 2)], 2, loss_fn)
    with pytest.raises(TypeError, match="bf16"):  # mixed precision is DeepSpeed's config
        DeepSpeedGradCache(StandInEngine(module), [module.image, module.text], 2, loss_fn, bf16=True)
    with pytest.raises(TypeError, match="engine must be a DeepSpeedEngine"):
        DeepSpeedGradCache(module, [module.image, module.text], 2, loss_fn)
    no_coalesce = type("OldEngine", (), {"module": module, "backward": StandInEngine.backward})()
    with pytest.raises(TypeError, match="coalesce_grad_reduction"):
        DeepSpeedGradCache(no_coalesce, [module.image, module.text], 2, loss_fn)
    gc = DeepSpeedGradCache(StandInEngine(module), [module.image, module.text], 2, loss_fn)
    with pytest.raises(ValueError, match="no_sync_except_last"):
        gc.cache_step(torch.randn(4, worker.IMAGE_DIM), torch.randn(4, worker.TEXT_DIM), no_sync_except_last=True)


def test_import_infcl_does_not_import_deepspeed():
    code = "import sys, infcl, infcl.gradcache.deepspeed; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the real engine: 2 gloo ranks, DeepSpeed's CPU accelerator --------------------------------------------


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out_dir = str(tmp_path_factory.mktemp("deepspeed_gradcache"))
    return launch(WORLD, "workers.deepspeed_gradcache_worker", out_dir, pg_timeout_s=120.0, deadline_s=600.0)


def scenario_results(outcomes, scenario):
    if not all(o.returncode == 0 and o.results is not None for o in outcomes):
        pytest.fail(f"DeepSpeed workers failed:\n{describe(outcomes)}")
    ranks = [o.results[scenario] for o in outcomes]
    for r, res in enumerate(ranks):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
    return ranks


def materialized_truth():
    """(loss, {name: grad}) of the materialized CLIP loss of the global batch (B x B logits), float64."""
    model = worker.make_model().double()
    images, texts = worker.global_batch(WORLD, torch.float64)
    image_emb, text_emb = model(images=images), model(texts=texts)
    logits = model.logit_scale.exp() * image_emb @ text_emb.T
    labels = torch.arange(logits.shape[0])
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("scenario", [s[0] for s in worker.SCENARIOS])
def test_zero_step_equals_materialized_global_batch(outcomes, scenario):
    ranks = scenario_results(outcomes, scenario)
    loss, grads = materialized_truth()
    # Each rank's ring loss is its own rows' share; their mean is the global loss.
    torch.testing.assert_close(torch.stack([res["loss"] for res in ranks]).double().mean(), loss, rtol=RTOL, atol=ATOL)
    for r, res in enumerate(ranks):
        for name, truth in grads.items():
            where = f"rank {r} {name}"
            got = res["grads"][name]
            assert got is not None, f"{where}: no gradient"
            torch.testing.assert_close(got.double(), truth, rtol=RTOL, atol=ATOL, msg=lambda m, w=where: f"{w}: {m}")
            # The optimizer stepped on the reduced gradient: plain SGD, w - LR * grad.
            expected = res["before"][name].double() - worker.LR * truth
            torch.testing.assert_close(
                res["after"][name].double(), expected, rtol=RTOL, atol=ATOL, msg=lambda m, w=where: f"{w}: {m}"
            )


@pytest.mark.slow
@pytest.mark.distributed
def test_zero2_reduces_once_per_step_whatever_the_chunks(outcomes):
    """The 3-chunk step calls DeepSpeed's reducing collectives exactly as often as the 1-chunk step: no per-chunk
    reduce-scatter (the counter sees the reduction: at least one call)."""
    chunked = scenario_results(outcomes, "zero2-engine")
    whole = scenario_results(outcomes, "zero2-engine-one-chunk")
    for a, b in zip(chunked, whole):
        assert sum(b["reductions"].values()) > 0, b["reductions"]
        assert a["reductions"] == b["reductions"], (a["reductions"], b["reductions"])
