"""Every backend in the regimes training reaches, against the float64 truth on the same values.

Random unit vectors at scale ~14 are where every implementation agrees. Late in CLIP training the
scale reaches 100 and positives sit far above the negatives; retrieval models use unnormalized
embeddings with large norms; bf16 is the default dtype. The rule, for each output (row losses, dq, dk,
dscale): our max error against float64 is at most ``FACTOR`` times the max error of torch's own
vanilla loss in the same dtype, plus ``ULPS`` units of the dtype's epsilon times the output's largest
magnitude (a few roundings of the largest term, which any implementation may differ by).

Triton runs here only under its interpreter, on the smaller cases (each tile op is ~1 ms of Python).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers.support import (
    EXACT_NORMWISE,
    assert_normwise,
    exact_softmax_truth,
    grads_of,
    interpreting_triton,
    margin_features,
    tiled_backends,
    vanilla_loss,
)
from infcl import cal_inf_loss

FACTOR = 2.0
ULPS = 4
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _backends():
    names = list(tiled_backends())
    if interpreting_triton():
        names.append("triton")
    return names


BACKENDS = _backends()


def _confident(gen, bq, bk, d, labels):
    """Unit features whose positive pairs have cosine ~0.99: positives far above every negative."""
    q = F.normalize(torch.randn(bq, d, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(bk, d, generator=gen, dtype=torch.float64), dim=-1)
    k[labels] = F.normalize(q + 0.05 * torch.randn(bq, d, generator=gen, dtype=torch.float64), dim=-1)
    return q, k


# name: (Bq, Bk, D, symmetric, scale, kind of features)
REGIMES = {
    # |S| up to ~1e6: the softmax is one-hot up to rounding, so any mis-rounded recompute shows.
    "unnormalized-huge": (96, 96, 32, True, 100.0, "unnormalized:30"),
    "unnormalized-huge-one-way": (96, 96, 32, False, 100.0, "unnormalized:30"),
    "unnormalized": (130, 130, 32, True, 30.0, "unnormalized:3"),
    "confident-30": (257, 257, 64, True, 30.0, "confident"),
    "confident-100": (257, 257, 64, True, 100.0, "confident"),
    "confident-100-hard-negatives": (100, 300, 64, False, 100.0, "confident"),
}


def _inputs(regime, dtype, seed=0):
    bq, bk, d, symmetric, scale, kind = REGIMES[regime]
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randperm(bk, generator=gen)[:bq]
    if kind == "confident":
        q, k = _confident(gen, bq, bk, d, labels)
    else:
        norm = float(kind.split(":")[1])
        q = norm * torch.randn(bq, d, generator=gen, dtype=torch.float64)
        k = norm * torch.randn(bk, d, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), labels, torch.tensor(scale, dtype=torch.float64), symmetric


def _upstream(n, seed=2):
    """Per-row weights of mixed sign, with zeros and one huge weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    w[::7] = 0.0
    w[n // 2] = 1e4
    return w


def _supported_inputs(backend, regime, dtype):
    """:func:`_inputs`, or a skip where the backend or the dtype cannot take the regime."""
    bq, bk = REGIMES[regime][:2]
    if backend == "triton" and bq * bk > 300 * 300:
        pytest.skip("interpreted Triton: the smaller regimes only")
    if dtype == torch.float16 and REGIMES[regime][5] == "unnormalized:30":
        pytest.skip("|S| ~ 1e6 overflows float16 in the vanilla loss itself: no reference error to compare with")
    return _inputs(regime, dtype)


def _each_regime(regimes):
    """Parametrize a test over every backend, every dtype and ``regimes``."""
    backend = pytest.mark.parametrize("backend", BACKENDS)
    dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
    regime = pytest.mark.parametrize("regime", regimes)
    return lambda test: backend(dtype(regime(test)))


def _max_err(got, truth):
    return float((got.double() - truth).abs().nan_to_num(float("inf")).max())


def _term_sizes(q, k, scale, w):
    """The largest term each output sums, for (row losses, dq, dk, dscale).

    A row loss is (max - positive) + log-sum, built from logits of size max|S|; a row of dq is
    scale * sum_j g (p_j - y_j) k_j, terms up to scale * |g| * max|k| (two of them, p ~ 1 and y = 1,
    cancel on a confident row); dk likewise with q; the scale gradient sums |g| * |q.k| over every row.
    """
    q, k, w = q.double(), k.double(), w.double().abs()
    raw = (q @ k.T).abs().max()
    s = float(scale)
    return (s * raw, s * w.max() * k.abs().max(), s * w.max() * q.abs().max(), w.sum() * raw)


def _check_no_worse(ours, vanilla, truth, dtype, terms, names=("row losses", "dq", "dk", "dscale")):
    eps = torch.finfo(dtype).eps
    for name, o, v, t, term in zip(names, ours, vanilla, truth, terms):
        floor = ULPS * eps * float(term)
        err, ref = _max_err(o, t), _max_err(v, t)
        assert err <= FACTOR * ref + floor, (
            f"{name}: max error {err:.3g} vs float64, torch's own {dtype} vanilla error {ref:.3g} "
            f"(allowed {FACTOR} x that + {ULPS} ulps of the largest term, {floor:.3g})"
        )


def _ours(backend, labels, symmetric, reduction="none"):
    return lambda q_, k_, s_: cal_inf_loss(
        q_, k_, labels, s_, symmetric=symmetric, reduction=reduction, backend=backend
    )


def _vanilla(labels, symmetric, reduction="none"):
    return lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_, symmetric, reduction)


