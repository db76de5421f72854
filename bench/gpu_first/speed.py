"""The ``speed`` step: bf16, D = 512, forward + backward at B = 16k / 32k / 64k, the symmetric CLIP loss and the
SigLIP loss: the chunked route (``backend="chunked"``) against the fused kernels (``"triton"``) and the vanilla loss
(its [B, B] logits; at 64k too where its ~5 B^2 bf16 buffers fit, as on an 80 GB H100), each timed by CUDA events
(median of ``--repeats`` after the first call, timed apart: the compiles, and one warm call); peak extra memory; the
route's plan (C); the device's own bf16 GEMM rate and each time over its GEMM-equivalents' bound (the route 4 for CLIP,
3 for SigLIP; the fused and vanilla losses 5). The peers (Inf-CL, memeff, siglip-kernel) are the ``peers`` step's, at
the same B, D and dtype. A dry run: the same on CPU tensors at toy sizes, the torch tiles standing in for the fused
kernels."""

import functools
import math
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from .files import append_row
from .plan import Sizes
from .timing import device_for, fwd_bwd, time_step

# Vanilla runs where its ~5 [B, B] bf16 buffers take at most this share of the device's memory (64k: 43 GB).
VANILLA_MEMORY_SHARE = 0.9
# The GEMM rate: q @ k.T at this B (flat beyond it, bench.gemm.GEMM_MAX_BATCH), best of this many runs.
GEMM_BATCH, GEMM_RUNS = 16384, 20
# GEMM-equivalents (2 B^2 D flops each) of one forward + backward: the route's and the others'.
GEMM_EQUIVALENTS = {("clip", "chunked"): 4, ("siglip", "chunked"): 3}
OTHERS_GEMMS = 5


def gemm_tflops(device: torch.device, dim: int, batch: int = GEMM_BATCH) -> Optional[float]:
    """The device's bf16 rate on the loss's S product (q @ k.T into a preallocated output), best of
    :data:`GEMM_RUNS` CUDA-event timings (None on CPU)."""
    if device.type != "cuda":
        return None
    a, b = (torch.randn(batch, dim, device=device, dtype=torch.bfloat16) for _ in "ab")
    c = torch.empty(batch, batch, device=device, dtype=torch.bfloat16)
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


def ours(loss: str, dry: bool) -> Dict[str, Callable]:
    """{method: fn(q, k, scale)} of this step: the fused kernels (the torch tiles in a dry run), the route, vanilla."""
    from ..methods import METHODS, _infcl_loss, _infcl_siglip

    fused = "torch" if dry else "triton"
    fns = {fused: METHODS[fused].loss_fn(loss)}
    fns["chunked"] = _infcl_loss("chunked") if loss == "clip" else _infcl_siglip("chunked")
    fns["vanilla"] = METHODS["vanilla"].loss_fn(loss)
    return {name: functools.partial(_symmetric, fn) for name, fn in fns.items()}


def _symmetric(fn: Callable, q, k, scale):
    return fn(q, k, scale, True)


def chunk_plan(q: torch.Tensor, k: torch.Tensor, route=None) -> str:
    """What backend="chunked" (or ``route``, a ChunkedBackend with its options) does with a block of these features:
    "C=<rows>", or why the fused kernels run it."""
    from infcl.backends import chunked
    from infcl.contract import Block

    pos = torch.arange(q.shape[0], device=q.device)
    block = Block(q=q.detach(), k=k.detach(), scale=torch.ones((), device=q.device), pos=pos)
    plan = (chunked.BACKEND if route is None else route).plan(block)
    return f"C={plan.rows}" if hasattr(plan, "rows") else plan.reason


def vanilla_fits(batch: int, device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return None
    memory = torch.cuda.get_device_properties(device).total_memory
    if 5 * batch * batch * 2 > VANILLA_MEMORY_SHARE * memory:
        return f"its ~5 [B, B] bf16 buffers exceed {VANILLA_MEMORY_SHARE:g} of the device's memory"
    return None


def speed_row(out: Path, row: Dict, loss_fn: Callable, batch: int, sizes: Sizes, device, leaves) -> Dict:
    """Time one configuration into speed.csv (an error is its row's status; the next configuration runs)."""
    try:
        result = time_step(fwd_bwd(loss_fn, *leaves), sizes.repeats, device)
        row.update(status="ok", **result)
        if row.get("bound_ms"):
            row["x_bound"] = result["time_ms"] / row["bound_ms"]
    except Exception as err:  # recorded; the next configuration runs
        row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    append_row(out / "speed.csv", row)
    print(row, flush=True)
    return row


def step_speed(out: Path, sizes: Sizes, dry: bool, part: str = "") -> None:
    from ..methods import make_inputs

    device = device_for(dry)
    rate = gemm_tflops(device, sizes.dim)
    append_row(out / "speed.csv", {"method": "torch.mm bf16 (q @ k.T)", "batch": GEMM_BATCH, "dim": sizes.dim,
                                   "dtype": "bfloat16", "status": "ok" if rate else "skipped", "gemm_tflops": rate,
                                   "note": "" if rate else "no GPU"})  # fmt: skip
    for loss in ("clip", "siglip"):
        for batch in sizes.speed:
            q, k, scale = make_inputs(batch, sizes.dim, torch.bfloat16, device)
            plan = chunk_plan(q, k)
            for name, fn in ours(loss, dry).items():
                gemms = GEMM_EQUIVALENTS.get((loss, name), OTHERS_GEMMS)
                row = {"method": name, "loss": loss, "batch": batch, "dim": sizes.dim, "dtype": "bfloat16",
                       "gemm_tflops": rate, "note": plan if name == "chunked" else ""}  # fmt: skip
                if rate:
                    row["bound_ms"] = 1e3 * gemms * 2.0 * batch * batch * sizes.dim / (rate * 1e12)
                why = vanilla_fits(batch, device) if name == "vanilla" else None
                if why:
                    append_row(out / "speed.csv", {**row, "status": "skipped", "note": why})
                    continue
                speed_row(out, row, fn, batch, sizes, device, (q, k, scale))
            q = k = scale = None
