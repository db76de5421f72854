"""The ``gemm`` step (cuBLAS rates of the route's three products) and the ``passes`` step (GB/s of the stats and
grad passes against a plain copy)."""

import importlib

import torch

from .plan import Sizes
from .rows import Rows
from .timing import device_for, mm32, timed


def gemm_case(rows: Rows, c: int, k: torch.Tensor, repeats: int, plain: bool) -> None:
    device, (n_k, d) = k.device, k.shape
    q_c = torch.randn(c, d, device=device).to(torch.bfloat16)
    ds = torch.randn(c, n_k, device=device).to(torch.bfloat16)
    flops = 2 * c * n_k * d
    products = {"scores": lambda: mm32(q_c, k.T), "dq": lambda: mm32(ds, k), "dk": lambda: mm32(ds.T, q_c)}
    if plain:
        products["plain bf16 out"] = lambda: q_c @ k.T
    for name, fn in products.items():
        seconds = timed(fn, device, repeats)
        rows.add(f"C={c} Bk={n_k} D={d}", name, flops / seconds / 1e12, "TFLOP/s", f"{seconds * 1e3:.3f} ms")


def step_gemm(rows: Rows, sizes: Sizes, dry: bool) -> None:
    k = torch.randn(sizes.gemm_cols, sizes.dim, device=device_for(dry)).to(torch.bfloat16)
    for c in sizes.gemm_rows:
        gemm_case(rows, c, k, sizes.repeats, plain=c == sizes.gemm_rows[-1])


def pass_case(rows: Rows, passes, c: int, n_k: int, device: torch.device, repeats: int, dry: bool) -> None:
    from infcl.kernels.chunked_softmax import pass_bytes

    raw = torch.randn(c, n_k, device=device) * 0.3
    pos, scale = torch.arange(c, device=device), torch.tensor(14.0, device=device)
    out = torch.empty(3, c, device=device)
    extra = ([torch.empty(c, n_k, device=device) for _ in range(2)],) if dry else ()
    cols = passes.chunk_stats(raw.clone(), scale, pos, True, out, *extra)
    ds = torch.empty(c, n_k, device=device, dtype=torch.float32 if dry else torch.bfloat16)
    g, g_col = torch.full((c,), 1.0 / c, device=device), torch.full((n_k,), 1.0 / n_k, device=device)
    grad_args = (raw, ds, scale, scale, pos, out[:2].contiguous(), g, cols, g_col, torch.bfloat16, *extra)
    forward_bytes, backward_bytes = pass_bytes(c, n_k, torch.bfloat16, True)
    cases = {
        "copy": (lambda: raw.clone(), 8 * c * n_k),
        "stats pass": (lambda: passes.chunk_stats(raw, scale, pos, True, out, *extra), forward_bytes),
        "grad pass": (lambda: passes.chunk_grad(*grad_args), backward_bytes),
    }
    for name, (fn, nbytes) in cases.items():
        seconds = timed(fn, device, repeats)
        rows.add(f"C={c} Bk={n_k}", name, nbytes / seconds / 1e9, "GB/s", f"{seconds * 1e3:.3f} ms")


def step_passes(rows: Rows, sizes: Sizes, dry: bool) -> None:
    """The Triton passes on a GPU; the torch passes in a dry run (the interpreter would take minutes)."""
    from infcl.backends.chunked import torch_passes

    passes = torch_passes if dry else importlib.import_module("infcl.kernels.chunked_softmax")
    for c in sizes.pass_rows:
        pass_case(rows, passes, c, sizes.gemm_cols, device_for(dry), sizes.repeats, dry)
