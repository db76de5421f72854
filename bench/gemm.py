"""This machine's matmul rate, measured in the same run, and the GEMM bound it implies.

The tiled loss is bound by its matrix products, each 2 * B^2 * D flops for a [B, D] x [D, B] or
[B, B] x [B, D] product: forward 1 (S = scale * q @ k.T), backward 3 (S again, dq = dS @ k,
dk = dS.T @ q); the symmetric loss takes its row and column log-sum-exps from the same tiles, so the
count is the same for both directions. The GEMM bound of a phase is those products at the best rate
``torch.mm`` reaches here with a preallocated output of the same shapes. The benchmark measures that
rate inside each configuration's own process, its runs interleaved with the method's timed runs, so a
VM whose speed drifts over minutes moves the method's time and its bound together.

Low-precision inputs (bfloat16, float16) can be multiplied two ways: by a matmul in their own dtype, or
by a float32 matmul on float32 copies (exact: every product of two bf16 or fp16 values, and its sum,
is what float32 accumulation gives). Which is faster depends on the CPU: with AMX or AVX512-BF16 the
bf16 matmul; on an AVX2-only CPU torch's bf16 matmul runs at 0.5-17 GFLOP/s against ~150 for float32
(AMD EPYC family 25 model 1). The bound takes the faster one, its *route*, which the table names.
Each route's rate is probed once, up front, on both product shapes, growing until one takes PROBE_RUN_S
(:func:`probe_rates`: the slower shape's rate), so a pathologically slow route costs about a second and
never runs between timed runs; the interleaved matmul runs then use the chosen route only.
"""

from typing import Dict, List, Optional

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
    """The loss's two product shapes, ``torch.mm`` into preallocated outputs, at B = min(batch, GEMM_MAX_BATCH);
    ``dtype`` is the product's (the route's), not necessarily the inputs'."""
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


# Probe: the loss's two product shapes, [n, D] x [D, n] (S) and [n, n] x [n, D] (dS @ k), n doubling from
# PROBE_MIN_ROWS until one run takes PROBE_RUN_S (or n reaches the benchmark's own B): long enough for a steady
# rate, short enough that a route at 0.5 GFLOP/s costs about a second in all.
PROBE_MIN_ROWS = 256
PROBE_RUN_S = 0.25


def gemm_routes(dtype: torch.dtype) -> List[torch.dtype]:
    """The product dtypes that can multiply inputs of ``dtype`` exactly: its own, and float32 for the
    16-bit floats (float32 copies; the conversion is O(B D), nothing beside the products)."""
    return [dtype, torch.float32] if dtype in (torch.bfloat16, torch.float16) else [dtype]


def _probe_operands(rows: int, dim: int, shape: str, dtype: torch.dtype, device: torch.device, gen):
    """(a, b, out) of ``torch.mm(a, b, out=out)`` for one probe product of ``shape`` ("s" or "ds")."""
    feats = torch.randn(rows, dim, generator=gen).to(device=device, dtype=dtype)
    if shape == "s":
        return feats, feats.T, torch.empty(rows, rows, device=device, dtype=dtype)
    square = torch.randn(rows, rows, generator=gen).to(device=device, dtype=dtype)
    return square, feats, torch.empty(rows, dim, device=device, dtype=dtype)


def probe_rate(batch: int, dim: int, dtype: torch.dtype, device: torch.device, shape: str = "s") -> float:
    """GFLOP/s of ``torch.mm`` in ``dtype`` on the largest probe product of ``shape`` ("s": [n, D] x [D, n];
    "ds": [n, n] x [n, D]; see PROBE_RUN_S), the faster of two runs at that size."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, cap = PROBE_MIN_ROWS, max(PROBE_MIN_ROWS, min(batch, GEMM_MAX_BATCH))
    while True:
        a, b, out = _probe_operands(rows, dim, shape, dtype, device, gen)
        step = Step(lambda: None, lambda _, a=a, b=b, out=out: torch.mm(a, b, out=out))
        seconds = min(time_step(step, device, warmup=0, repeats=2))
        if seconds >= PROBE_RUN_S or rows >= cap:
            return gemm_flops(rows, dim) / seconds / 1e9
        rows = min(2 * rows, cap)


def probe_rates(batch: int, dim: int, dtype: torch.dtype, device: torch.device) -> Dict[str, float]:
    """{route dtype name: probed GFLOP/s} for every route of ``dtype`` (one entry where there is one route,
    not probed: ``nan``); see :func:`best_route`. A route's rate is its slower product shape: a method that
    multiplies in that dtype needs both (on an AVX2-only AMD EPYC, torch's bf16 [n, n] x [n, D] product ran at
    0.3 GFLOP/s against 1.8 for [n, D] x [D, n]), so the time budget's estimates hold for it."""
    routes = gemm_routes(dtype)
    if len(routes) == 1:
        return {_name(dtype): float("nan")}
    shapes = ("s", "ds")
    return {_name(route): min(probe_rate(batch, dim, route, device, shape) for shape in shapes) for route in routes}


def best_route(rates: Dict[str, float]) -> str:
    """The route with the highest probed rate (the only one where there is one)."""
    return max(rates, key=lambda name: -1.0 if rates[name] != rates[name] else rates[name])


def route_dtype(route: str) -> torch.dtype:
    return getattr(torch, route)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def estimated_seconds(batch: int, dim: int, mode: str, gflops: float) -> Optional[float]:
    """One run's time at the GEMM bound for ``gflops`` (None where no rate was probed, ``nan``): the least
    a method that multiplies at that rate needs."""
    if gflops != gflops or gflops <= 0:
        return None
    return gemm_bound_seconds(batch, dim, mode, gflops * 1e9)
