"""The chunked route's own steps, one result a row in route.csv:

- ``route``: cuBLAS rates of the route's three products (scores q_c @ k.T, dq's dS @ k, dk's dS.T @ q_c, all with
  float32 results) for C in {1024, 2048, 4096, 8192} at Bk = 65536, D = 512, bf16, and the plain bf16 GEMM's; the
  passes' GB/s (infcl/kernels/chunked_softmax.py: the stats pass with its merge, the grad pass) against a copy;
  S bit for bit: each chunk's scores by the forward's call and again after other products (the backward's
  recomputation), and a whole forward + backward rerun, B = 16384;
- ``million``: one batch of B = 1,048,576, D = 512, bf16, symmetric forward + backward on the route with its
  stated budget (:data:`.plan.MILLION_BUDGET_MB`): the plan (C), time and peak memory.

A dry run: the same on CPU tensors at toy sizes (the products as float32 products, the torch passes)."""

import importlib
import time
from pathlib import Path

import torch

from .. import errors as harness
from .files import route_row
from .plan import Sizes
from .speed import chunk_plan
from .timing import device_for, sync, timed


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 result: cuBLAS's out_dtype on a GPU, float32 copies elsewhere (the route's products)."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def gemm_case(out: Path, c: int, k: torch.Tensor, repeats: int, plain: bool) -> None:
    device, (n_k, d) = k.device, k.shape
    q_c = torch.randn(c, d, device=device).to(torch.bfloat16)
    ds = torch.randn(c, n_k, device=device).to(torch.bfloat16)
    flops = 2 * c * n_k * d
    products = {"scores": lambda: mm32(q_c, k.T), "dq": lambda: mm32(ds, k), "dk": lambda: mm32(ds.T, q_c)}
    if plain:
        products["plain bf16 out"] = lambda: q_c @ k.T
    for name, fn in products.items():
        seconds = timed(fn, device, repeats)
        route_row(out, "gemm", f"C={c} Bk={n_k} D={d}", name, flops / seconds / 1e12, "TFLOP/s",
                  f"{seconds * 1e3:.3f} ms")  # fmt: skip


def pass_case(out: Path, c: int, n_k: int, device: torch.device, repeats: int, dry: bool) -> None:
    from infcl.backends.chunked import torch_passes
    from infcl.kernels.chunked_softmax import pass_bytes
    from infcl.lse import empty_stats

    passes = torch_passes if dry else importlib.import_module("infcl.kernels.chunked_softmax")
    raw = torch.randn(c, n_k, device=device) * 0.3
    pos, scale = torch.arange(c, device=device), torch.tensor(14.0, device=device)
    rows = torch.empty(3, c, device=device)
    extra = ([torch.empty(c, n_k, device=device) for _ in range(2)],) if dry else (empty_stats(n_k, torch.float32,
                                                                                              device),)  # fmt: skip
    cols = passes.chunk_stats(raw.clone(), scale, pos, True, rows, *extra)
    ds = torch.empty(c, n_k, device=device, dtype=torch.float32 if dry else torch.bfloat16)
    g, g_col = torch.full((c,), 1.0 / c, device=device), torch.full((n_k,), 1.0 / n_k, device=device)
    grad_args = (raw, ds, scale, scale, pos, rows[:2].contiguous(), g, cols, g_col, torch.bfloat16)
    grad_args += extra[:1] if dry else ()
    forward_bytes, backward_bytes = pass_bytes(c, n_k, torch.bfloat16, True)
    cases = {
        "copy": (lambda: raw.clone(), 8 * c * n_k),
        "stats pass": (lambda: passes.chunk_stats(raw, scale, pos, True, rows, *extra), forward_bytes),
        "grad pass": (lambda: passes.chunk_grad(*grad_args), backward_bytes),
    }
    for name, (fn, nbytes) in cases.items():
        seconds = timed(fn, device, repeats)
        route_row(out, "passes", f"C={c} Bk={n_k}", name, nbytes / seconds / 1e9, "GB/s", f"{seconds * 1e3:.3f} ms")


def bits_case(out: Path, n: int, dim: int, device: torch.device) -> None:
    from infcl import cal_inf_loss
    from infcl.backends import chunked
    from infcl.backends.chunked.products import Products
    from infcl.contract import Block

    from ..methods import make_inputs

    q, k, scale = make_inputs(n, dim, torch.bfloat16, device)
    block = Block(q=q.detach(), k=k.detach(), scale=scale.detach(), pos=torch.arange(n, device=device))
    plan = chunked.BACKEND.plan(block)
    if not hasattr(plan, "rows"):
        route_row(out, "bits", f"B={n}", "S fwd == bwd bits", "-", "", plan.reason)
    else:
        products, same = Products(block, plan), True
        for c in plan.chunks(n):
            buf = torch.empty(c.stop - c.start, n, device=device)
            first = products.scores(c, buf).clone()
            other = torch.randn(c.stop - c.start, n, device=device).to(plan.ds_dtype)
            mm32(other, k.detach())  # another product between the two, as the backward's dq / dk are
            same &= bool(torch.equal(first, products.scores(c, buf)))
        route_row(out, "bits", f"B={n} C={plan.rows}", "S fwd == bwd bits", int(same))

    def fn(q_, k_, s_):
        return cal_inf_loss(q_, k_, scale=s_, symmetric=True, backend="chunked")

    first, again = harness.grads(fn, q, k, scale), harness.grads(fn, q, k, scale)
    route_row(out, "bits", f"B={n}", "rerun identical", int(all(torch.equal(a, b) for a, b in zip(first, again))))


def step_route(out: Path, sizes: Sizes, dry: bool, part: str = "") -> None:
    device = device_for(dry)
    k = torch.randn(sizes.gemm_cols, sizes.dim, device=device).to(torch.bfloat16)
    for c in sizes.gemm_rows:
        gemm_case(out, c, k, sizes.repeats, plain=c == sizes.gemm_rows[-1])
    k = None
    for c in sizes.pass_rows:
        pass_case(out, c, sizes.gemm_cols, device, sizes.repeats, dry)
    bits_case(out, sizes.bits, sizes.dim, device)


def step_million(out: Path, sizes: Sizes, dry: bool, part: str = "") -> None:
    from infcl import cal_inf_loss
    from infcl.backends import ChunkedBackend

    from ..methods import make_inputs

    device, n = device_for(dry), sizes.million
    case = f"B={n} D={sizes.dim} bf16 symmetric, budget {sizes.million_budget_mb:g} MiB"
    q, k, scale = make_inputs(n, sizes.dim, torch.bfloat16, device)
    route = ChunkedBackend(budget_mb=sizes.million_budget_mb)  # the chunked route with the step's workspace budget
    route_row(out, "million", case, "chunk plan", chunk_plan(q, k, route))
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    cal_inf_loss(q, k, scale=scale, symmetric=True, backend=route).backward()
    sync(device)
    seconds = time.perf_counter() - t0
    peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB" if device.type == "cuda" else "-"
    route_row(out, "million", case, "fwd+bwd", seconds, "s", f"first call (compiles included); peak extra {peak}")
