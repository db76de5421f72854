"""The ``speed`` step: bf16, D = 512, symmetric, forward + backward at B = 16k / 32k / 64k, CUDA events, median
of ``--repeats``: infcl ``backend="triton"``, Inf-CL (when ``inf_cl`` imports), vanilla where its logits fit;
peak extra memory; the device's own bf16 GEMM rate and each time over the 5-GEMM bound; the first call of
each method timed apart (Triton's compile)."""

import math
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional

from .files import append_row
from .plan import DIM, REPEATS

SPEED_BATCHES = (16384, 32768, 65536)
SPEED_METHODS = ("triton", "inf-cl", "vanilla")
# Vanilla runs where its ~5 [B, B] buffers (bench.__main__.VANILLA_BUFFERS) take at most this share of memory.
VANILLA_MEMORY_SHARE = 0.75
# The GEMM rate: q @ k.T at this B (flat beyond it, bench.gemm.GEMM_MAX_BATCH), best of this many runs.
GEMM_BATCH, GEMM_RUNS = 16384, 20
MIB = 2**20


def _clock_probe():
    """nvidia-smi sampling the SM clock while the GPU runs (started before a timed loop, read after)."""
    try:
        return subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return None


def _clock_read(probe) -> Optional[float]:
    if probe is None:
        return None
    try:
        return float(probe.communicate(timeout=10)[0].split()[0])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def gemm_tflops(batch: int = GEMM_BATCH, dim: int = DIM) -> float:
    """The device's bf16 rate on the loss's S product (q @ k.T into a preallocated output), best of
    :data:`GEMM_RUNS` CUDA-event timings: the rate the 5-GEMM bound is taken at."""
    import torch

    a, b = (torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16) for _ in "ab")
    c = torch.empty(batch, batch, device="cuda", dtype=torch.bfloat16)
    best = math.inf
    for i in range(GEMM_RUNS + 2):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b.T, out=c)
        stop.record()
        stop.synchronize()
        if i >= 2:  # two warm-up runs
            best = min(best, start.elapsed_time(stop) / 1e3)
    return 2.0 * batch * batch * dim / best / 1e12


def fwd_bwd(fn, q, k, scale):
    def step():
        q.grad = k.grad = scale.grad = None
        fn(q, k, scale, True).backward()

    return step


def time_step(step, repeats: int) -> Dict:
    """First call (with any compile), then one warm call, then ``repeats`` CUDA-event timings; peak extra
    memory over what is held before a call."""
    import statistics

    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    probe = _clock_probe()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return {
        "first_call_s": first,
        "time_ms": statistics.median(times),
        "time_min_ms": min(times),
        "repeats": repeats,
        "peak_mib": (torch.cuda.max_memory_allocated() - base) / MIB,
        "sm_clock_mhz": _clock_read(probe),
    }


def step_speed(out: Path, batches=SPEED_BATCHES, repeats: int = REPEATS) -> None:
    import torch

    from ..methods import METHODS, make_inputs

    device = torch.device("cuda")
    rate = gemm_tflops()
    append_row(
        out / "speed.csv",
        {
            "method": "torch.mm bf16 (q @ k.T)",
            "batch": GEMM_BATCH,
            "dim": DIM,
            "dtype": "bfloat16",
            "status": "ok",
            "gemm_tflops": rate,
        },
    )
    memory = torch.cuda.get_device_properties(0).total_memory
    for batch in batches:
        bound_ms = 1e3 * 5 * 2.0 * batch * batch * DIM / (rate * 1e12)
        for name in SPEED_METHODS:
            row = {
                "method": name,
                "batch": batch,
                "dim": DIM,
                "dtype": "bfloat16",
                "gemm_tflops": rate,
                "bound_ms": bound_ms,
            }
            reason = METHODS[name].unavailable_for("clip", device, DIM)
            if name == "vanilla" and 5 * batch * batch * 2 > VANILLA_MEMORY_SHARE * memory:
                reason = f"its ~5 [B, B] bf16 buffers exceed {VANILLA_MEMORY_SHARE:g} of the device's memory"
            if reason:
                append_row(out / "speed.csv", {**row, "status": "skipped", "note": reason})
                continue
            try:
                q, k, scale = make_inputs(batch, DIM, torch.bfloat16, device)
                result = time_step(fwd_bwd(METHODS[name].loss, q, k, scale), repeats)
                row.update(status="ok", x_bound=result["time_ms"] / bound_ms, **result)
            except Exception as err:  # recorded; the next configuration runs
                row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
            finally:
                q = k = scale = None
                torch.cuda.empty_cache()
            append_row(out / "speed.csv", row)
            print(row, flush=True)
