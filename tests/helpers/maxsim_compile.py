"""Compile-only calls of cal_maxsim_loss with backend="triton" for a GPU target, for tests/test_triton_api_compile.py:
the public call (forward and backward) runs in a worker process (TRITON_INTERPRET=0) under
:func:`triton_compile.compile_only` (only Triton's active driver is a stand-in; every launch compiles instead of
running), and each compiled kernel's resource row comes back. This module imports nothing from infcl or triton at
the top (the workers set TRITON_INTERPRET first)."""

from typing import Dict, List, NamedTuple

from helpers import triton_compile

# Queries, and documents beyond them (negatives, with labels): ragged for every block size.
QUERIES, DOCUMENTS = triton_compile.RAGGED_BATCH, triton_compile.WIDE_BATCH
# The targets the gate compiles for (sm_100 where the wheel's ptxas knows it).
TARGETS = (90, 80, 100)


class MaxSimCall(NamedTuple):
    arch: int
    dtype: str
    precision: str
    dim: int
    lq: int  # query tokens: 32 is one row block; 100 is several (the backward's token chunks)
    lk: int  # document tokens: several ragged document chunks
    ids: bool  # false negatives by ids

    def label(self) -> str:
        dtype = triton_compile.dtype_label(self.dtype, self.precision)
        ids = " ids" if self.ids else ""
        return f"sm_{self.arch} cal_maxsim_loss {dtype} D={self.dim} Lq={self.lq} Lk={self.lk}{ids}"


# ColBERT's shape (D = 128, Lq = 32, Ld = 180, with masks), and a long query over a ragged, wide D with ids.
COLBERT = (128, 32, 180, False)
LONG_QUERY = (1000, 100, 33, True)


def calls(float64_dot: bool) -> List[MaxSimCall]:
    """The ColBERT shape in every dtype the API launches (triton_compile.api_dtypes) on each of :data:`TARGETS`
    whose ptxas is known, and the long query in bf16 and fp32 (ieee) there."""
    out = []
    for arch in TARGETS:
        if not triton_compile.ptxas_knows(arch):
            continue
        for dtype, precision in triton_compile.api_dtypes(arch, False, float64_dot):
            out.append(MaxSimCall(arch, dtype, precision, *COLBERT))
            if (dtype, precision) in (("bfloat16", "ieee"), ("float32", "ieee")):
                out.append(MaxSimCall(arch, dtype, precision, *LONG_QUERY))
    return out


def floor_calls() -> List[MaxSimCall]:
    """The MaxSim kernels once (sm_90, bf16, the ColBERT shape), for the oldest Triton infcl supports
    (:func:`triton_compile.floor_calls`)."""
    return [MaxSimCall(90, "bfloat16", "ieee", *COLBERT)]


def _run(call: MaxSimCall) -> None:
    import torch

    import infcl

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, call.dtype)
    q = torch.randn(QUERIES, call.lq, call.dim, generator=gen).to(dtype).requires_grad_()
    docs = torch.randn(DOCUMENTS, call.lk, call.dim, generator=gen).to(dtype).requires_grad_()
    kwargs = dict(
        q_mask=torch.rand(QUERIES, call.lq, generator=gen) > 0.2,
        docs_mask=torch.rand(DOCUMENTS, call.lk, generator=gen) > 0.2,
        length_normalize=not call.ids,
    )
    if call.ids:
        kwargs.update(q_ids=torch.randint(0, 9, (QUERIES,), generator=gen), k_ids=torch.randint(0, 9, (DOCUMENTS,)))
    scale = torch.tensor(20.0, requires_grad=True)
    labels = torch.randint(0, DOCUMENTS, (QUERIES,), generator=gen)
    infcl.cal_maxsim_loss(q, docs, labels, scale, backend="triton", **kwargs).backward()


def run_call(call: MaxSimCall) -> Dict:
    """{"call", "error" or "kernels": [resource rows]} of one compile-only call."""
    return triton_compile.report_call(call, lambda: _run(call))
