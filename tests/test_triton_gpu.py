"""The Triton kernels on a real GPU, with the device's default configs: skipped without CUDA.

tests/test_triton.py covers the interpreter's matrix and runs on a GPU too (with its GPU-like tilings
pinned). This file adds what only a GPU can run: the per-architecture default tilings and the
autotuned ones, large shapes (B up to 65536, D = 512 / 768 / 1024) in bfloat16, float16, float32 with
IEEE and TF32 products, against a float64 truth, bit-identical reruns, the split plans the SM count
chooses, and, when installed, Inf-CL. One command: ``python -m pytest tests/test_triton_gpu.py -v``.

The float64 truth at these sizes is infcl's tiled PyTorch backend in float64 (never O(B^2) memory;
tests/test_triton.py and tests/test_loss.py pin it to the materialized float64 loss), and below
B = 16384 also torch's own vanilla loss in the inputs' dtype, the baseline ours must not be worse
than.
"""

import importlib.util

import pytest
import torch

from helpers.support import grads_of, vanilla_loss
from infcl import cal_inf_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
GRAD_NAMES = ("loss", "dq", "dk", "dscale")
# Largest B at which torch's own vanilla loss (about 5 [B, B] buffers) is also run, as a baseline.
VANILLA_MAX_B = 16384
# Relative 2-norm error against float64 per dtype and tl.dot precision, beyond the result's own rounding to
# its dtype (:func:`_floor`): the inputs are exact in their dtype, so what remains is dS rounded to the
# operand type for the products (bf16 2^-9, fp16 2^-11, tf32 2^-11, with S's products from TF32-rounded
# operands as well).
REL_TOL = {"bfloat16": 1e-2, "float16": 1e-3, "tf32": 2e-2, "ieee": 1e-5}


def _inputs(batch, dim, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, dim, device=DEVICE, generator=gen), dim=1)
    k = torch.nn.functional.normalize(q + 0.5 * torch.randn(batch, dim, device=DEVICE, generator=gen) / dim**0.5, dim=1)
    return q.to(dtype), k.to(dtype), torch.tensor(1 / 0.07, device=DEVICE)


def _ours(q, k, scale, symmetric, labels=None):
    return grads_of(
        lambda q_, k_, s_: cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, backend="triton"), q, k, scale
    )


def _truth(q, k, scale, symmetric, labels=None):
    return grads_of(
        lambda q_, k_, s_: cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, backend="torch"),
        q.double(),
        k.double(),
        scale.double(),
    )


def _rel(a, e):
    return float((a.double() - e).norm() / e.norm())


def _floor(a, e):
    """The least relative error a result stored in ``a``'s dtype can have: the truth ``e`` rounded to it.
    float16 gradients of a mean loss lie mostly below float16's smallest normal (6.1e-5) at these batches
    (dq ~ scale / B), so their own storage costs 4e-3 (B = 4096) to 8e-3 (B = 16384) of the norm whatever
    the kernels compute; bfloat16 has float32's exponent range."""
    return _rel(e.to(a.dtype), e)


@pytest.fixture(params=("bfloat16", "float16", "tf32", "ieee"))
def precision(request, float32_matmul):
    """(dtype name, dtype); tf32 and ieee are float32 with that tl.dot precision."""
    name = request.param
    if name in ("tf32", "ieee"):
        float32_matmul(name == "tf32")
        return name, torch.float32
    return name, getattr(torch, name)


