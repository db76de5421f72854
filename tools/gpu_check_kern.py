"""A short GPU check of the Triton kernels' numerics and per-kernel times (issue 33), < 90 s on an H100.

    python tools/gpu_check_kern.py            # on a GPU: B = 4096, D = 512; then the profile at B = 32768
    TRITON_INTERPRET=1 python tools/gpu_check_kern.py --batch 1024 --dim 64 --no-profile   # CPU, interpreter

1. Errors (relative 2-norm, loss / dq / dk / dscale) of the symmetric loss against a float64 truth (infcl's
   torch tiles in float64) for bfloat16, float16 and float32 with TF32 products, beside torch's own vanilla
   loss in the same dtype and the "floor": the float64 truth rounded to the result's dtype, the least error
   a result stored in that dtype can have (float16 gradients of a mean loss sit mostly below float16's
   smallest normal, 6.1e-5, at B >= 4096, so the floor dominates there).
2. Per-kernel CUDA times (torch.profiler) of one symmetric forward + backward at B = 32768, bf16, D = 512:
   the forward, dq and dk kernels, and the call's wall time by CUDA events.

Writes the results as JSON to $OUT/gpu_check_kern.json when OUT is set, and prints them.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's infcl and bench

from bench import errors as harness  # noqa: E402
from infcl import cal_inf_loss  # noqa: E402

NAMES = ("loss", "dq", "dk", "dscale")
SCALE = 1 / 0.07
KERNELS = ("_forward_kernel", "_backward_kernel")  # the backward: dq and dk, one kernel (BY_COLUMN)


def _vanilla(q, k, scale):
    logits = scale * q @ k.T
    labels = torch.arange(q.shape[0], device=q.device)
    ce = torch.nn.functional.cross_entropy
    return (ce(logits, labels) + ce(logits.T, labels)) / 2


def _loss(backend):
    return lambda q, k, scale: cal_inf_loss(q, k, None, scale, symmetric=True, backend=backend)


def _inputs(batch, dim, dtype, device, seed=0):
    return harness.case_inputs(batch, dim, dtype, device, seed)


def errors(batch, dim, device):
    """The errors of the fused kernels, of torch's own loss and the floor, through the one float64 harness
    (bench/errors.py)."""
    out = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("tf32", torch.float32)):
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        q, k = _inputs(batch, dim, dtype, device)
        scale = torch.tensor(SCALE, device=device)
        ours = harness.grads(_loss("triton"), q, k, scale)
        truth = harness.truth_of(_loss, q, k, scale)
        theirs = harness.grads(_vanilla, q, k, scale)
        out[name] = {
            n: {
                "ours": harness.relative(a, e),
                "vanilla": harness.relative(t, e),
                "floor": harness.relative(e.to(a.dtype), e),
            }  # fmt: skip
            for n, a, t, e in zip(NAMES, ours, theirs, truth)
        }
        torch.backends.cuda.matmul.allow_tf32 = False
        print(
            f"{name:9} "
            + "  ".join(
                f"{n}: ours {v['ours']:.2e} vanilla {v['vanilla']:.2e} floor {v['floor']:.2e}"
                for n, v in out[name].items()
            ),
            flush=True,
        )
    return out


def profile(batch, dim, backend="triton"):
    """One symmetric bf16 forward + backward by ``backend`` (a name, or a TritonBackend with its tiling)."""
    q, k = _inputs(batch, dim, torch.bfloat16, "cuda", seed=1)
    scale = torch.tensor(SCALE, device="cuda")

    def step():
        q_, k_ = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
        cal_inf_loss(q_, k_, None, scale, symmetric=True, backend=backend).backward()

    for _ in range(2):  # compile and warm up
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 3
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / reps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    per_kernel = {}
    for event in prof.key_averages():
        for kernel in KERNELS:
            if kernel in event.key:
                total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
                per_kernel[kernel] = per_kernel.get(kernel, 0.0) + total / 1000 / reps  # us -> ms per call
    out = {"batch": batch, "dim": dim, "wall_ms": wall, "kernel_ms": per_kernel}
    print(
        f"B={batch} D={dim} bf16 symmetric fwd+bwd: {wall:.2f} ms; "
        + ", ".join(f"{k} {v:.2f} ms" for k, v in per_kernel.items()),
        flush=True,
    )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--profile-batch", type=int, default=32768)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    began = time.time()
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    result["errors"] = errors(args.batch, args.dim, device)
    if device == "cuda" and not args.no_profile:
        result["profile"] = profile(args.profile_batch, args.dim)
    result["seconds"] = time.time() - began
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check_kern.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
