"""The ``kernels`` step: torch.profiler's time per kernel (forward, dq, dk; Inf-CL's) at B = 32k / 64k, and the
chunked route's every kernel at 64k (kernels.csv, the columns ``python -m bench.static --measured`` reads)."""

import functools
from pathlib import Path
from typing import Dict, Tuple

from .files import append_row
from .plan import DIM, Sizes
from .speed import _symmetric
from .timing import fwd_bwd

PROFILED_STEPS = 3


def profile_kernels(step, steps: int) -> Dict[str, Tuple[float, float]]:
    """{kernel label: (calls per step, ms per call)} of the CUDA kernels ``steps`` calls of ``step`` run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ..static import kernel_label

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        total_us = getattr(event, "self_device_time_total", None)
        if total_us is None:
            total_us = getattr(event, "self_cuda_time_total", 0.0)
        if event.count and total_us:
            out[kernel_label(event.key)] = (event.count / steps, total_us / 1e3 / event.count)
    return out


def step_kernels(out: Path, sizes: Sizes, dry: bool, part: str = "") -> None:
    """The fused kernels' (and Inf-CL's) per-kernel times, then the chunked route's every kernel at the largest B
    (cuBLAS products, the passes, the merges, the small torch ops; method "chunked"). GPU only: a dry run profiles
    nothing (torch.profiler's CUDA activity)."""
    if dry or not sizes.kernels:
        print("kernels: no GPU (a dry run): nothing profiled", flush=True)
        return
    import torch

    from ..methods import METHODS, _infcl_loss, make_inputs

    batches = sizes.kernels

    props = torch.cuda.get_device_properties(0)
    target = f"sm_{props.major}{props.minor}"
    device = torch.device("cuda")
    # The softmax backward is one kernel for dq and dk (BY_COLUMN): the profiler names both launches "backward".
    runs = [("triton", "infcl", ("forward", "backward"), batch) for batch in batches]
    if METHODS["inf-cl"].unavailable_for("clip", device, DIM) is None:
        runs.append(("inf-cl", "inf-cl", ("inf-cl forward", "inf-cl dq", "inf-cl dk"), batches[0]))
    for name, method, kernels, batch in runs:
        q, k, scale = make_inputs(batch, DIM, torch.bfloat16, device)
        symmetric = functools.partial(_symmetric, METHODS[name].loss)
        times = profile_kernels(fwd_bwd(symmetric, q, k, scale), PROFILED_STEPS)
        common = {
            "target": target,
            "dtype": "bf16",
            "D": DIM,
            "batch": batch,
            "method": method,
            "source": f"torch.profiler, {PROFILED_STEPS} steps",
        }
        for kernel in kernels:
            calls, ms = times.get(kernel, (None, None))
            append_row(out / "kernels.csv", {**common, "kernel": kernel, "calls_per_step": calls, "measured_ms": ms})
        found = [times[kernel] for kernel in kernels if kernel in times]
        append_row(
            out / "kernels.csv",
            {
                **common,
                "kernel": f"{method} total",
                "calls_per_step": 1,
                "measured_ms": sum(calls * ms for calls, ms in found),
            },
        )
        q = k = scale = None
        torch.cuda.empty_cache()
    batch = batches[-1]
    q, k, scale = make_inputs(batch, DIM, torch.bfloat16, device)
    route = functools.partial(_symmetric, _infcl_loss("chunked"))
    times = profile_kernels(fwd_bwd(route, q, k, scale), PROFILED_STEPS)
    common = {"target": target, "dtype": "bf16", "D": DIM, "batch": batch, "method": "chunked",
              "source": f"torch.profiler, {PROFILED_STEPS} steps, the route's every kernel"}  # fmt: skip
    for kernel, (calls, ms) in sorted(times.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
        append_row(out / "kernels.csv", {**common, "kernel": kernel[:80], "calls_per_step": calls, "measured_ms": ms})
    total = sum(calls * ms for calls, ms in times.values())
    append_row(out / "kernels.csv", {**common, "kernel": "chunked total", "calls_per_step": 1, "measured_ms": total})
