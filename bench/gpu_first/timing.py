"""Timing and memory of one configuration, on a GPU (CUDA events, the allocator's peak) or, in a dry run, on CPU
(wall clock, no memory figure): the first call apart (Triton's compiles), one warm call, then the timed calls."""

import statistics
import subprocess
import time
from typing import Callable, Dict, Optional

import torch

MIB = 2**20


def device_for(dry: bool) -> torch.device:
    return torch.device("cpu" if dry else "cuda")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _clock_probe(device: torch.device):
    """nvidia-smi sampling the SM clock while the GPU runs (started before a timed loop, read after)."""
    if device.type != "cuda":
        return None
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


def timed(fn: Callable, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_step(step: Callable, repeats: int, device: torch.device) -> Dict:
    """First call (with any compile) timed apart, one warm call, then ``repeats`` timed calls (median, min); peak
    extra memory over what is held before a call (GPU); the SM clock during the timed calls (GPU)."""
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - t0
    step()
    sync(device)
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    probe = _clock_probe(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / MIB if device.type == "cuda" else None
    return {
        "first_call_s": first,
        "time_ms": statistics.median(times),
        "time_min_ms": min(times),
        "repeats": repeats,
        "peak_mib": peak,
        "sm_clock_mhz": _clock_read(probe),
    }


def fwd_bwd(loss: Callable, *leaves) -> Callable:
    """One forward + backward of ``loss(*leaves)``, the leaves' gradients cleared first."""

    def step():
        for t in leaves:
            t.grad = None
        loss(*leaves).backward()

    return step
