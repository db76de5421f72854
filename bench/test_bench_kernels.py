"""pytest-benchmark timings of the main kernels: ``pytest bench/`` (not part of ``pytest tests``).

Small sizes, symmetric loss, providers vanilla vs infcl's backends (those unavailable here skip with
their reason). Compare runs with ``pytest bench/ --benchmark-compare``; nothing here asserts on time.
"""

import pytest
import torch

from bench.methods import METHODS
from bench.worker import LOGIT_SCALE

PROVIDERS = ("vanilla", "torch", "cpu", "triton")
SHAPES = ((1024, 128), (2048, 256))  # (B, D): seconds per round on 2 cores
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(batch, dim):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(batch, dim, generator=gen), dim=-1).to(DEVICE) for _ in range(2))
    return q.requires_grad_(True), k.requires_grad_(True), torch.tensor(LOGIT_SCALE, device=DEVICE, requires_grad=True)


def _synced(fn):
    def run():
        out = fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out

    return run


@pytest.mark.parametrize("batch,dim", SHAPES)
@pytest.mark.parametrize("mode", ("forward", "forward+backward"))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_symmetric_loss(benchmark, provider, mode, batch, dim):
    method = METHODS[provider]
    why = method.unavailable(DEVICE, dim)
    if why is not None:
        pytest.skip(why)
    q, k, scale = _inputs(batch, dim)
    benchmark.group = f"{mode} B={batch} D={dim}"
    benchmark.extra_info.update(provider=provider, batch=batch, dim=dim, device=str(DEVICE))
    def step():
        q.grad = k.grad = scale.grad = None  # as optimizer.zero_grad(set_to_none=True) would
        loss = method.loss(q, k, scale, True)
        if mode == "forward+backward":
            loss.backward()
        return loss

    loss = benchmark(_synced(step))
    assert torch.isfinite(loss)
    if mode == "forward+backward":
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
