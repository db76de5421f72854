"""The ``speed`` step (end to end at B = 16k / 32k / 64k: chunked, fused, vanilla, Inf-CL) and the ``million``
step (one batch of B = 1,048,576 on the chunked route); :func:`chunk_plan`, what the route does with a block."""

import os
import time
from typing import Callable, Dict

import torch

from .plan import GPU, MILLION_BUDGET_MB, Sizes
from .rows import Rows
from .timing import device_for, peak_gib, peak_reset, timed


def methods(device: torch.device) -> Dict[str, Callable]:
    from bench.methods import inf_cl_loss, inf_cl_unavailable, vanilla_loss
    from infcl import cal_inf_loss

    fused = "triton" if device.type == "cuda" else "torch"
    out = {
        "chunked": lambda q, k, s: cal_inf_loss(q, k, scale=s, symmetric=True, backend="chunked"),
        f"fused ({fused})": lambda q, k, s: cal_inf_loss(q, k, scale=s, symmetric=True, backend=fused),
        "vanilla": lambda q, k, s: vanilla_loss(q, k, s, True),
    }
    if inf_cl_unavailable(device, GPU.dim) is None:
        out["inf-cl"] = lambda q, k, s: inf_cl_loss(q, k, s, True)
    return out


def chunk_plan(q, k, masked: bool = False) -> str:
    """What backend="chunked" does with a block of these features: "C=<rows>", or why the fused kernels run it."""
    from infcl.backends import chunked
    from infcl.contract import Block

    pos = torch.arange(q.shape[0], device=q.device)
    ids = {"q_ids": pos, "k_ids": pos} if masked else {}
    block = Block(q=q.detach(), k=k.detach(), scale=torch.ones((), device=q.device), pos=pos, **ids)
    plan = chunked.BACKEND.plan(block)
    return f"C={plan.rows}" if hasattr(plan, "rows") else plan.reason


def step_speed(rows: Rows, sizes: Sizes, dry: bool) -> None:
    from bench.methods import make_inputs

    device = device_for(dry)
    for b in sizes.speed:
        q, k, scale = make_inputs(b, sizes.dim, torch.bfloat16, device)
        rows.add(f"B={b}", "chunk plan", chunk_plan(q, k))
        for name, loss in methods(device).items():
            if name == "vanilla" and device.type == "cuda":
                if 5 * b * b * 4 > 0.75 * torch.cuda.get_device_properties(0).total_memory:
                    rows.add(f"B={b} {name}", "skipped", 1, "", "its logits do not fit")
                    continue
            speed_case(rows, f"B={b} {name}", loss, q, k, scale, sizes.repeats)


def speed_case(rows: Rows, case: str, loss: Callable, q, k, scale, repeats: int) -> None:
    device = q.device

    def step():
        loss(q, k, scale).backward()
        q.grad = k.grad = scale.grad = None

    base = peak_reset(device)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rows.add(case, "first call", (time.perf_counter() - t0) * 1e3, "ms")
    seconds = timed(step, device, repeats)
    rows.add(case, "fwd+bwd", seconds * 1e3, "ms", f"peak {peak_gib(device, base)} GiB")


def step_million(rows: Rows, sizes: Sizes, dry: bool) -> None:
    from bench.methods import make_inputs
    from infcl import cal_inf_loss

    os.environ["INFCL_CHUNK_BUDGET_MB"] = str(MILLION_BUDGET_MB)
    device, n = device_for(dry), sizes.million
    q, k, scale = make_inputs(n, sizes.dim, torch.bfloat16, device)
    rows.add(f"B={n} D={sizes.dim} bf16 symmetric", "chunk plan", chunk_plan(q, k))
    base = peak_reset(device)
    t0 = time.perf_counter()
    cal_inf_loss(q, k, scale=scale, symmetric=True, backend="chunked").backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    rows.add(f"B={n} D={sizes.dim} bf16 symmetric", "fwd+bwd", seconds, "s", f"peak {peak_gib(device, base)} GiB")
