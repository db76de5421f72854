"""This machine's matmul rate, measured in the same run, and the GEMM bound it implies.

The tiled loss is bound by its matrix products, each 2 * B^2 * D flops for a [B, D] x [D, B] or
[B, B] x [B, D] product: forward 1 (S = scale * q @ k.T), backward 3 (S again, dq = dS @ k,
dk = dS.T @ q); the symmetric loss takes its row and column log-sum-exps from the same tiles, so the
count is the same for both directions. The GEMM bound of a phase is those products at the best rate
``torch.mm`` reaches here with a preallocated output of the same shapes.
"""

from typing import Dict

import torch

from .measure import Step, time_step

PRODUCTS = {"forward": 1, "backward": 3, "forward+backward": 4}

# Beyond this B the rate is flat and the [B, B] operands would only cost memory (1 GiB in fp32 here).
GEMM_MAX_BATCH = 16384


def gemm_flops(batch: int, dim: int) -> float:
    """Flops of one [B, D] x [D, B] product."""
    return 2.0 * batch * batch * dim


def gemm_bound_seconds(batch: int, dim: int, mode: str, flops_per_s: float) -> float:
    return PRODUCTS[mode] * gemm_flops(batch, dim) / flops_per_s


def measure_gemm(batch: int, dim: int, dtype: torch.dtype, device: torch.device, warmup: int, repeats: int) -> Dict:
    """GFLOP/s of the loss's two product shapes; ``gflops`` is the better one.

    Each rate is from the fastest of the timed runs: the bound is the machine's *best* matmul rate, and
    on a shared VM a slow outlier run must not make the bound look easier to reach.
    """
    b = min(batch, GEMM_MAX_BATCH)
    gen = torch.Generator(device="cpu").manual_seed(0)
    feats = torch.randn(b, dim, generator=gen).to(device=device, dtype=dtype)
    other = torch.randn(b, dim, generator=gen).to(device=device, dtype=dtype)
    square = torch.randn(b, b, generator=gen).to(device=device, dtype=dtype)
    s_out = torch.empty(b, b, device=device, dtype=dtype)
    d_out = torch.empty(b, dim, device=device, dtype=dtype)
    shapes = {
        "s_gflops": Step(lambda: None, lambda _: torch.mm(feats, other.T, out=s_out)),  # S = q @ k.T
        "ds_gflops": Step(lambda: None, lambda _: torch.mm(square, other, out=d_out)),  # dq = dS @ k
    }
    rates = {
        name: gemm_flops(b, dim) / min(time_step(step, device, warmup, repeats)) / 1e9
        for name, step in shapes.items()
    }
    return {**rates, "gflops": max(rates.values()), "gemm_batch": b}
