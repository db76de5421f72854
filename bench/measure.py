"""Timing and peak extra memory of one benchmark step.

A step is a pair of callables: ``prepare()`` (untimed: e.g. the forward before a timed backward) and
``measured()`` (the timed phase). Time: median over ``repeats`` runs after ``warmup`` runs, with
``torch.cuda.synchronize`` around each run and CUDA events timing it on CUDA.
Peak extra memory: the high-water mark while
``measured`` runs minus the memory held before ``prepare`` (so the forward's saved tensors count in
a backward's figure); on CUDA from ``torch.cuda.max_memory_allocated``, on CPU from the process's
resident-set high-water mark (``resource.getrusage(...).ru_maxrss``), read in a fresh process per
configuration (see :mod:`bench.worker`).
"""

import ctypes
import ctypes.util
import gc
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

MIB = 2**20
# Linux: writing "5" to /proc/self/clear_refs resets the RSS high-water mark to the current RSS, so
# ru_maxrss measures this step alone, not the process's import or setup transients.
CLEAR_REFS = "/proc/self/clear_refs"
# ru_maxrss is in KiB on Linux and in bytes on macOS.
RU_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024
# A configuration whose runs have taken this long prints a line per run (a slow one is not a hang).
PROGRESS_AFTER_S = 10.0


@dataclass
class Step:
    prepare: Callable[[], object]
    measured: Callable[[object], object]  # receives prepare()'s result


def loss_step(loss_fn: Callable, q: torch.Tensor, k: torch.Tensor, scale: torch.Tensor, mode: str) -> Step:
    """The step of ``mode`` ("forward", "backward", "forward+backward") for ``loss_fn(q, k, scale)``.

    Gradients are reset to None before every forward, as ``optimizer.zero_grad(set_to_none=True)`` does,
    so each run allocates them afresh (they count in the peak memory).
    """

    def clear_grads():
        q.grad = k.grad = scale.grad = None

    def forward():
        clear_grads()
        return loss_fn(q, k, scale)

    if mode == "forward":
        return Step(clear_grads, lambda _: forward())
    if mode == "backward":
        return Step(forward, lambda loss: loss.backward())
    if mode == "forward+backward":
        return Step(clear_grads, lambda _: forward().backward())
    raise ValueError(f"mode must be forward, backward or forward+backward, got {mode!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Step, device: torch.device) -> float:
    state = step.prepare()
    _sync(device)
    if device.type == "cuda":  # CUDA events: the GPU's own clock, no host launch overhead in the figure
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step.measured(state)
        end.record()
        end.synchronize()
        elapsed = start.elapsed_time(end) / 1e3
    else:
        start = time.perf_counter()
        out = step.measured(state)
        elapsed = time.perf_counter() - start
    del out, state
    return elapsed


def time_step(step: Step, device: torch.device, warmup: int, repeats: int) -> List[float]:
    """Wall-clock seconds of ``step.measured`` for each of ``repeats`` runs after ``warmup`` runs."""
    return time_interleaved({"step": step}, device, warmup, repeats)["step"]


def time_interleaved(
    steps: Dict[str, Step],
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, List[float]]:
    """``time_step`` for several steps, their runs taken in turn (a, b, a, b, ...): each name's timed runs.
    ``progress``, when given, gets one line per round once the rounds so far have taken PROGRESS_AFTER_S."""
    times = {name: [] for name in steps}
    started = time.perf_counter()
    for i in range(warmup + repeats):
        round_s = {name: _timed(step, device) for name, step in steps.items()}
        if i >= warmup:
            for name, elapsed in round_s.items():
                times[name].append(elapsed)
        if progress is not None and time.perf_counter() - started >= PROGRESS_AFTER_S:
            runs = ", ".join(f"{name} {elapsed:.3g} s" for name, elapsed in round_s.items())
            progress(f"{'warmup' if i < warmup else 'timed'} round {i + 1}/{warmup + repeats}: {runs}")
    return times


def median(times: List[float]) -> float:
    return statistics.median(times)


def _release_freed_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc), so the RSS is what is live."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is not None and sys.platform.startswith("linux"):
        ctypes.CDLL(name).malloc_trim(0)


def _current_rss() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return None


def _reset_rss_high_water() -> bool:
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RU_MAXRSS_UNIT


def peak_extra_bytes(step: Step, device: torch.device) -> int:
    """Peak memory while ``step.measured`` runs, minus the memory held before ``step.prepare``.

    Call it on the first full-size run in the process: afterwards the allocator's caches hide growth.
    """
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        state = step.prepare()
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = step.measured(state)
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        del out, state
        return peak - base
    _release_freed_memory()
    base = _current_rss()
    state = step.prepare()
    _release_freed_memory()
    if base is None or not _reset_rss_high_water():
        # Without /proc the high-water mark cannot be reset: the delta of ru_maxrss is a lower bound.
        base = _max_rss()
    out = step.measured(state)
    peak = _max_rss()
    del out, state
    return max(0, peak - base)
