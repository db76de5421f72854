"""Compile-only calls of retrieval_metrics and cal_distill_loss with backend="triton" for a GPU target, for
tests/test_rank_distill_compile.py: the public call runs in a worker
process (TRITON_INTERPRET=0) under :func:`triton_compile.compile_only` (only Triton's active driver is a
stand-in; every launch compiles instead of running), and each compiled kernel's resource row comes back.
This module imports nothing from infcl or triton at the top (the workers set TRITON_INTERPRET first)."""

import os
from typing import Dict, List, NamedTuple

from helpers import triton_compile

# Rows per side: ragged for every block size (triton_compile's); the one-direction and any-positive calls
# take more columns than rows.
ROWS, COLUMNS = triton_compile.RAGGED_BATCH, triton_compile.WIDE_BATCH
DIM, TEACHER_DIM = 1000, 384  # several feature chunks, ragged; a teacher of another width


class RankDistillCall(NamedTuple):
    arch: int
    api: str  # "ranks", "ranks ids", "ranks any", "distill sym", "distill one"
    dtype: str
    precision: str

    def label(self) -> str:
        return f"sm_{self.arch} {self.api} {self.dtype}-{self.precision}"


KINDS = ("ranks", "ranks ids", "ranks any", "distill sym", "distill one")


def calls(full: bool) -> List[RankDistillCall]:
    """Each of :data:`KINDS` on sm_90 in bfloat16 and float32 (ieee); ``full`` adds tf32, float16, float64 and
    sm_80."""
    dtypes = [("bfloat16", "ieee"), ("float32", "ieee")]
    archs = [90]
    if full:
        dtypes += [("float32", "tf32"), ("float16", "ieee"), ("float64", "ieee")]
        archs.append(80)
    return [
        RankDistillCall(arch, kind, dtype, precision) for arch in archs for dtype, precision in dtypes for kind in KINDS
    ]


def floor_calls() -> List[RankDistillCall]:
    """The ranks' and distillation kernels once each (sm_90, bf16), for the oldest Triton infcl supports
    (:func:`triton_compile.floor_calls`)."""
    return [RankDistillCall(90, kind, "bfloat16", "ieee") for kind in ("ranks ids", "distill sym")]


def _run(call: RankDistillCall) -> None:
    import torch

    import infcl

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, call.dtype)
    wide = call.api in ("ranks any", "distill one")
    cols = COLUMNS if wide else ROWS
    q = torch.randn(ROWS, DIM, generator=gen).to(dtype)
    k = torch.randn(cols, DIM, generator=gen).to(dtype)
    if call.api.startswith("ranks"):
        ids = {}
        if call.api != "ranks":
            ids = {name: torch.randint(0, 9, (n,), generator=gen) for name, n in (("q_ids", ROWS), ("k_ids", cols))}
        infcl.retrieval_metrics(q, k, any_positive=call.api == "ranks any", backend="triton", **ids)
        return
    tq = torch.randn(ROWS, TEACHER_DIM, generator=gen).to(dtype)
    tk = torch.randn(cols, TEACHER_DIM, generator=gen).to(dtype)
    scale = torch.tensor(20.0, requires_grad=True)
    loss = infcl.cal_distill_loss(
        q.requires_grad_(), k.requires_grad_(), tq, tk, scale, 30.0, symmetric=not wide, backend="triton"
    )
    loss.backward()


def run_call(call: RankDistillCall) -> Dict:
    """{"call", "error" or "kernels": [resource rows]} of one compile-only call."""
    return triton_compile.report_call(call, lambda: _run(call))


def compile_all() -> List[Dict]:
    """Every call of :func:`calls` (INFCL_COMPILE_FULL=1: the full matrix) in two spawned workers."""
    import concurrent.futures
    import multiprocessing

    full = os.environ.get("INFCL_COMPILE_FULL", "0") == "1"
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(2, context, initializer=triton_compile.init_worker) as pool:
        return list(pool.map(run_call, calls(full)))


def problems(results: List[Dict]) -> List[str]:
    """Errors, spills, shared memory over the target's limit and float atomics, one line each."""
    out = [f"{r['call']}: {r['error']}" for r in results if "error" in r]
    for r in results:
        for row in r.get("kernels", ()):
            if row["spill_bytes"]:
                out.append(f"{r['call']} {row['kernel']}: spills {row['spill_bytes']} bytes ({row['regs']} registers)")
            if row["smem"] > row["smem_limit"]:
                out.append(f"{r['call']} {row['kernel']}: {row['smem']} > {row['smem_limit']} bytes of shared memory")
            if row["float_atomics"]:
                out.append(f"{r['call']} {row['kernel']}: float atomics {row['float_atomics']}")
    return out
