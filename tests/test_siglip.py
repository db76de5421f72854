"""The sigmoid (SigLIP) loss: every CPU backend against the float64 materialized truth and open_clip.

Loss and the gradients of image, text, scale and bias, for odd shapes (D = 1, 3, 40, 1000), Bk > Bq
with labels, every reduction, negative and non-unit upstream gradients, every float dtype, logits up
to |1e4|, NaN, the parameters' accepted forms, validation, and open_clip's own ``SigLipLoss`` in one
process. The Triton kernels (interpreter) are in test_siglip_triton.py, the ring in test_siglip_ring.py.
"""

import numpy as np
import pytest
import torch

from helpers.support import (
    BF16_ROUTES,
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    features_and_labels,
    force_bf16_route,
    grads_of_inputs,
    open_clip_loss_module,
    siglip_magnitudes,
    siglip_truth,
    tiled_backends,
)
from infcl import InfSigLipLoss, cal_siglip_loss
from infcl.backends.torch_tiles import TorchTilesBackend

GRAD_NAMES = ("loss", "dimage", "dtext", "dscale", "dbias")
# (Bq, Bk, D, labels): labels "diag" (None), "perm" (a permutation) or "random" (any column, repeats allowed).
CASES = (
    (1, 1, 1, "diag"),
    (13, 29, 3, "random"),  # extra negatives, small enough for 5 x 7 tiles
    (129, 129, 40, "diag"),
    (257, 257, 1, "perm"),
    (33, 257, 1000, "random"),  # extra negatives: Bk > Bq
    (129, 1000, 40, "random"),
    (1000, 1000, 3, "diag"),
    (300, 300, 1000, "perm"),
)
REDUCTIONS = ("mean", "sum", "none")
# SigLIP's initialization (t' = log 10, b = -10) and a CLIP-like scale with a small bias.
PARAMS = ((10.0, -10.0), (14.3, -3.0))
# "torch-small-tiles": the torch backend with 5 x 7 tiles, so every shape crosses tile edges both ways.
BACKENDS = ("reference", *tiled_backends(), "torch-small-tiles")


@pytest.fixture
def backend_name(request):
    name = request.param
    if name == "torch-small-tiles":
        bq, bk = request.node.callspec.params.get("case", (0, 0))[:2]
        if bq * bk > 130 * 130:
            pytest.skip("5 x 7 tiles on a large case only repeat what the small cases show, slowly")
        # One thread: on a busy machine BLAS threads spin on 5 x 7 products (10x slower, same results).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        request.addfinalizer(lambda: torch.set_num_threads(threads))
        return TorchTilesBackend(5, 7)  # the torch tiles at these sizes, passed by the call
    return name


make_inputs = features_and_labels  # (image, text, labels)


def upstream_for(reduction, bq, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.rand(bq, generator=gen, dtype=torch.float64) * 2 - 0.5  # mixed signs, non-unit
    return torch.tensor(-0.7 if reduction == "mean" else 1.3, dtype=torch.float64)


def param_tensors(scale, bias, dtype):
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.tensor(scale, dtype=pdtype), torch.tensor(bias, dtype=pdtype)


def run(backend, image, text, labels, scale, bias, reduction, upstream):
    """(ours, truth, magnitudes): (loss, dimage, dtext, dscale, dbias) each, ours in the inputs' dtype,
    the truth and the magnitudes of its terms (support.siglip_magnitudes) in float64."""
    ours = grads_of_inputs(
        lambda i, t, s, b: cal_siglip_loss(i, t, s, b, labels, reduction=reduction, backend=backend),
        (image, text, scale, bias),
        upstream,
    )
    truth = grads_of_inputs(
        lambda i, t, s, b: siglip_truth(i, t, s, b, labels, reduction),
        (image.double(), text.double(), scale.double(), bias.double()),
        upstream,
    )
    return ours, truth, siglip_magnitudes(image, text, scale, bias, labels, reduction, upstream)


def assert_all_close(ours, truth, magnitudes, dtype, what):
    atol, rtol = TOLERANCE[dtype]
    for name, got, want, size in zip(GRAD_NAMES, ours, truth, magnitudes):
        assert_close_verbose(got, want, atol, rtol, f"{what} {name}", magnitude=size)


# Every case in float64 and float32, the reduction cycling so that each backend sees every (dtype,
# reduction) pair: the reductions only scale the upstream gradient, the cases are what differs.
EXACT = [
    pytest.param(
        case,
        dtype,
        REDUCTIONS[(i + j) % 3],
        id=f"{case[0]}x{case[1]}x{case[2]}-{case[3]}-{dtype}-{REDUCTIONS[(i + j) % 3]}",
    )
    for i, case in enumerate(CASES)
    for j, dtype in enumerate((torch.float64, torch.float32))
]


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("case,dtype,reduction", EXACT)
def test_matches_float64_truth(backend_name, case, dtype, reduction):
    bq, bk, d, label_kind = case
    image, text, labels = make_inputs(bq, bk, d, label_kind, dtype)
    scale, bias = param_tensors(*PARAMS[bq % 2], dtype)
    ours, *truth = run(backend_name, image, text, labels, scale, bias, reduction, upstream_for(reduction, bq))
    assert ours[0].dtype == dtype, f"loss dtype {ours[0].dtype}"
    assert ours[1].dtype == dtype and ours[3].dtype == scale.dtype
    assert_all_close(ours, *truth, dtype, f"{backend_name} {case} {dtype} {reduction}")


LOW_PRECISION_CASES = ((65, 65, 40, "diag"), (33, 257, 1000, "random"), (257, 257, 3, "perm"))


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}" for c in LOW_PRECISION_CASES])
def test_low_precision_no_worse_than_torch(backend_name, case, dtype):
    check_low_precision(backend_name, case, dtype)


