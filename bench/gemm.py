"""This machine's matmul rate, measured in the same run, and the GEMM bound it implies.

The tiled loss is bound by its matrix products, each 2 * B^2 * D flops for a [B, D] x [D, B] or
[B, B] x [B, D] product: forward 1 (S = scale * q @ k.T), backward 3 (S again, dq = dS @ k,
dk = dS.T @ q); the symmetric loss takes its row and column log-sum-exps from the same tiles, so the
count is the same for both directions. The GEMM bound of a phase is those products at the best rate
``torch.mm`` reaches here with a preallocated output of the same shapes. The benchmark measures that
rate inside each configuration's own process, its runs interleaved with the method's timed runs, so a
VM whose speed drifts over minutes moves the method's time and its bound together.
"""

from typing import Dict, List

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


def gemm_steps(batch: int, dim: int, dtype: torch.dtype, device: torch.device) -> Dict[str, Step]:
    """The loss's two product shapes, ``torch.mm`` into preallocated outputs, at B = min(batch, GEMM_MAX_BATCH)."""
    b = min(batch, GEMM_MAX_BATCH)
    gen = torch.Generator(device="cpu").manual_seed(0)
    feats = torch.randn(b, dim, generator=gen).to(device=device, dtype=dtype)
    other = torch.randn(b, dim, generator=gen).to(device=device, dtype=dtype)
    square = torch.randn(b, b, generator=gen).to(device=device, dtype=dtype)
    s_out = torch.empty(b, b, device=device, dtype=dtype)
    d_out = torch.empty(b, dim, device=device, dtype=dtype)
    return {
        "s_gflops": Step(lambda: None, lambda _: torch.mm(feats, other.T, out=s_out)),  # S = q @ k.T
        "ds_gflops": Step(lambda: None, lambda _: torch.mm(square, other, out=d_out)),  # dq = dS @ k
    }


def gemm_rates(batch: int, dim: int, times: Dict[str, List[float]]) -> Dict:
    """GFLOP/s of each shape from its fastest run; ``gflops`` is the better shape.

    The fastest run, because the bound is the machine's *best* matmul rate: on a shared VM a slow
    outlier run must not make the bound look easier to reach.
    """
    b = min(batch, GEMM_MAX_BATCH)
    rates = {name: gemm_flops(b, dim) / min(ts) / 1e9 for name, ts in times.items()}
    return {**rates, "gflops": max(rates.values()), "gemm_batch": b}


def measure_gemm(batch: int, dim: int, dtype: torch.dtype, device: torch.device, warmup: int, repeats: int) -> Dict:
    """The matmul rates on their own (see ``gemm_rates``)."""
    steps = gemm_steps(batch, dim, dtype, device)
    return gemm_rates(batch, dim, {name: time_step(step, device, warmup, repeats) for name, step in steps.items()})
