"""Timing (CUDA events on a GPU), the route's float32-output products, and peak memory."""

import statistics
import time
from typing import Callable

import torch


def device_for(dry: bool) -> torch.device:
    return torch.device("cpu" if dry else "cuda")


def timed(fn: Callable, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 result: cuBLAS's out_dtype on a GPU, float32 copies elsewhere (the route's products)."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def peak_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak_gib(device, base) -> str:
    if device.type != "cuda":
        return "-"
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.3f}"
