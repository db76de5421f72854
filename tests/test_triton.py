"""The Triton backend against the float64 vanilla loss: loss and gradients of q, k and the scale.

Without CUDA these run the kernels in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1). The interpreter runs each program in Python, so the matrix is chosen, not crossed
for every dtype: every B x D x symmetric in float64 (exact to 1e-10), every B x D in float32 (one loss
per D), three shapes in float16/bfloat16 (no worse than torch in that dtype), plus strides, labels with
Bk > Bq, non-unit upstream gradients, small tiles, the block contract alone and NaN.
GPU-only tests at the end are skipped without CUDA.
"""

import importlib.util

import pytest
import torch

from infcl import cal_inf_loss
from infcl.backends import resolve_backend, unavailable_reason
from support import TOLERANCE, assert_close_verbose, assert_no_worse, grads_of, vanilla_loss

pytestmark = pytest.mark.skipif(
    unavailable_reason("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu")) is not None,
    reason="triton backend unavailable here (no CUDA and TRITON_INTERPRET unset)",
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCHES = (1, 33, 130)  # 130 = two full 64-row blocks and a ragged one
DIMS = (16, 40, 72, 200)  # 16: one exact chunk; 40: one masked chunk; 72, 200: several chunks, last ragged
GRAD_NAMES = ("loss", "dq", "dk", "dscale")


@pytest.fixture(autouse=True)
def gpu_tiling(monkeypatch):
    """Run every test with the GPU's tile sizes (the interpreter would otherwise pick one big tile)."""
    from infcl.backends import triton_backend
    from infcl.kernels import triton_backward, triton_lse_forward

    monkeypatch.setattr(triton_backend.BACKEND, "forward_config", triton_lse_forward.DEFAULT_CONFIG)
    monkeypatch.setattr(triton_backend.BACKEND, "backward_config", triton_backward.DEFAULT_CONFIG)


def _inputs(bq, bk, dim, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bq, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(bk, dim, generator=gen, dtype=torch.float64)
    # Unit-norm features times a CLIP-like scale: logits in [-scale, scale], as in training.
    q = torch.nn.functional.normalize(q, dim=1).to(device=DEVICE, dtype=dtype)
    k = torch.nn.functional.normalize(k, dim=1).to(device=DEVICE, dtype=dtype)
    scale = torch.tensor(14.3, dtype=torch.float64, device=DEVICE)
    return q, k, scale


def _labels(bq, bk, symmetric, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if symmetric:
        return torch.randperm(bq, generator=gen).to(DEVICE)
    return torch.randperm(bk, generator=gen)[:bq].to(DEVICE)


def _compare(q, k, scale, labels=None, symmetric=False, reduction="mean", upstream=None):
    """Our (loss, dq, dk, dscale) in q's dtype and the float64 vanilla truth on the same values."""
    ours = grads_of(
        lambda q_, k_, s_: cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, reduction=reduction, backend="triton"),
        q, k, scale, upstream,
    )
    truth = grads_of(
        lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_, symmetric, reduction),
        q.double(), k.double(), scale, upstream,
    )
    return ours, truth


def _assert_exact(ours, truth, dtype, what):
    atol, rtol = TOLERANCE[dtype]
    for name, a, e in zip(GRAD_NAMES, ours, truth):
        assert_close_verbose(a, e, atol, rtol, f"{what} {name}")


@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("batch", BATCHES)
def test_float64_matches_vanilla(batch, dim, symmetric):
    q, k, scale = _inputs(batch, batch, dim)
    labels = _labels(batch, batch, True, seed=dim) if symmetric else None
    ours, truth = _compare(q, k, scale, labels, symmetric)
    _assert_exact(ours, truth, torch.float64, f"B={batch} D={dim} symmetric={symmetric}")


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("batch", BATCHES)
def test_float32_matches_vanilla(batch, dim):
    symmetric = dim in (40, 200)  # the float64 test crosses both losses; here half the dims each
    q, k, scale = _inputs(batch, batch, dim, dtype=torch.float32)
    ours, truth = _compare(q, k, scale, symmetric=symmetric, reduction="sum")
    _assert_exact(ours, truth, torch.float32, f"B={batch} D={dim} symmetric={symmetric}")


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_hard_negatives_with_labels(dtype):
    """Bk > Bq: the extra k rows are negatives only; labels point anywhere in [0, Bk)."""
    q, k, scale = _inputs(33, 150, 72, seed=3, dtype=dtype)
    ours, truth = _compare(q, k, scale, _labels(33, 150, False))
    _assert_exact(ours, truth, dtype, "Bq=33 Bk=150")