def check_low_precision(backend_name, case, dtype):
    bq, bk, d, label_kind = case
    image, text, labels = make_inputs(bq, bk, d, label_kind, dtype)
    scale, bias = param_tensors(10.0, -10.0, dtype)
    upstream = upstream_for("mean", bq)
    ours, truth, _ = run(backend_name, image, text, labels, scale, bias, "mean", upstream)
    # torch's own loss in this dtype: logits, logsigmoid and the gradients all in bfloat16 / float16.
    vanilla = grads_of_inputs(
        lambda i, t, s, b: siglip_truth(i, t, s.to(dtype), b.to(dtype), labels), (image, text, scale, bias), upstream
    )
    atol, rtol = TOLERANCE[dtype]
    assert ours[0].dtype == torch.float32 and ours[1].dtype == dtype
    for name, got, lowp, want in zip(GRAD_NAMES, ours, vanilla, truth):
        assert_no_worse(got, lowp, want, atol, rtol, f"{backend_name} {case} {dtype} {name}")


def _exact_large_logits(dtype):
    """Features whose logits are exact in float32 and reach |1e4|: entries in {-1/2, 0, 1/2} (D=8), so
    q.k is a multiple of 1/4 in [-2, 2], times scale 4096 plus bias -1024: logits in [-9216, 7168] in
    steps of 1024, with many exactly at 0 (sigmoid 1/2) and the rest saturated."""
    gen = torch.Generator().manual_seed(3)
    image = torch.randint(-1, 2, (37, 8), generator=gen).to(dtype) / 2
    text = torch.randint(-1, 2, (41, 8), generator=gen).to(dtype) / 2
    image[0], text[0], text[1] = 0.5, -0.5, 0.5  # the extremes: q.k = -2 and 2
    labels = torch.randint(0, 41, (37,), generator=gen)
    return image, text, labels


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_logits_up_to_1e4_are_stable(backend_name, dtype):
    """Softplus form, never log(sigmoid(x)): -log(sigmoid(-1e4)) would be log(0) = -inf."""
    image, text, labels = _exact_large_logits(dtype)
    scale, bias = param_tensors(4096.0, -1024.0, dtype)
    logits = scale.double() * image.double() @ text.double().T + bias.double()
    assert logits.min() == -9216 and (logits == 0).any()
    upstream = upstream_for("sum", 37)
    ours, *truth = run(backend_name, image, text, labels, scale, bias, "sum", upstream)
    for t in ours:
        assert torch.isfinite(t).all()
    assert_all_close(ours, *truth, dtype, f"{backend_name} |logits| <= 1e4 {dtype}")


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_nan_in_nan_out(backend_name):
    image, text, _ = make_inputs(9, 9, 5, "diag", torch.float32)
    image[3, 2] = float("nan")
    rows = cal_siglip_loss(image, text, 10.0, -10.0, reduction="none", backend=backend_name)
    assert torch.isnan(rows[3]) and torch.isfinite(torch.cat((rows[:3], rows[4:]))).all()


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_parameter_forms(backend_name):
    """Floats, NumPy scalars, 0-d and open_clip's [1] tensors; each tensor's gradient comes back in its shape."""
    image, text, _ = make_inputs(11, 11, 6, "diag", torch.float32)
    want = siglip_truth(image.double(), text.double(), 10.0, -10.0)
    for scale, bias in ((10.0, -10.0), (np.float32(10.0), np.array([-10.0])), (10, None)):
        got = cal_siglip_loss(image, text, scale, bias, backend=backend_name)
        expected = want if bias is not None else siglip_truth(image.double(), text.double(), 10.0, 0.0)
        assert_close_verbose(got, expected, *TOLERANCE[torch.float32], f"{backend_name} {type(scale)} {type(bias)}")
    scale = torch.full((1,), 10.0, requires_grad=True)
    bias = torch.full((1,), -10.0, dtype=torch.float64, requires_grad=True)
    cal_siglip_loss(image, text, scale, bias, backend=backend_name).backward()
    assert scale.grad.shape == (1,) and scale.grad.dtype == torch.float32
    assert bias.grad.shape == (1,) and bias.grad.dtype == torch.float64


