"""pytest-benchmark timings of the main kernels: ``pytest bench/`` (not part of ``pytest tests``).

Small sizes, symmetric loss, providers vanilla vs infcl's backends (those unavailable here skip with
their reason). Compare runs with ``pytest bench/ --benchmark-compare``; nothing here asserts on time.
"""

import pytest
import torch

from bench.measure import loss_step
from bench.methods import METHODS, make_inputs

PROVIDERS = ("vanilla", "torch", "cpu", "triton")
SHAPES = ((1024, 128), (2048, 256))  # (B, D): well under a second per round on 2 cores
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("batch,dim", SHAPES)
@pytest.mark.parametrize("mode", ("forward", "forward+backward"))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_symmetric_loss(benchmark, provider, mode, batch, dim):
    method = METHODS[provider]
    why = method.unavailable(DEVICE, dim)
    if why is not None:
        pytest.skip(why)
    q, k, scale = make_inputs(batch, dim, torch.float32, DEVICE)
    step = loss_step(lambda q, k, s: method.loss(q, k, s, True), q, k, scale, mode)
    benchmark.group = f"{mode} B={batch} D={dim}"
    benchmark.extra_info.update(provider=provider, batch=batch, dim=dim, device=str(DEVICE))

    def run():
        out = step.measured(step.prepare())
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out

    out = benchmark(run)
    if mode == "forward":
        assert torch.isfinite(out)
    else:
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(scale.grad)