@pytest.mark.parametrize("symmetric", (False, True))
def test_non_unit_upstream_gradient(symmetric):
    q, k, scale = _inputs(65, 65, 40, seed=4)
    upstream = torch.randn(65, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    labels = _labels(65, 65, True) if symmetric else None
    ours, truth = _compare(q, k, scale, labels, symmetric, reduction="none", upstream=upstream)
    _assert_exact(ours, truth, torch.float64, f"upstream symmetric={symmetric}")


def test_strided_inputs():
    """Column-major k and a q that skips every other feature: the kernels read through the strides."""
    q_wide, k, scale = _inputs(40, 40, 144, seed=6)
    q = q_wide[:, ::2]  # stride (144, 2)
    k = k[:, :72].T.contiguous().T  # stride (1, 40)
    assert not q.is_contiguous() and not k.is_contiguous()
    ours, truth = _compare(q, k, scale, _labels(40, 40, True), symmetric=True)
    _assert_exact(ours, truth, torch.float64, "strided")


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("bq,bk,dim,symmetric", ((130, 130, 72, True), (33, 33, 200, False), (33, 150, 40, False)))
def test_low_precision_no_worse_than_torch(dtype, bq, bk, dim, symmetric):
    q, k, scale = _inputs(bq, bk, dim, seed=7, dtype=dtype)
    labels = _labels(bq, bk, symmetric)
    ours, truth = _compare(q, k, scale, labels, symmetric)
    torch_lowp = grads_of(lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_.to(dtype), symmetric), q, k, scale)
    atol, rtol = TOLERANCE[dtype]
    for name, a, t, e in zip(GRAD_NAMES, ours, torch_lowp, truth):
        assert_no_worse(a, t, e, atol, rtol, f"{dtype} Bq={bq} Bk={bk} D={dim} {name}")


def test_small_tiles_many_blocks(monkeypatch):
    """16 x 32 tiles over 33 x 70: several ragged row and column blocks in both kernels."""
    from infcl.backends import triton_backend
    from infcl.kernels import TileConfig

    monkeypatch.setattr(triton_backend.BACKEND, "forward_config", TileConfig(block_m=16, block_n=32))
    monkeypatch.setattr(triton_backend.BACKEND, "backward_config", TileConfig(block_m=32, block_n=16))
    q, k, scale = _inputs(33, 70, 40, seed=8)
    ours, truth = _compare(q, k, scale, _labels(33, 70, False))
    _assert_exact(ours, truth, torch.float64, "small tiles")


def test_default_tiles(monkeypatch):
    """No config: the interpreter's big tiles here (INTERPRETER_CONFIG), the GPU's defaults on a GPU."""
    from infcl.backends import triton_backend

    monkeypatch.setattr(triton_backend.BACKEND, "forward_config", None)
    monkeypatch.setattr(triton_backend.BACKEND, "backward_config", None)
    q, k, scale = _inputs(260, 260, 1030, seed=15, dtype=torch.float32)
    ours, truth = _compare(q, k, scale, _labels(260, 260, True), symmetric=True)
    _assert_exact(ours, truth, torch.float32, "default tiles")


def test_block_contract_matches_torch_tiles():
    """forward_block/backward_block alone: same outputs as the torch tiles, accumulating into given dq/dk."""
    from infcl.backends.torch_tiles import TORCH_TILES
    from infcl.backends.triton_backend import BACKEND

    q, k, _ = _inputs(33, 50, 40, seed=9)
    gen = torch.Generator().manual_seed(10)
    row_lse = torch.randn(33, generator=gen, dtype=torch.float64).to(DEVICE) + 5
    col_lse = torch.randn(50, generator=gen, dtype=torch.float64).to(DEVICE) + 5
    g_row = torch.randn(33, generator=gen, dtype=torch.float64).to(DEVICE)
    g_col = torch.randn(50, generator=gen, dtype=torch.float64).to(DEVICE)
    start_dq = torch.randn(33, 40, generator=gen, dtype=torch.float64).to(DEVICE)
    start_dk = torch.randn(40, 50, generator=gen, dtype=torch.float64).to(DEVICE).T  # strided accumulator

    for name, a, e in zip(("row_lse", "col_lse"), BACKEND.forward_block(q, k, 3.0, True), TORCH_TILES.forward_block(q, k, 3.0, True)):
        assert_close_verbose(a, e, 1e-12, 1e-12, f"forward_block {name}")
    assert BACKEND.forward_block(q, k, 3.0, False)[1] is None

    for cols in ((col_lse, g_col), (None, None)):
        results = []
        for backend in (BACKEND, TORCH_TILES):
            dq, dk = start_dq.clone(), start_dk.clone()
            ds_row, ds_col = backend.backward_block(q, k, 3.0, row_lse, g_row, *cols, dq, dk)
            results.append((dq, dk, ds_row, ds_col))
        for name, a, e in zip(("dq", "dk", "dscale_row", "dscale_col"), *results):
            assert_close_verbose(a, e, 1e-10, 1e-10, f"backward_block {name} symmetric={cols[0] is not None}")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in the interpreter