@pytest.mark.parametrize("backend_name", BACKENDS, indirect=True)
def test_matches_open_clip_siglip_loss(backend_name):
    """open_clip's SigLipLoss (loaded by file) in one process: loss and every gradient, float32."""
    siglip = open_clip_loss_module().SigLipLoss()
    image, text, _ = make_inputs(64, 64, 32, "diag", torch.float32, seed=5)
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    theirs = grads_of_inputs(siglip, (image, text, scale, bias))
    ours = grads_of_inputs(
        lambda i, t, s, b: cal_siglip_loss(i, t, s, b, backend=backend_name), (image, text, scale, bias)
    )
    module = grads_of_inputs(
        lambda i, t, s, b: InfSigLipLoss(backend=backend_name)(i, t, s, b, output_dict=True)["contrastive_loss"],
        (image, text, scale, bias),
    )
    for name, a, b, m in zip(GRAD_NAMES, ours, theirs, module):
        assert_close_verbose(a, b, *TOLERANCE[torch.float32], f"{backend_name} vs open_clip: {name}")
        assert torch.equal(a, m), f"InfSigLipLoss differs from cal_siglip_loss in {name}"


def test_module_accepts_open_clip_arguments():
    image, text, _ = make_inputs(5, 5, 4, "diag", torch.float32)
    for dist_impl in (None, "bidir", "shift", "reduce", "gather"):
        InfSigLipLoss(cache_labels=True, rank=0, world_size=1, dist_impl=dist_impl)(image, text, 10.0, -10.0)
    with pytest.raises(ValueError, match=r"dist_impl must be one of .*got 'ring'"):
        InfSigLipLoss(dist_impl="ring")
    with pytest.raises(
        ValueError, match=r"rank=1, world_size=2\) does not match the process group: this process is rank 0 of 1"
    ):
        InfSigLipLoss(rank=1, world_size=2)(image, text, 10.0, -10.0)


IMAGE = torch.randn(6, 4)
TEXT = torch.randn(6, 4)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(image=IMAGE.numpy()), TypeError, r"image must be a torch.Tensor"),
        (dict(text=TEXT.long()), TypeError, r"text must be a floating-point tensor.*int64"),
        (dict(image=IMAGE[0]), ValueError, r"image must be 2-d \[batch, dim\], got shape \[4\]"),
        (dict(text=TEXT[:0]), ValueError, r"text is an empty batch: shape \[0, 4\]"),
        (dict(text=torch.randn(6, 5)), ValueError, r"same feature dimension: image \[6, 4\], text \[6, 5\]"),
        (dict(text=TEXT.double()), TypeError, r"same dtype: image torch.float32, text torch.float64"),
        (dict(text=torch.randn(9, 4)), ValueError, r"labels=None means the diagonal.*image \[6, 4\], text \[9, 4\]"),
        (
            dict(labels=torch.zeros(5, dtype=torch.long)),
            ValueError,
            r"labels must have shape \[Bq\] = \[6\], got \[5\]",
        ),
        (dict(labels=torch.zeros(6)), TypeError, r"labels must be an integer tensor, got torch.float32"),
        (dict(labels=torch.tensor([0, 1, 2, 3, 4, 6])), ValueError, r"labels must be column indices in \[0, 6\)"),
        (dict(reduction="avg"), ValueError, r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
        (dict(backend="cuda"), ValueError, r"backend must be one of .*got 'cuda'"),
        (dict(scale="10"), TypeError, r"scale must be a float or a one-element floating tensor, got str"),
        (dict(scale=torch.ones(2)), ValueError, r"scale must be a 0-d or one-element tensor, got shape \[2\]"),
        (dict(bias=True), TypeError, r"bias must be a float or a one-element floating tensor, got bool"),
        (dict(bias=torch.tensor(-10)), TypeError, r"bias must be a floating tensor, got torch.int64"),
        (dict(bias=torch.zeros(1, 2)), ValueError, r"bias must be a 0-d or one-element tensor, got shape \[1, 2\]"),
    ],
)
def test_bad_input_raises(kwargs, error, match):
    args = dict(image=IMAGE, text=TEXT, scale=10.0, bias=-10.0)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        cal_siglip_loss(**args)