@pytest.mark.parametrize("batch,dim", ((4096, 512), (8192, 768), (16384, 1024), (65536, 512)))
@pytest.mark.parametrize("symmetric", (True, False))
def test_large_batches_against_float64(precision, batch, dim, symmetric):
    name, dtype = precision
    if batch > 16384 and name == "ieee":
        pytest.skip("fp32 IEEE products run on FMA units: minutes at B = 65536")
    q, k, scale = _inputs(batch, dim, dtype)
    ours, truth = _ours(q, k, scale, symmetric), _truth(q, k, scale, symmetric)
    errors = {n: (_rel(a, e), _floor(a, e)) for n, a, e in zip(GRAD_NAMES, ours, truth)}
    assert all(error <= floor + REL_TOL[name] for error, floor in errors.values()), errors
    if batch <= VANILLA_MAX_B:  # and no worse than torch's own loss in this dtype (norm-wise, x2)
        labels = torch.arange(batch, device=DEVICE)
        theirs = grads_of(lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_, symmetric), q, k, scale)
        for n, a, t, e in zip(GRAD_NAMES, ours, theirs, truth):
            assert _rel(a, e) <= 2 * _rel(t, e) + 2.0**-9, (n, _rel(a, e), _rel(t, e))


def test_confident_large_batch(precision):
    """Scale 100 on near-duplicate pairs: the rows are confident; the gradient at each positive must keep
    its digits (expm1 in fp32 before rounding), which torch's own low-precision loss does not."""
    name, dtype = precision
    q, k, _ = _inputs(8192, 512, dtype, seed=1)
    scale = torch.tensor(100.0, device=DEVICE)
    ours, truth = _ours(q, k, scale, True), _truth(q, k, scale, True)
    labels = torch.arange(8192, device=DEVICE)
    theirs = grads_of(lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_, True), q, k, scale)
    for n, a, t, e in zip(GRAD_NAMES, ours, theirs, truth):
        assert _rel(a, e) <= 2 * _rel(t, e) + 2.0**-9, (n, _rel(a, e), _rel(t, e))


@pytest.mark.parametrize("batch", (512, 20000))  # few row blocks (k splits, backward splits) and many
def test_bit_identical_reruns(batch):
    q, k, scale = _inputs(batch, 768, torch.bfloat16, seed=2)
    first, second = _ours(q, k, scale, True), _ours(q, k, scale, True)
    for n, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), n


def test_autotuned_matches_default(monkeypatch):
    """INFCL_AUTOTUNE=1: every trial starts from restored buffers, so the tuned call's result equals
    the default config's up to the products' summation order."""
    q, k, scale = _inputs(4096, 512, torch.bfloat16, seed=3)
    default = _ours(q, k, scale, True)
    monkeypatch.setenv("INFCL_AUTOTUNE", "1")
    tuned = _ours(q, k, scale, True)
    truth = _truth(q, k, scale, True)
    for n, a, b, e in zip(GRAD_NAMES, tuned, default, truth):
        assert _rel(a, e) <= 1.5 * _rel(b, e) + 2.0**-12, (n, _rel(a, e), _rel(b, e))


def test_torch_compile_traces_the_custom_ops():
    q, k, scale = _inputs(2048, 256, torch.bfloat16, seed=4)
    eager = _ours(q, k, scale, True)

    def loss(q_, k_, s_):
        return cal_inf_loss(q_, k_, scale=s_, symmetric=True, backend="triton")

    compiled = grads_of(torch.compile(loss), q, k, scale)
    for n, a, b in zip(GRAD_NAMES, compiled, eager):
        torch.testing.assert_close(a, b, msg=n)


@pytest.mark.skipif(importlib.util.find_spec("inf_cl") is None, reason="Inf-CL (inf_cl) is not installed")
def test_agrees_with_inf_cl_and_is_no_less_accurate():
    from inf_cl import cal_inf_loss as inf_cl_loss

    q, k, scale = _inputs(8192, 512, torch.float32, seed=5)
    labels = torch.arange(8192, device=DEVICE)
    ours = cal_inf_loss(q, k, labels, scale, backend="triton")
    theirs = inf_cl_loss(q, k, labels, scale, head_dim=256)  # the mean row loss
    truth = vanilla_loss(q.double(), k.double(), labels, scale.double())
    assert abs(float(ours) - float(truth)) <= abs(float(theirs) - float(truth)) + 1e-5
