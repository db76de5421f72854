"""The sigmoid loss's Triton kernels against the float64 truth: loss and the gradients of image, text,
scale and bias.

Without CUDA they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), with the GPU's
64 x 64 x 64 tiling pinned so that the masks, the feature-chunk loop and both backward variants (dq / dk
in registers when D <= BLOCK_D, read-add-write per chunk above) are the ones a GPU runs. The matrix is
small on purpose: the interpreter costs about a millisecond of Python per tile operation. A separate
process compiles every kernel variant for an sm_90 GPU (no GPU needed), which catches what the
interpreter forgives (non-constexpr globals, dtype mismatches in the IR).
"""

import pytest
import torch
import torch.nn.functional as F

from helpers.support import (
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    grads_of_inputs,
    open_clip_loss_module,
    siglip_magnitudes,
    siglip_truth,
)
from infcl import cal_siglip_loss
from infcl.backends import unavailable_reason

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    unavailable_reason("triton", torch.device(DEVICE)) is not None,
    reason="triton backend unavailable here (no CUDA and TRITON_INTERPRET unset)",
)
GRAD_NAMES = ("loss", "dimage", "dtext", "dscale", "dbias")
# (Bq, Bk): one row; Bk > Bq with a ragged last block; two full 64-row blocks and a ragged one.
SHAPES = ((1, 1), (33, 70), (130, 130))
DIMS = (16, 40, 72, 200)  # 16: one exact chunk; 40: one masked chunk; 72, 200: several chunks, the last ragged


def _gpu_tiled():
    """The Triton backend every call of this file passes: the GPU's tile sizes (the interpreter would otherwise
    pick one big tile). Imported here, after the skip above, for a machine without triton."""
    from infcl.backends.triton import TritonBackend
    from infcl.kernels.tiling import SIGMOID_TILINGS

    return TritonBackend(tiling=SIGMOID_TILINGS["mma"])


def _inputs(bq, bk, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(bq, dim, generator=gen, dtype=torch.float64), dim=1)
    text = F.normalize(torch.randn(bk, dim, generator=gen, dtype=torch.float64), dim=1)
    labels = None if bq == bk else torch.randint(0, bk, (bq,), generator=gen).to(DEVICE)
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    params = (torch.tensor(10.0, dtype=pdtype, device=DEVICE), torch.tensor(-10.0, dtype=pdtype, device=DEVICE))
    return image.to(DEVICE, dtype), text.to(DEVICE, dtype), labels, params


def _compare(image, text, labels, params, reduction="mean", upstream=None):
    """(ours, truth, magnitudes) of (loss, dimage, dtext, dscale, dbias)."""
    ours = grads_of_inputs(
        lambda i, t, s, b: cal_siglip_loss(i, t, s, b, labels, reduction=reduction, backend=_gpu_tiled()),
        (image, text, *params),
        upstream,
    )
    as64 = [x.double() for x in (image, text, *params)]
    truth = grads_of_inputs(lambda i, t, s, b: siglip_truth(i, t, s, b, labels, reduction), as64, upstream)
    cpu = [x.cpu() for x in as64]
    sizes = siglip_magnitudes(*cpu, None if labels is None else labels.cpu(), reduction, upstream)
    return ours, truth, sizes


def _assert_exact(ours, truth, sizes, dtype, what):
    atol, rtol = TOLERANCE[dtype]
    for name, got, want, size in zip(GRAD_NAMES, ours, truth, sizes):
        assert_close_verbose(got, want, atol, rtol, f"{what} {name}", magnitude=size)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}" for s in SHAPES])
def test_float64_matches_truth(shape, dim):
    image, text, labels, params = _inputs(*shape, dim, torch.float64)
    _assert_exact(*_compare(image, text, labels, params), torch.float64, f"{shape} D={dim}")