@_each_regime(REGIMES)
def test_no_worse_than_vanilla_in_that_dtype(backend, dtype, regime):
    q, k, labels, scale, symmetric = _supported_inputs(backend, regime, dtype)
    w = _upstream(q.shape[0])
    scale_in = scale.to(torch.float64 if dtype == torch.float64 else torch.float32)
    ours = grads_of(_ours(backend, labels, symmetric), q, k, scale_in, w)
    vanilla = grads_of(_vanilla(labels, symmetric), q, k, scale.to(dtype), w)
    truth = grads_of(_vanilla(labels, symmetric), q.double(), k.double(), scale, w)
    _check_no_worse(ours, vanilla, truth, dtype, _term_sizes(q, k, scale, w))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
@pytest.mark.parametrize("scale", (60.0, 100.0))
def test_confident_rows_are_exact(backend, dtype, symmetric, scale):
    """Rows with 1 - P_pos ~ 1e-11 .. 1e-24 (B=256, D=64), against the cancellation-free float64 truth:
    r = log1p(rest) and 1 - P_pos = rest / (1 + rest) must keep their digits in every backend, where
    the vanilla loss (even in float64) rounds 1 + rest to 1 and loses the whole gradient."""
    q, k, labels = margin_features(256, 64, scale, symmetric, seed=int(scale) + symmetric)
    q, k = q.to(dtype), k.to(dtype)
    scale_t = torch.tensor(scale, dtype=dtype)
    ours = grads_of(_ours(backend, labels, symmetric), q, k, scale_t)
    truth = exact_softmax_truth(q, k, scale_t, labels, symmetric)
    lo, hi = float(truth[0].min()), float(truth[0].max())
    assert 1e-25 < lo < 1e-22 and 1e-17 < hi < 1e-10, f"losses {lo:.3g} .. {hi:.3g}: not the confident regime"
    assert_normwise(ours, truth, EXACT_NORMWISE[dtype], f"{backend} {dtype}")


@_each_regime(("confident-100", "confident-100-hard-negatives", "unnormalized"))
def test_upstream_sign_never_changes_the_path(backend, dtype, regime):
    """grad(-w) == -grad(w) bit for bit: no value takes a different path for a negated upstream gradient."""
    q, k, labels, scale, symmetric = _supported_inputs(backend, regime, dtype)
    w = _upstream(q.shape[0])
    fn = _ours(backend, labels, symmetric)
    plus = grads_of(fn, q, k, scale.float(), w)
    minus = grads_of(fn, q, k, scale.float(), -w)
    for name, a, b in zip(("dq", "dk", "dscale"), plus[1:], minus[1:]):
        assert torch.equal(a, -b), f"{name}: grad(-w) differs from -grad(w) by up to {float((a + b).abs().max()):.3g}"


