"""Every backend against the vanilla loss (F.cross_entropy on materialized float64 logits).

Loss and the gradients of q, k and scale, for odd shapes, hard negatives, symmetric with permutation
labels, all reductions, non-unit upstream gradients, non-contiguous inputs and every float dtype.
"""

import pytest
import torch

from helpers.support import (
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    features_and_labels,
    grads_of,
    tiled_backends,
    vanilla_loss,
)
from infcl import cal_inf_loss
from infcl.backends.torch_tiles import TorchTilesBackend

# (Bq, Bk, D, labels, symmetric): labels "diag" (None), "perm" (a permutation) or "random" (any column).
CASES = (
    (1, 1, 1, "diag", False),
    (1, 1, 1, "diag", True),
    (7, 7, 3, "perm", True),
    (7, 7, 3, "random", False),
    (129, 129, 384, "diag", True),
    (129, 129, 384, "diag", False),
    (257, 257, 1, "perm", True),
    (1000, 1000, 3, "random", False),
    (1000, 1000, 3, "diag", True),
    (33, 257, 1000, "random", False),  # hard negatives: Bk > Bq
    (129, 1000, 384, "random", False),
    (1000, 1000, 1000, "perm", True),
)
REDUCTIONS = ("mean", "sum", "none")
# "torch-small-tiles" runs the torch backend with 5 x 7 tiles so every shape crosses tile edges both ways.
BACKENDS = ("reference", *tiled_backends(), "torch-small-tiles")


@pytest.fixture
def backend_name(request):
    name = request.param
    if name == "torch-small-tiles":
        params = request.node.callspec.params
        if params.get("bq", 0) * params.get("bk", 0) > 200 * 200:  # (7, 7) and (129, 129) cross the tiles already
            pytest.skip("5 x 7 tiles on a large case only repeat what the small cases show, slowly")
        return TorchTilesBackend(5, 7)  # the torch tiles at these sizes, passed by the call
    return name


def make_inputs(bq, bk, d, label_kind, dtype, seed=0):
    q, k, labels = features_and_labels(bq, bk, d, label_kind, dtype, seed)
    scale = torch.tensor(14.3, dtype=torch.float64 if dtype == torch.float64 else torch.float32)  # 1/0.07, CLIP
    return q, k, labels, scale


def upstream_for(reduction, bq, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.rand(bq, generator=gen, dtype=torch.float64) * 2 - 0.5  # mixed signs, non-unit
    return torch.tensor(0.7, dtype=torch.float64)


def run(backend, q, k, labels, scale, symmetric, reduction, upstream):
    def ours(q_, k_, s_):
        return cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, reduction=reduction, backend=backend)

    def truth(q_, k_, s_):
        return vanilla_loss(q_, k_, labels, s_, symmetric, reduction)

    got = grads_of(ours, q, k, scale, upstream)
    want = grads_of(truth, q.double(), k.double(), scale.double(), upstream)
    return got, want


def check_all(got, want, atol, rtol, scale_aware):
    for name, g, w in zip(("loss", "dq", "dk", "dscale"), got, want):
        # fp32 round-off in a D-term dot product scales with the tensor's magnitude, so the absolute
        # tolerance is taken relative to the largest entry.
        a = atol * max(float(w.abs().max()), 1.0) if scale_aware else atol
        assert_close_verbose(g, w, a, rtol, name)


# Every reduction on the small cases; the large ones run "none" (per-item values and gradients).
CASES_BY_REDUCTION = [
    (*case, r) for case in CASES for r in (REDUCTIONS if case[0] * case[1] <= 300 * 300 else ("none",))
]


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("bq,bk,d,label_kind,symmetric,reduction", CASES_BY_REDUCTION)
def test_matches_vanilla(backend_name, dtype, bq, bk, d, label_kind, symmetric, reduction):
    q, k, labels, scale = make_inputs(bq, bk, d, label_kind, dtype)
    got, want = run(backend_name, q, k, labels, scale, symmetric, reduction, upstream_for(reduction, bq))
    assert got[1].dtype == dtype and got[2].dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    check_all(got, want, atol, rtol, scale_aware=dtype != torch.float64)


LOW_PRECISION_CASES = (
    (129, 129, 384, "diag", True),
    (257, 1000, 64, "random", False),
    (1000, 1000, 3, "perm", True),
)


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bq,bk,d,label_kind,symmetric", LOW_PRECISION_CASES)
def test_low_precision_no_worse_than_torch(backend_name, dtype, bq, bk, d, label_kind, symmetric):
    q, k, labels, scale = make_inputs(bq, bk, d, label_kind, dtype)
    upstream = upstream_for("none", bq)
    got, truth = run(backend_name, q, k, labels, scale, symmetric, "none", upstream)
    torch_lowp = grads_of(
        lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_, symmetric, "none"), q, k, scale.to(dtype), upstream
    )
    assert got[1].dtype == dtype and got[2].dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    for name, g, t, w in zip(("loss", "dq", "dk", "dscale"), got, torch_lowp, truth):
        assert_no_worse(g, t, w, atol * max(float(w.abs().max()), 1.0), rtol, name)


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("layout", ("transposed", "sliced"))
def test_non_contiguous_inputs(backend_name, layout):
    gen = torch.Generator().manual_seed(3)
    if layout == "transposed":  # column-major storage
        q = torch.randn(40, 130, generator=gen).T
        k = torch.randn(40, 130, generator=gen).T
    else:  # every other feature of a wider tensor
        q = torch.randn(130, 80, generator=gen)[:, ::2]
        k = torch.randn(130, 80, generator=gen)[:, ::2]
    assert not q.is_contiguous() and not k.is_contiguous()
    labels = torch.randperm(130, generator=gen)
    scale = torch.tensor(2.0)
    for symmetric in (False, True):
        got, want = run(backend_name, q, k, labels, scale, symmetric, "none", upstream_for("none", 130))
        check_all(got, want, *TOLERANCE[torch.float32], scale_aware=True)


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_python_float_scale_and_default_scale(backend_name):
    q, k, labels, _ = make_inputs(50, 60, 16, "random", torch.float64)
    for scale, value in ((None, 1.0), (3.5, 3.5), (2, 2.0)):
        got = cal_inf_loss(q, k, labels, scale, backend=backend_name)
        want = vanilla_loss(q, k, labels, value)
        assert_close_verbose(got, want, 1e-12, 1e-12, f"scale={scale!r}")


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("symmetric", (False, True))
def test_nan_propagates_like_cross_entropy(backend_name, symmetric):
    q, k, labels, scale = make_inputs(20, 20, 8, "perm", torch.float32)
    q[3, 0] = float("nan")
    got = cal_inf_loss(q, k, labels, scale, symmetric=symmetric, reduction="none", backend=backend_name)
    want = vanilla_loss(q.double(), k.double(), labels, scale.double(), symmetric, "none")
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(cal_inf_loss(q, k, labels, scale, symmetric=symmetric, backend=backend_name))


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("symmetric", (False, True))
def test_inf_features_give_nan_loss(backend_name, symmetric):
    q, k, labels, scale = make_inputs(20, 20, 8, "perm", torch.float32)
    q[3, 0] = float("inf")
    want = vanilla_loss(q, k, labels, scale, symmetric)
    got = cal_inf_loss(q, k, labels, scale, symmetric=symmetric, backend=backend_name)
    assert torch.isnan(want)
    assert torch.isnan(got)