@pytest.mark.parametrize("dim", (40, 200))
def test_float32_matches_truth(dim):
    image, text, labels, params = _inputs(33, 70, dim, torch.float32)
    _assert_exact(*_compare(image, text, labels, params, "sum"), torch.float32, f"float32 D={dim}")


@pytest.mark.parametrize("reduction", ("none", "sum"))
def test_negative_and_per_row_upstream_gradients(reduction):
    image, text, labels, params = _inputs(70, 70, 40, torch.float64)
    gen = torch.Generator().manual_seed(2)
    upstream = (
        torch.rand(70, generator=gen, dtype=torch.float64) * 2 - 1.5 if reduction == "none" else torch.tensor(-2.5)
    )
    _assert_exact(*_compare(image, text, labels, params, reduction, upstream.to(DEVICE)), torch.float64, reduction)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_low_precision_no_worse_than_torch(dtype):
    image, text, labels, params = _inputs(33, 70, 72, dtype)
    ours, truth, _ = _compare(image, text, labels, params)
    vanilla = grads_of_inputs(
        lambda i, t, s, b: siglip_truth(i, t, s.to(dtype), b.to(dtype), labels), (image, text, *params)
    )
    atol, rtol = TOLERANCE[dtype]
    for name, got, lowp, want in zip(GRAD_NAMES, ours, vanilla, truth):
        assert_no_worse(got, lowp, want, atol, rtol, f"triton {dtype} {name}")


def test_strided_inputs():
    image, text, labels, params = _inputs(33, 70, 40, torch.float64)
    image_t, text_t = image.T.contiguous().T, text.T.contiguous().T  # column-major: strides (1, B)
    assert not image_t.is_contiguous()
    _assert_exact(*_compare(image_t, text_t, labels, params), torch.float64, "strided")


def test_logits_up_to_1e4_are_stable():
    """Exactly representable logits in [-9216, 7168] (see test_siglip._exact_large_logits), float32."""
    gen = torch.Generator().manual_seed(3)
    image = (torch.randint(-1, 2, (37, 16), generator=gen).float() / 2).to(DEVICE)
    text = (torch.randint(-1, 2, (41, 16), generator=gen).float() / 2).to(DEVICE)
    image[0], text[0] = 0.5, -0.5
    labels = torch.randint(0, 41, (37,), generator=gen).to(DEVICE)
    params = (torch.tensor(2048.0, device=DEVICE), torch.tensor(-1024.0, device=DEVICE))
    ours, truth, sizes = _compare(image, text, labels, params, "sum")
    assert all(torch.isfinite(t).all() for t in ours)
    _assert_exact(ours, truth, sizes, torch.float32, "|logits| <= 1e4")


def test_deterministic():
    """No atomics: the same inputs give bit-identical results."""
    image, text, labels, params = _inputs(130, 130, 72, torch.float32)
    first, second = (
        grads_of_inputs(lambda *a: cal_siglip_loss(*a, labels, backend=_gpu_tiled()), (image, text, *params))
        for _ in range(2)
    )
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), name


def test_nan_in_nan_out():
    image, text, labels, params = _inputs(33, 33, 16, torch.float32)
    image[5, 3] = float("nan")
    rows = cal_siglip_loss(image, text, *params, reduction="none", backend=_gpu_tiled())
    assert torch.isnan(rows[5]) and torch.isfinite(torch.cat((rows[:5], rows[6:]))).all()


def test_matches_open_clip_siglip_loss():
    siglip = open_clip_loss_module().SigLipLoss()
    image, text, _, params = _inputs(70, 70, 40, torch.float32, seed=5)
    theirs = grads_of_inputs(siglip, (image, text, *params))
    ours = grads_of_inputs(lambda *a: cal_siglip_loss(*a, backend=_gpu_tiled()), (image, text, *params))
    for name, a, b in zip(GRAD_NAMES, ours, theirs):
        assert_close_verbose(a, b, *TOLERANCE[torch.float32], f"triton vs open_clip: {name}")
