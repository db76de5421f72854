"""Issue 31: NaN or inf in a guide gives NaN losses (and gradients) for the rows and columns whose exclusions
it decides, on every backend, as NaN features do (docs/numerics.md)."""

import pytest
import torch
import torch.nn.functional as F

from infcl import cal_inf_loss
from infcl.backends import unavailable_reason

NATIVE = unavailable_reason("cpu", torch.device("cpu")) is None
TRITON = unavailable_reason("triton", torch.device("cpu")) is None
BACKENDS = ("reference", "torch") + (("cpu",) if NATIVE else ()) + (("triton",) if TRITON else ())
B = 6


def _inputs():
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, 8, generator=gen), dim=1)
    k = F.normalize(q + 0.3 * torch.randn(B, 8, generator=gen), dim=1)
    return q, k, torch.randn(B, 5, generator=gen), torch.randn(B, 5, generator=gen)


@pytest.mark.parametrize("value", (float("nan"), float("inf")))
@pytest.mark.parametrize("side", ("guide_q", "guide_k"))
@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_guide_row_poisons_the_losses_it_decides(backend, symmetric, side, value):
    q, k, gq, gk = _inputs()
    (gq if side == "guide_q" else gk)[2, 1] = value
    q, k = q.requires_grad_(), k.requires_grad_()
    rows = cal_inf_loss(q, k, None, 10.0, symmetric=symmetric, guide=(gq, gk), reduction="none", backend=backend)
    if not symmetric:
        expected = torch.zeros(B, dtype=torch.bool)
        expected[:] = side == "guide_k"
        expected[2] = True
    else:
        expected = torch.ones(B, dtype=torch.bool)  # a bad row poisons every column, a bad column every row
    assert torch.equal(torch.isnan(rows.detach()), expected), rows
    rows.sum().backward()
    assert torch.isnan(k.grad).any() and torch.isnan(q.grad[2]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_guide_gives_a_finite_loss(backend):
    q, k, gq, gk = _inputs()
    assert torch.isfinite(cal_inf_loss(q, k, None, 10.0, guide=(gq, gk), symmetric=True, backend=backend))