needs_native = pytest.mark.skipif("cpu" not in tiled_backends(), reason="the native CPU kernel is not built here")


@needs_native
def test_native_ops_pass_opcheck():
    """Schema (in-place dq / dk declared), fake impls and the real kernels agree."""
    image, text, _ = make_inputs(40, 50, 8, "diag", torch.float32)
    pos = torch.randint(-1, 50, (40,))
    torch.library.opcheck(torch.ops.infcl.sigmoid_forward_block.default, (image, text, 10.0, pos, -10.0))
    args = (image, text, 10.0, pos, -10.0, torch.rand(40), torch.zeros(40, 8), torch.zeros(50, 8))
    torch.library.opcheck(torch.ops.infcl.sigmoid_backward_block.default, args)


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_native_is_bit_identical_run_to_run(dtype):
    """Lanes of rows, dk and parameter sums merged in lane order: no result depends on scheduling."""
    image, text, labels = make_inputs(700, 1100, 64, "random", dtype)
    runs = [
        grads_of_inputs(
            lambda *a: cal_siglip_loss(*a, labels, backend="cpu"),
            (image, text, *param_tensors(10.0, -10.0, dtype)),
        )
        for _ in range(2)
    ]
    for name, a, b in zip(GRAD_NAMES, *runs):
        assert torch.equal(a, b), name


# The bfloat16 GEMM routes of csrc/common.h (support.BF16_ROUTES; INFCL_BF16_GEMM forces one): every one
# this CPU can take, on the low-precision cases plus one that crosses key tiles with odd D, an odd last
# row tile (37 rows) and an odd last key tile (5 columns), where brgemm's even-depth padding matters.
ROUTE_CASES = (*LOW_PRECISION_CASES, (517, 1029, 63, "random"))


def _force_bf16_route(monkeypatch, route):
    image, text, _ = make_inputs(2, 2, 2, "diag", torch.bfloat16)
    force_bf16_route(
        monkeypatch, route, lambda: torch.ops.infcl.sigmoid_forward_block(image, text, 1.0, torch.arange(2), 0.0)
    )


@needs_native
@pytest.mark.parametrize("route", BF16_ROUTES)
@pytest.mark.parametrize("case", ROUTE_CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}" for c in ROUTE_CASES])
def test_native_bf16_routes_no_worse_than_torch(monkeypatch, route, case):
    _force_bf16_route(monkeypatch, route)
    check_low_precision("cpu", case, torch.bfloat16)


@needs_native
@pytest.mark.parametrize("route", BF16_ROUTES)
def test_native_bf16_routes_nan_in_nan_out(monkeypatch, route):
    _force_bf16_route(monkeypatch, route)
    image, text, _ = make_inputs(9, 9, 5, "diag", torch.bfloat16)
    image[3, 2] = float("nan")
    rows = cal_siglip_loss(image, text, 10.0, -10.0, reduction="none", backend="cpu")
    assert torch.isnan(rows[3]) and torch.isfinite(torch.cat((rows[:3], rows[4:]))).all()


@needs_native
def test_native_bf16_route_override_is_checked(monkeypatch):
    monkeypatch.setenv("INFCL_BF16_GEMM", "amx")
    image, text, _ = make_inputs(2, 2, 2, "diag", torch.bfloat16)
    with pytest.raises(RuntimeError, match="INFCL_BF16_GEMM must be auto, mkl, brgemm or float32, got 'amx'"):
        cal_siglip_loss(image, text, 10.0, -10.0, backend="cpu")