@_each_regime(("confident-100", "confident-100-hard-negatives", "unnormalized-huge"))
def test_row_losses_never_negative(backend, dtype, regime):
    q, k, labels, scale, symmetric = _supported_inputs(backend, regime, dtype)
    losses = cal_inf_loss(q, k, labels, scale, symmetric=symmetric, reduction="none", backend=backend)
    assert bool((losses >= 0).all()), f"min row loss {float(losses.min()):.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_gradient_of_a_confident_batch(backend):
    """The scale gradient as a sum of per-entry terms, not a difference of two large sums."""
    if backend == "triton":
        pytest.skip("interpreted Triton: B=2049 is too slow; the smaller confident regimes cover its scale gradient")
    gen = torch.Generator().manual_seed(5)
    labels = torch.arange(2049)
    q, k = _confident(gen, 2049, 2049, 128, labels)
    scale = torch.tensor(15.0, dtype=torch.float64)
    ours = grads_of(_ours(backend, None, False, "mean"), q.float(), k.float(), scale.float())
    vanilla = grads_of(_vanilla(None, False, "mean"), q.float(), k.float(), scale.float())
    truth = grads_of(_vanilla(None, False, "mean"), q, k, scale)
    w = torch.full((2049,), 1.0 / 2049, dtype=torch.float64)  # the mean's weight on every row
    _check_no_worse(ours, vanilla, truth, torch.float32, _term_sizes(q, k, scale, w), ("loss", "dq", "dk", "dscale"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_repeat_calls_are_bit_identical(backend, dtype):
    q, k, labels, scale, symmetric = _inputs("confident-30", dtype)
    fn = _ours(backend, labels, symmetric)
    w = _upstream(q.shape[0])
    first, second = grads_of(fn, q, k, scale.float(), w), grads_of(fn, q, k, scale.float(), w)
    for name, a, b in zip(("loss", "dq", "dk", "dscale"), first, second):
        assert torch.equal(a, b), f"{name} differs between two identical calls"


@pytest.mark.parametrize("scale", (np.float32(14.0), np.float64(14.0), np.int64(14), 14, np.array(14.0)), ids=repr)
def test_numpy_and_python_scalar_scales(scale):
    q, k, labels, _, _ = _inputs("confident-30", torch.float64)
    got = cal_inf_loss(q, k, labels, scale, backend="torch")
    want = vanilla_loss(q, k, labels, 14.0)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("shape", ((), (1,)), ids=("0-d", "[1] as open_clip's logit_scale"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16), ids=str)
def test_one_element_tensor_scales_get_gradients_in_their_shape(shape, dtype):
    q, k, labels, _, _ = _inputs("confident-30", torch.float32)
    logit_scale = torch.full(shape, 2.5, dtype=dtype, requires_grad=True)
    cal_inf_loss(q, k, labels, logit_scale.exp(), backend="torch").backward()
    ref = torch.full(shape, 2.5, dtype=dtype, requires_grad=True)
    vanilla_loss(q.double(), k.double(), labels, ref.double().exp()).backward()
    assert logit_scale.grad.shape == logit_scale.shape and logit_scale.grad.dtype == dtype
    assert torch.allclose(logit_scale.grad.double(), ref.grad.double(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("bad", ("14", [14.0], torch.tensor([1, 2]), torch.tensor(3)), ids=repr)
def test_bad_scales_are_rejected_by_name(bad):
    q, k, labels, _, _ = _inputs("confident-30", torch.float32)
    with pytest.raises((TypeError, ValueError), match="scale"):
        cal_inf_loss(q, k, labels, bad)
