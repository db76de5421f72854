"""Native CPU backend specifics: op registration, determinism, exactness per dtype, odd shapes, fallback.

The generic loss/gradient matrix over every backend lives in test_loss.py; this file checks what only
the native kernel has. The extension is built once per machine (cached) and loaded once per process.
"""

import warnings

import pytest
import torch

from infcl import cal_inf_loss
from infcl.backends import native, native_build, resolve_backend, unavailable_reason
from infcl.backends.torch_tiles import TORCH_TILES
from support import (
    DTYPE_TOLERANCES,
    ODD_BATCHES,
    ODD_DIMS,
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    grads_of,
    vanilla_loss,
)

CPU = torch.device("cpu")
NATIVE_REASON = unavailable_reason("cpu", CPU)
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"native kernel unavailable: {NATIVE_REASON}")

# Shapes that cross the kernel's tile (256 x 512) and lane boundaries, plus the degenerate ends.
ODD_SHAPES = ((1, 1, 1), (7, 7, 3), (257, 257, 384), (129, 1000, 5), (1000, 1000, 1), (300, 513, 1000))
SCALE = 14.3  # exp(2.659), CLIP's initial logit scale: large enough that the exps spread out


def _features(bq, bk, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(bq, d, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(bk, d, generator=gen, dtype=torch.float64), dim=-1)
    return q.to(dtype), k.to(dtype)


def _block_outputs(backend, q, k, scale, symmetric, seed=1):
    """Forward then backward of one block with random upstream gradients: (row_lse, col_lse, dq, dk, dscale)."""
    gen = torch.Generator().manual_seed(seed)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    row_lse, col_lse = backend.forward_block(q, k, scale, symmetric)
    # Drawn in float64 whatever the dtype, so every dtype sees the same upstream gradients.
    g_row = torch.rand(q.shape[0], generator=gen, dtype=torch.float64).to(acc)
    g_col = torch.rand(k.shape[0], generator=gen, dtype=torch.float64).to(acc) if symmetric else None
    dq = torch.zeros(q.shape, dtype=acc)
    dk = torch.zeros(k.shape, dtype=acc)
    ds_row, ds_col = backend.backward_block(q, k, scale, row_lse, g_row, col_lse, g_col, dq, dk)
    return row_lse, col_lse, dq, dk, torch.stack([ds_row, ds_col])


@needs_native
def test_custom_ops_are_registered():
    assert hasattr(torch.ops.infcl, "forward_block")
    assert hasattr(torch.ops.infcl, "backward_block")
    schema = str(torch.ops.infcl.backward_block.default._schema)
    assert "Tensor(a!) dq" in schema and "Tensor(b!) dk" in schema  # the in-place outputs are declared


@needs_native
@pytest.mark.parametrize("symmetric", (False, True))
def test_ops_pass_opcheck(symmetric):
    """Schema, fake (torch.compile) impls and in-place annotations agree with the real kernels."""
    q, k = _features(40, 50, 8, torch.float32)
    row_lse, col_lse = torch.ops.infcl.forward_block(q, k, 2.0, symmetric)
    torch.library.opcheck(torch.ops.infcl.forward_block.default, (q, k, 2.0, symmetric))
    cols = (col_lse, torch.rand(50)) if symmetric else (None, None)
    args = (q, k, 2.0, row_lse, torch.rand(40), *cols, torch.zeros(40, 8), torch.zeros(50, 8))
    torch.library.opcheck(torch.ops.infcl.backward_block.default, args)


@needs_native
def test_auto_picks_native_on_cpu(monkeypatch):
    monkeypatch.delenv("INFCL_BACKEND", raising=False)
    assert resolve_backend("auto", CPU) == "cpu"


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_bit_identical_run_to_run(dtype):
    q, k = _features(700, 1100, 64, dtype)
    first = _block_outputs(native.BACKEND, q, k, SCALE, True)
    second = _block_outputs(native.BACKEND, q, k, SCALE, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize("bq, bk, d", ODD_SHAPES)
@pytest.mark.parametrize("symmetric", (False, True))
def test_block_matches_float64_torch_tiles(bq, bk, d, symmetric):
    """Every block output (including the split scale gradient) against the float64 tiles, float32 inputs."""
    atol, rtol = TOLERANCE[torch.float32]
    q, k = _features(bq, bk, d, torch.float64)
    truth = _block_outputs(TORCH_TILES, q, k, SCALE, symmetric)
    ours = _block_outputs(native.BACKEND, q.float(), k.float(), SCALE, symmetric)
    for name, a, t in zip(("row_lse", "col_lse", "dq", "dk", "dscale"), ours, truth):
        if t is None:
            assert a is None
            continue
        assert a.dtype == torch.float32
        assert_close_verbose(a, t, atol, rtol, f"{name} {bq}x{bk}x{d}")


@needs_native
@pytest.mark.parametrize("dtype, atol, rtol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("b", (1, 129, 1000, 1100))
def test_loss_and_grads_match_vanilla(dtype, atol, rtol, b):
    """Symmetric loss end to end, non-unit upstream gradient and a tensor scale, against float64 vanilla.

    B=1100 gives each lane several full 256 x 512 tiles plus ragged ones, in both directions.
    """
    d = ODD_DIMS[2]
    q, k = _features(b, b, d, dtype)
    scale = torch.tensor(SCALE, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    upstream = torch.tensor(0.7)

    def ours(a, c, s):
        return cal_inf_loss(a, c, scale=s, symmetric=True, backend="cpu")

    def vanilla(a, c, s):
        return vanilla_loss(a, c, scale=s, symmetric=True)

    got = grads_of(ours, q, k, scale, upstream)
    truth = grads_of(vanilla, q.double(), k.double(), scale.double(), upstream)
    names = ("loss", "dq", "dk", "dscale")
    if dtype in (torch.float32, torch.float64):
        for name, a, t in zip(names, got, truth):
            assert_close_verbose(a, t, atol, rtol, f"{name} {dtype} B={b}")
    else:
        lowp = grads_of(vanilla, q, k, scale.to(dtype), upstream)
        for name, a, lp, t in zip(names, got, lowp, truth):
            assert_no_worse(a, lp, t, atol, rtol, f"{name} {dtype} B={b}")


@needs_native
@pytest.mark.parametrize("threads", (1, 2, 3))
def test_thread_counts_match_vanilla(threads):
    """float32 at B=1100 with 1, 2 and 3 lanes: one or two lanes pack each key tile for MKL (at least
    two full row tiles share it), three lanes of ~367 rows do not. torch.set_num_threads also turns
    MKL's dynamic threading off, which the kernel must not depend on."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k = _features(1100, 1100, ODD_DIMS[2], torch.float32)
        scale = torch.tensor(SCALE)
        got = grads_of(lambda a, c, s: cal_inf_loss(a, c, scale=s, symmetric=True, backend="cpu"),
                       q, k, scale, torch.tensor(0.7))
    finally:
        torch.set_num_threads(before)
    truth = grads_of(lambda a, c, s: vanilla_loss(a, c, scale=s, symmetric=True),
                     q.double(), k.double(), scale.double(), torch.tensor(0.7))
    for name, a, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
        assert_close_verbose(a, t, *TOLERANCE[torch.float32], f"{name} threads={threads}")


@needs_native
@pytest.mark.parametrize("b", ODD_BATCHES)
def test_one_directional_with_labels_and_hard_negatives(b):
    """Bk > Bq (hard negatives), shuffled labels, reduction='sum', strided (transposed) inputs."""
    extra = 37
    d = 65
    q, k = _features(b, b + extra, d, torch.float64)
    q = q.T.contiguous().T  # same values, column-major strides
    labels = torch.randperm(b + extra, generator=torch.Generator().manual_seed(2))[:b]
    scale = torch.tensor(SCALE)

    def ours(a, c, s):
        return cal_inf_loss(a, c, labels, scale=s, reduction="sum", backend="cpu")

    def vanilla(a, c, s):
        return vanilla_loss(a, c, labels, scale=s, reduction="sum")

    atol, rtol = TOLERANCE[torch.float32]
    got = grads_of(ours, q.float(), k.float(), scale)
    truth = grads_of(vanilla, q, k, scale.double())
    for name, a, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
        assert_close_verbose(a, t, atol, rtol, f"{name} B={b}")


@needs_native
def test_nan_in_gives_nan_out():
    q, k = _features(300, 300, 16, torch.float32)
    q[5, 3] = float("nan")
    assert torch.isnan(cal_inf_loss(q, k, symmetric=True, backend="cpu"))


@needs_native
def test_strided_dq_dk_accumulate_in_place():
    q, k = _features(100, 90, 8, torch.float32)
    row_lse, col_lse = native.BACKEND.forward_block(q, k, 2.0, True)
    g_row, g_col = torch.rand(100), torch.rand(90)
    dq_t = torch.ones(8, 100)
    dk_t = torch.ones(8, 90)
    native.BACKEND.backward_block(q, k, 2.0, row_lse, g_row, col_lse, g_col, dq_t.T, dk_t.T)
    dq, dk = torch.ones(100, 8), torch.ones(90, 8)
    TORCH_TILES.backward_block(q, k, 2.0, row_lse, g_row, col_lse, g_col, dq, dk)
    assert_close_verbose(dq_t.T, dq, 1e-6, 1e-5, "dq")
    assert_close_verbose(dk_t.T, dk, 1e-6, 1e-5, "dk")


def test_failed_build_warns_once_and_auto_falls_back(monkeypatch):
    def broken_build():
        raise RuntimeError("no C++ compiler (simulated)")

    monkeypatch.setattr(native_build, "_build_and_load", broken_build)
    monkeypatch.delenv("INFCL_BACKEND", raising=False)
    native.load_error.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_backend("auto", CPU) == "torch"
            assert resolve_backend("auto", CPU) == "torch"
            with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
                resolve_backend("cpu", CPU)
            q, k = _features(9, 9, 4, torch.float32)
            loss = cal_inf_loss(q, k)  # auto -> torch tiles, still the right loss
        assert_close_verbose(loss, vanilla_loss(q.double(), k.double()), 1e-5, 1e-5, "fallback loss")
        ours = [w for w in caught if "native CPU kernel" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
    finally:
        native.load_error.cache_clear()  # the next caller reloads the real (cached) build


def test_cpu_backend_refuses_other_devices():
    assert "CPU tensors only" in native.unavailable_reason(torch.device("meta"))
