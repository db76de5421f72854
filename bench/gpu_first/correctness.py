"""The ``correctness-*`` steps (one process per operand type, and one for the options): loss and gradients
against the float64 truth (infcl's torch tiles in float64) at B = 4096 / 16384, D = 512, bf16 / fp16 / fp32
with TF32 products, one- and two-directional; labels; ids + guide; SigLIP; each case run twice
(bit-identical?); torch's own loss in the same dtype as the baseline error (correctness.csv)."""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from .files import append_row
from .plan import DIM

CHECK_BATCHES = (4096, 16384)
# Relative 2-norm error bounds against float64, as tests/test_triton_gpu.py's REL_TOL; and ours must be no
# worse than twice torch's own loss in the same dtype plus VANILLA_SLACK (the test's criterion).
REL_TOL = {"bfloat16": 1e-2, "float16": 3e-3, "tf32": 2e-2}
VANILLA_SLACK = 2.0**-9
LOGIT_SCALE = 1 / 0.07
SIGLIP_BIAS = -10.0
IDS_PER_CLASS = 4  # ids + guide: every 4 rows share an id (false negatives beside the diagonal)
GUIDE_DIM, GUIDE_MARGIN = 64, 0.1


@dataclass(frozen=True)
class Case:
    name: str  # "plain", "labels", "ids+guide", "siglip"
    batch: int
    dtype: str  # bfloat16, float16, tf32 (float32 inputs, TF32 products)
    symmetric: bool = True


def correctness_cases(part: str, batches=CHECK_BATCHES) -> List[Case]:
    """The cases of one correctness process: an operand type's plain cases, or the options (bf16)."""
    if part in REL_TOL:
        return [Case("plain", b, part, sym) for b in batches for sym in (True, False)]
    return [
        Case("labels", batches[0], "bfloat16", False),
        Case("ids+guide", batches[0], "bfloat16"),
        *(Case("siglip", b, "bfloat16") for b in batches),
    ]


def _case_inputs(case: Case, seed: int = 0):
    """q, k: unit rows, each k near its q (confident positives, as tests/test_triton_gpu.py builds them)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(case.batch, DIM, device="cuda", generator=gen), dim=1)
    k = F.normalize(q + 0.5 * torch.randn(case.batch, DIM, device="cuda", generator=gen) / DIM**0.5, dim=1)
    dtype = torch.float32 if case.dtype == "tf32" else getattr(torch, case.dtype)
    return q.to(dtype), k.to(dtype)


def _losses(case: Case, q):
    """(ours, truth's, torch's own in the dtype or None): each ``fn(q, k, scale, bias) -> loss``."""
    import torch
    import torch.nn.functional as F

    from infcl import cal_inf_loss, cal_siglip_loss

    batch = case.batch
    if case.name == "siglip":

        def siglip(backend):
            return lambda q_, k_, s, b: cal_siglip_loss(q_, k_, s, b, backend=backend)

        def vanilla(q_, k_, s, b):
            signs = 2 * torch.eye(batch, device=q_.device, dtype=q_.dtype) - 1
            return -F.logsigmoid(signs * (s * q_ @ k_.T + b)).sum() / batch

        return siglip("triton"), siglip("torch"), vanilla
    options, labels = {}, None
    if case.name == "labels":
        labels = torch.randperm(batch, device=q.device, generator=torch.Generator(device=q.device).manual_seed(1))
    if case.name == "ids+guide":
        gen = torch.Generator(device=q.device).manual_seed(2)
        ids = torch.arange(batch, device=q.device) // IDS_PER_CLASS
        guide = tuple(
            F.normalize(torch.randn(batch, GUIDE_DIM, device=q.device, generator=gen), dim=1).to(q.dtype) for _ in "qk"
        )
        options = {"q_ids": ids, "k_ids": ids, "guide": guide, "guide_margin": GUIDE_MARGIN}

    def infcl(backend):
        return lambda q_, k_, s, b: cal_inf_loss(
            q_, k_, labels, s, symmetric=case.symmetric, backend=backend, **options
        )

    def vanilla(q_, k_, s, b):
        logits = s * q_ @ k_.T
        target = torch.arange(batch, device=q_.device) if labels is None else labels
        rows = F.cross_entropy(logits, target)
        return (rows + F.cross_entropy(logits.T, target)) / 2 if case.symmetric else rows

    return infcl("triton"), infcl("torch"), vanilla if case.name != "ids+guide" else None


def _grads(fn, q, k, scale, bias):
    """[loss, dq, dk, dscale, dbias] of ``fn(q, k, scale, bias)`` (zeros for a leaf the loss does not use)."""
    import torch

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, scale, bias)]
    loss = fn(*leaves)
    loss.backward()
    return [loss.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def _rel(value, truth) -> float:
    return float((value.double() - truth).norm() / truth.norm().clamp_min(1e-300))


GRADS = ("loss", "dq", "dk", "dscale", "dbias")


def check_case(case: Case) -> Dict:
    """One case's row: errors of ours and of torch's own loss against float64, whether a rerun is identical."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = case.dtype == "tf32"
    q, k = _case_inputs(case)
    scale = torch.tensor(LOGIT_SCALE, device="cuda")
    bias = torch.tensor(SIGLIP_BIAS, device="cuda")
    ours_fn, truth_fn, vanilla_fn = _losses(case, q)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ours = _grads(ours_fn, q, k, scale, bias)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    again = _grads(ours_fn, q, k, scale, bias)
    truth = _grads(truth_fn, q.double(), k.double(), scale.double(), bias.double())
    used = GRADS if case.name == "siglip" else GRADS[:4]
    errors = {name: _rel(a, e) for name, a, e in zip(GRADS, ours, truth) if name in used}
    row = {
        **{f"{name}_err": value for name, value in errors.items()},
        "first_call_s": first,
        "bit_identical": all(torch.equal(a, b) for a, b in zip(ours, again)),
        "tolerance": REL_TOL[case.dtype],
        "within_tol": max(errors.values()) <= REL_TOL[case.dtype],
    }
    if vanilla_fn is not None:
        theirs = _grads(vanilla_fn, q, k, scale, bias)
        vanilla = {name: _rel(a, e) for name, a, e in zip(GRADS, theirs, truth) if name in used}
        row["vanilla_err"] = max(vanilla.values())
        row["within_vanilla"] = all(errors[n] <= 2 * vanilla[n] + VANILLA_SLACK for n in used)
    return row


def step_correctness(out: Path, part: str, batches=CHECK_BATCHES) -> None:
    import torch

    if part == "options":
        append_row(
            out / "correctness.csv",
            {
                "case": "S bits forward vs dq vs dk",
                "status": "skipped",
                "note": "no hook exposes S from the kernels; bench.static checks that the three compile S from one "
                "MMA layout (tests/test_static_report.py)",
            },
        )
    for case in correctness_cases(part, batches):
        row = {"case": case.name, "batch": case.batch, "dtype": case.dtype, "symmetric": case.symmetric}
        try:
            row.update(status="ok", **check_case(case))
        except Exception as err:  # recorded; the next case runs
            row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
        torch.cuda.empty_cache()
        append_row(out / "correctness.csv", row)
        print(row, flush=True)
