"""The ``correctness-*`` steps (one process per part) on the one float64 harness (:mod:`bench.errors`): loss and
gradients against the float64 truth (infcl's torch tiles in float64) at B = 4096 / 16384, D = 512.

- ``bfloat16``, ``float16``, ``tf32`` (float32 inputs, TF32 products): the fused kernels (``backend="triton"``),
  one- and two-directional;
- ``options`` (bf16): labels (a permutation, one direction); ids + guide; SigLIP (bias -10);
- ``chunked``: the chunked route in chunks of 1024 rows (several chunks a block, so the column stats' merges
  across chunks and the dk accumulation are compared too): bf16 / fp16 / tf32 symmetric, bf16 with labels, bf16
  SigLIP.

Each case runs twice (bit-identical?), and torch's own loss in the same dtype gives the baseline error (``vanilla_err``;
``within_vanilla``: no worse than 2 x torch's own + 2**-9, part by part); ``within_tol``: tests/test_triton_gpu.py's
bound (each part's error within its storage floor, the truth rounded to the result's dtype, + the tolerance).
A dry run: the same cases on CPU tensors at toy sizes, the torch tiles standing in for the fused kernels.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from .. import errors as harness
from .files import append_row
from .plan import Sizes
from .timing import device_for, sync

LOGIT_SCALE = 1 / 0.07
SIGLIP_BIAS = -10.0
IDS_PER_CLASS = 4  # ids + guide: every 4 rows share an id (false negatives beside the diagonal)
GUIDE_DIM, GUIDE_MARGIN = 64, 0.1
GRADS = harness.PARTS
REL_TOL = harness.REL_TOL


@dataclass(frozen=True)
class Case:
    name: str  # "plain", "labels", "ids+guide", "siglip"
    batch: int
    dtype: str  # bfloat16, float16, tf32 (float32 inputs, TF32 products)
    symmetric: bool = True
    backend: str = "triton"  # or "chunked"


def correctness_cases(part: str, batches) -> List[Case]:
    """The cases of one correctness process: an operand type's plain cases, the options (bf16), or the route's."""
    if part == "chunked":
        small = batches[0]
        return [
            *(Case("plain", small, dtype, True, "chunked") for dtype in ("bfloat16", "float16", "tf32")),
            Case("labels", small, "bfloat16", False, "chunked"),
            Case("siglip", small, "bfloat16", True, "chunked"),
        ]
    if part in REL_TOL:
        return [Case("plain", b, part, sym) for b in batches for sym in (True, False)]
    return [
        Case("labels", batches[0], "bfloat16", False),
        Case("ids+guide", batches[0], "bfloat16"),
        *(Case("siglip", b, "bfloat16") for b in batches),
    ]


def _losses(case: Case, q):
    """(ours by backend name, torch's own loss in the dtype or None): each ``fn(q, k, scale, bias) -> loss``."""
    from infcl import cal_inf_loss, cal_siglip_loss

    batch, device = case.batch, q.device
    if case.name == "siglip":

        def siglip(name):
            return lambda q_, k_, s, b: cal_siglip_loss(q_, k_, s, b, backend=name)

        def vanilla(q_, k_, s, b):
            signs = 2 * torch.eye(batch, device=q_.device, dtype=q_.dtype) - 1
            return -F.logsigmoid(signs * (s * q_ @ k_.T + b)).sum() / batch

        return siglip, vanilla
    options, labels = {}, None
    if case.name == "labels":
        labels = torch.randperm(batch, generator=torch.Generator().manual_seed(1)).to(device)
    if case.name == "ids+guide":
        gen = torch.Generator().manual_seed(2)
        ids = torch.arange(batch, device=device) // IDS_PER_CLASS
        guide = tuple(
            F.normalize(torch.randn(batch, GUIDE_DIM, generator=gen), dim=1).to(device, q.dtype) for _ in "qk"
        )
        options = {"q_ids": ids, "k_ids": ids, "guide": guide, "guide_margin": GUIDE_MARGIN}

    def infcl(name):
        return lambda q_, k_, s, b=None: cal_inf_loss(q_, k_, labels, s, symmetric=case.symmetric, backend=name,
                                                       **options)  # fmt: skip

    def vanilla(q_, k_, s, b=None):
        logits = s * q_ @ k_.T
        target = torch.arange(batch, device=q_.device) if labels is None else labels
        rows = F.cross_entropy(logits, target)
        return (rows + F.cross_entropy(logits.T, target)) / 2 if case.symmetric else rows

    return infcl, vanilla if case.name != "ids+guide" else None


def _route(backend: str, sizes: Sizes, dry: bool):
    """What a case's ``backend`` passes: the torch tiles for "triton" in a dry run; for "chunked" the route in chunks
    of at most ``sizes.check_chunk_rows`` rows (its size thresholds lifted: a 4096-row block runs it)."""
    if backend == "chunked":
        from infcl.backends import ChunkedBackend

        return ChunkedBackend(chunk_rows=sizes.check_chunk_rows)
    return "torch" if dry and backend == "triton" else backend


def check_case(case: Case, sizes: Sizes, dry: bool) -> Dict:
    """One case's row through the harness: errors of ours and of torch's own loss against float64, whether a rerun
    is identical, the first call's seconds (its compiles)."""
    device = device_for(dry)
    torch.backends.cuda.matmul.allow_tf32 = case.dtype == "tf32"
    dtype = torch.float32 if case.dtype == "tf32" else getattr(torch, case.dtype)
    q, k = harness.case_inputs(case.batch, sizes.dim, dtype, device)
    scale = torch.tensor(LOGIT_SCALE, device=device)
    bias = torch.tensor(SIGLIP_BIAS, device=device) if case.name == "siglip" else None
    fn_of, vanilla = _losses(case, q)
    ours = fn_of(_route(case.backend, sizes, dry))
    parts = GRADS if bias is not None else GRADS[:4]
    sync(device)
    t0 = time.perf_counter()
    harness.grads(ours, q, k, scale, bias)  # the compiles, outside what is compared
    sync(device)
    first = time.perf_counter() - t0
    truth = harness.truth_of(fn_of, q, k, scale, bias)
    row = harness.compare(ours, truth, q, k, scale, bias, dtype_name=case.dtype, vanilla=vanilla, parts=parts)
    row["first_call_s"] = first
    return row


def step_correctness(out: Path, sizes: Sizes, dry: bool, part: str) -> None:
    if part == "options":
        append_row(out / "correctness.csv", {"case": "S bits forward vs dq vs dk", "status": "skipped",
                   "note": "no hook exposes S from the fused kernels; bench.static checks that the three compile S "
                   "from one MMA layout (tests/test_static_report.py); the route's S bits: route.csv"})  # fmt: skip
    for case in correctness_cases(part, sizes.check):
        row = {"case": case.name, "backend": case.backend, "batch": case.batch, "dtype": case.dtype,
               "symmetric": case.symmetric}  # fmt: skip
        if case.backend == "chunked":
            row["note"] = f"chunk_rows={sizes.check_chunk_rows}"
        try:
            row.update(status="ok", **check_case(case, sizes, dry))
        except Exception as err:  # recorded; the next case runs
            row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
        if not dry:
            torch.cuda.empty_cache()
        append_row(out / "correctness.csv", row)
        print(row, flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