def test_nan_in_nan_out():
    q, k, scale = _inputs(33, 33, 16, seed=11)
    q[5, 3] = float("nan")
    loss = cal_inf_loss(q, k, scale=scale, reduction="none", backend="triton")
    expected = vanilla_loss(q, k, scale=scale, reduction="none")
    assert torch.equal(torch.isnan(loss), torch.isnan(expected)) and torch.isnan(loss[5])


def test_auto_picks_triton_for_cuda_tensors():
    assert resolve_backend("auto", torch.device("cuda")) == "triton"


def test_unavailable_reason_is_a_sentence_elsewhere():
    assert "CUDA" in unavailable_reason("triton", torch.device("meta"))


def test_bad_launch_options_raise():
    from infcl.kernels import TileConfig
    from infcl.kernels.tiles import launch_options

    with pytest.raises(ValueError, match="block_m"):
        TileConfig(block_m=8, block_n=64)
    with pytest.raises(ValueError, match="max_block_d"):
        TileConfig(block_m=64, block_n=64, max_block_d=48)
    with pytest.raises(ValueError, match="precision"):
        launch_options(torch.float32, "fast")


# ---- GPU only -------------------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda_only
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16, torch.float16))
def test_gpu_large_batch_matches_vanilla(dtype):
    q, k, scale = _inputs(3000, 3000, 384, seed=12, dtype=dtype)
    labels = _labels(3000, 3000, True)
    ours, truth = _compare(q, k, scale, labels, symmetric=True)
    if dtype in (torch.float64, torch.float32):
        _assert_exact(ours, truth, dtype, f"GPU {dtype}")
        return
    torch_lowp = grads_of(lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_.to(dtype), True), q, k, scale)
    atol, rtol = TOLERANCE[dtype]
    for name, a, t, e in zip(GRAD_NAMES, ours, torch_lowp, truth):
        assert_no_worse(a, t, e, atol, rtol, f"GPU {dtype} {name}")


@cuda_only
def test_gpu_tf32_and_ieee_precision():
    """IEEE float32 products are held to float32 round-off; TF32 (10-bit mantissa) to a looser bound."""
    from infcl.backends.triton_backend import TritonBackend

    q, k, scale = _inputs(1024, 1024, 256, seed=13, dtype=torch.float32)
    truth = torch.logsumexp(float(scale) * q.double() @ k.double().T, dim=1)
    ieee = TritonBackend(precision="ieee").forward_block(q, k, float(scale), False)[0]
    tf32 = TritonBackend(precision="tf32").forward_block(q, k, float(scale), False)[0]
    assert_close_verbose(ieee, truth, 1e-5, 1e-5, "ieee row_lse")
    assert_close_verbose(tf32, truth, 2e-2, 2e-3, "tf32 row_lse")


@cuda_only
@pytest.mark.skipif(importlib.util.find_spec("inf_cl") is None, reason="Inf-CL (inf_cl) is not installed")
def test_gpu_agrees_with_inf_cl():
    from inf_cl import cal_inf_loss as inf_cl_loss

    q, k, scale = _inputs(2048, 2048, 256, seed=14, dtype=torch.float32)
    labels = torch.arange(2048, device=DEVICE)
    ours = cal_inf_loss(q, k, labels, scale, backend="triton")
    theirs = inf_cl_loss(q, k, labels, scale, head_dim=256)  # already the mean
    truth = vanilla_loss(q.double(), k.double(), labels, scale)
    assert abs(float(ours) - float(truth)) <= abs(float(theirs) - float(truth)) + 1e-5
