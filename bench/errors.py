"""The one float64 error harness of the benchmarks: a loss's value and gradients against a float64 truth on the same
inputs, as relative 2-norm errors.

The truth is infcl's torch tiles run in float64 on the same device (exact to ~1e-13 against the materialized
float64 loss, which tests/ check, and never O(B^2) in memory, so it reaches the batches where a float64 vanilla loss
would need hundreds of GB). Everything that compares with float64 calls this module: ``python -m bench``'s
``--preset gpu`` accuracy columns (:mod:`bench.accuracy`), the GPU runner's correctness steps (the fused kernels and
the chunked route, :mod:`bench.gpu_first.correctness`) and ``tools/gpu_check_kern.py``.

- :func:`case_inputs`: unit rows, each k near its q (confident positives, as tests/test_triton_gpu.py builds them);
- :func:`grads`: [loss, dq, dk, dscale, dbias] of ``fn(q, k, scale, bias)`` on fresh leaves (zeros for a leaf the
  loss does not use);
- :func:`relative`: ``|x - truth| / |truth|`` in the 2-norm; :func:`errors`: one per named part;
- :func:`compare`: a method's errors, torch's own loss's in the same dtype (the baseline) and whether a rerun is
  bit-identical, in one row.
"""

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

PARTS = ("loss", "dq", "dk", "dscale", "dbias")
# Relative 2-norm error bounds against float64 beyond the result's own storage floor (tests/test_triton_gpu.py's
# REL_TOL and its _floor: the truth rounded to the result's dtype; float16 gradients of a mean loss lie mostly below
# float16's smallest normal at these batches, so storing them costs ~8e-3 of the norm whatever a kernel computes),
# and ours must be no worse than twice torch's own loss in the same dtype plus VANILLA_SLACK (the same test's).
REL_TOL = {"bfloat16": 1e-2, "float16": 1e-3, "tf32": 2e-2, "float32": 1e-5}
VANILLA_SLACK = 2.0**-9

Loss = Callable[..., torch.Tensor]


def case_inputs(batch: int, dim: int, dtype: torch.dtype, device, seed: int = 0):
    """q, k [batch, dim] in ``dtype``: unit rows, each k near its q (a confident positive per row)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = F.normalize(torch.randn(batch, dim, generator=gen), dim=1)
    k = F.normalize(q + 0.5 * torch.randn(batch, dim, generator=gen) / dim**0.5, dim=1)
    return q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)


def grads(fn: Loss, q, k, scale, bias=None) -> List[torch.Tensor]:
    """[loss, dq, dk, dscale(, dbias)] of ``fn(q, k, scale[, bias])`` on detached leaves; zeros for a leaf the loss
    does not use."""
    given = [t for t in (q, k, scale, bias) if t is not None]
    leaves = [t.detach().clone().requires_grad_(True) for t in given]
    loss = fn(*leaves)
    loss.backward()
    return [loss.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def relative(value: torch.Tensor, truth: torch.Tensor) -> float:
    """``|value - truth| / |truth|`` in the 2-norm, in float64."""
    return float((value.double() - truth.double()).norm() / truth.double().norm().clamp_min(1e-300))


def errors(got: Sequence[torch.Tensor], truth: Sequence[torch.Tensor], parts: Sequence[str] = PARTS) -> Dict:
    """{part: relative error} over the parts both sides have."""
    return {name: relative(a, e) for name, a, e in zip(parts, got, truth)}


def truth_of(fn_of_backend: Callable[[str], Loss], q, k, scale, bias=None) -> List[torch.Tensor]:
    """The float64 truth: ``fn_of_backend("torch")`` (the torch tiles) on float64 copies of the inputs."""
    as64 = [None if t is None else t.double() for t in (q, k, scale, bias)]
    return grads(fn_of_backend("torch"), *as64)


def compare(
    fn: Loss,
    truth: Sequence[torch.Tensor],
    q,
    k,
    scale,
    bias=None,
    dtype_name: str = "bfloat16",
    vanilla: Optional[Loss] = None,
    parts: Sequence[str] = PARTS,
    rerun: bool = True,
) -> Dict:
    """One row: ``fn``'s errors against ``truth`` (``<part>_err``), whether a rerun is bit-identical, the
    tolerance, the worst storage floor (a part's truth rounded to its result's dtype) and whether each error is
    within its floor + the tolerance, and with ``vanilla`` (torch's own loss in the inputs'
    dtype) its worst error and whether ours is no worse than 2 x its + :data:`VANILLA_SLACK` part by part."""
    got = grads(fn, q, k, scale, bias)
    errs = errors(got, truth, parts)
    row = {f"{name}_err": value for name, value in errs.items()}
    if rerun:
        again = grads(fn, q, k, scale, bias)
        row["bit_identical"] = all(torch.equal(a, b) for a, b in zip(got, again))
    floors = {name: relative(e.to(a.dtype), e) for name, a, e in zip(parts, got, truth)}
    row["tolerance"] = REL_TOL[dtype_name]
    row["storage_floor"] = max(floors.values())
    row["within_tol"] = all(errs[n] <= floors[n] + REL_TOL[dtype_name] for n in errs)
    if vanilla is not None:
        theirs = errors(grads(vanilla, q, k, scale, bias), truth, parts)
        row["vanilla_err"] = max(theirs.values())
        row["within_vanilla"] = all(errs[n] <= 2 * theirs[n] + VANILLA_SLACK for n in errs)
    return row
