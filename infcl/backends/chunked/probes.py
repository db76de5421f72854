"""Which of torch's float32-output products run on a device, for bfloat16 operands: the chunked route needs
``torch.mm(a, b, out_dtype=torch.float32, out=view)`` (``aten::mm.dtype_out``: S written into its workspace), and
accumulates dq and dk inside the GEMM with ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``
(``aten::addmm.dtype_out``, beta = 1) where it runs, else through a float32 product and an add.

torch 2.13's CPU build registers every overload (``mm``, ``addmm``, ``baddbmm``, ``bmm``: ``dtype``, ``dtype_out``)
and has a kernel for none of them (NotImplementedError); torch 2.4 to 2.7 reject the keyword. :func:`probe_out_dtype`
says what runs on a GPU (the A/B records it: ``bench`` calls it by name).
"""

import functools
from typing import Callable, Dict

import torch

F32 = torch.float32
# Small integers: every product and sum is exact in bfloat16 operands with float32 sums, so a right answer is
# bit-exact and a rounded (bfloat16) result or a dropped accumulator shows.
_N = 16


def _operands(device: torch.device):
    a = (torch.arange(_N * _N, device=device) % 7 - 3).to(torch.bfloat16).view(_N, _N)
    b = (torch.arange(_N * _N, device=device) % 5 - 2).to(torch.bfloat16).view(_N, _N)
    acc = torch.full((_N, _N), 0.5, device=device)  # a float32-only value checks that the sum kept it
    # 257 = 2**8 + 1 is not a bfloat16: a product rounded to bfloat16 loses it.
    big = torch.full((_N, _N), 257.0, device=device)
    return a, b, acc, big


def _cases(device: torch.device) -> Dict[str, Callable[[], bool]]:
    a, b, acc, big = _operands(device)
    exact = a.to(F32) @ b.to(F32)  # float32 products of exact integers: exact

    def mm_dtype():
        return torch.equal(torch.mm(a, b, out_dtype=F32), exact)

    def mm_dtype_out():
        out = torch.empty(_N, _N, device=device)
        got = torch.mm(a, b, out_dtype=F32, out=out)
        return got.data_ptr() == out.data_ptr() and torch.equal(out, exact)

    def addmm_dtype():
        return torch.equal(torch.addmm(acc + big, a, b, out_dtype=F32), acc + big + exact)

    def addmm_dtype_out_in_place():
        into = acc + big
        got = torch.addmm(into, a, b, out_dtype=F32, out=into)
        return got.data_ptr() == into.data_ptr() and torch.equal(into, acc + big + exact)

    def baddbmm_dtype_out_in_place():
        into = (acc + big)[None]
        got = torch.baddbmm(into, a[None], b[None], out_dtype=F32, out=into)
        return got.data_ptr() == into.data_ptr() and torch.equal(into[0], acc + big + exact)

    return {
        "mm.dtype": mm_dtype,
        "mm.dtype_out": mm_dtype_out,
        "addmm.dtype": addmm_dtype,
        "addmm.dtype_out in place": addmm_dtype_out_in_place,
        "baddbmm.dtype_out in place": baddbmm_dtype_out_in_place,
    }


def probe_out_dtype(device) -> Dict[str, str]:
    """For bfloat16 operands into float32 on ``device``: {"mm.dtype", "mm.dtype_out", "addmm.dtype",
    "addmm.dtype_out in place" (``out`` is the accumulator, beta = 1), "baddbmm.dtype_out in place"} -> "runs",
    "wrong result" (it ran, but not bit-exact on integers: rounded to bfloat16, or the accumulator dropped) or
    "<Error>: <message>". What the route uses: :func:`scores_runs` and :func:`accumulates_in_gemm`."""
    device = torch.device(device)
    answers = {}
    for name, case in _cases(device).items():
        try:
            answers[name] = "runs" if case() else "wrong result"
        except (TypeError, RuntimeError, NotImplementedError) as err:
            answers[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return answers


@functools.lru_cache(maxsize=None)
def _answers(device: torch.device) -> Dict[str, str]:
    return probe_out_dtype(device)


def scores_runs(device: torch.device) -> bool:
    """Whether S can be written as float32 into the workspace from bfloat16 / float16 operands on ``device``
    (``aten::mm.dtype_out``: torch >= 2.8 on CUDA)."""
    return _answers(device)["mm.dtype_out"] == "runs"


def accumulates_in_gemm(device: torch.device) -> bool:
    """Whether dq and dk accumulate inside the GEMM on ``device`` (``aten::addmm.dtype_out`` with ``out`` the
    float32 accumulator, beta = 1); else the route adds a float32 product (:mod:`.plan` counts its buffer)."""
    return _answers(device)["addmm.dtype_out in place"] == "runs"
