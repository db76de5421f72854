"""Native CPU backend specifics: op registration, the block contract, exactness per regime, determinism,
sign symmetry, thread counts, odd shapes, fallback.

The generic loss/gradient matrix over every backend lives in test_loss.py; this file checks what only
the native kernel has. The extension is built once per machine (cached) and loaded once per process.

Exactness rule (issue 14): against float64 ``F.cross_entropy`` on the same (dtype-rounded) values, each
output's max abs error is at most ``ERR_FACTOR`` x torch's own vanilla error in that dtype plus
``TERM_ULPS`` ulps of the terms that make it up (:func:`term_sizes`).
"""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.support import (
    BF16_ROUTES,
    EXACT_NORMWISE,
    ODD_BATCHES,
    ODD_DIMS,
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    assert_normwise,
    exact_softmax_truth,
    force_bf16_route,
    grads_of,
    margin_features,
    vanilla_loss,
)
from infcl import cal_inf_loss
from infcl.backends import native, resolve_backend, unavailable_reason
from infcl.backends.native import build as native_build
from infcl.backends.torch_tiles import TORCH_TILES
from infcl.contract import Block, accum_dtype

CPU = torch.device("cpu")
NATIVE_REASON = unavailable_reason("cpu", CPU)
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"native kernel unavailable: {NATIVE_REASON}")

# Shapes that cross the kernel's row tiles (csrc/common.h RowTiles: up to 256 rows), its 512-column key tiles
# and its lane boundaries, plus the degenerate ends.
ODD_SHAPES = ((1, 1, 1), (7, 7, 3), (257, 257, 384), (129, 1000, 5), (1000, 1000, 1), (300, 513, 1000))
SCALE = 14.3  # exp(2.659), CLIP's initial logit scale: large enough that the exps spread out
THREADS = (1, 2, 3)  # 3 lanes split the row tiles unevenly
ERR_FACTOR = 4.0
TERM_ULPS = 8.0
EPS = {torch.float64: 2.0**-52, torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _features(bq, bk, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(bq, d, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(bk, d, generator=gen, dtype=torch.float64), dim=-1)
    return q.to(dtype), k.to(dtype)


def _unnormalized(b, d, magnitude, seed=0):
    """Raw features of entries ~ magnitude * N(0, 1): logits far beyond a normalized model's."""
    gen = torch.Generator().manual_seed(seed)
    return (magnitude * torch.randn(b, d, generator=gen, dtype=torch.float64) for _ in range(2))


def _confident(b, d, seed=0):
    """Confident pairs: rows share a common direction (cosines ~0.5 between rows) and each k is a slightly
    perturbed copy of its q, so at scale 100 each positive beats the rest by ~20-45 and a row's loss is
    1e-18 .. 5e-9: a float32 1 + loss rounds to 1."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=gen, dtype=torch.float64)
    q = F.normalize(base + torch.randn(b, d, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(q + 0.05 * torch.randn(b, d, generator=gen, dtype=torch.float64) / d**0.5, dim=-1)
    return q, k


@contextlib.contextmanager
def _threads(n):
    """torch.set_num_threads(n) for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _block_outputs(backend, q, k, scale, pos, symmetric, seed=1):
    """Forward then backward of one block with random upstream gradients: (rows, cols, dq, dk, dscale)."""
    gen = torch.Generator().manual_seed(seed)
    acc = accum_dtype(q.dtype)
    scale_t = torch.tensor(scale, dtype=acc)
    rows, cols = backend.forward_block(Block(q=q, k=k, scale=scale_t, pos=pos), symmetric)
    # Drawn in float64 whatever the dtype, so every dtype sees the same upstream gradients.
    g_row = torch.rand(q.shape[0], generator=gen, dtype=torch.float64).to(acc)
    g_col = torch.rand(k.shape[0], generator=gen, dtype=torch.float64).to(acc) if symmetric else None
    block = Block(q=q, k=k, scale=scale_t, pos=pos, row_stats=rows[:2], g_row=g_row, col_stats=cols, g_col=g_col)
    dq = torch.zeros(q.shape, dtype=acc)
    dk = torch.zeros(k.shape, dtype=acc)
    dscale = backend.backward_block(block, dq, dk)
    return rows, cols, dq, dk, dscale


def _diagonal_pos(bq, bk):
    return torch.where(torch.arange(bq) < bk, torch.arange(bq), -1)


# ---------------------------------------------------------------------------------------------
# Registration and the op boundary


@needs_native
def test_fake_impls_register_again():
    """A second registration of the ops' fake impls replaces the first (a cleared load cache, a reload) instead of
    raising: torch 2.8's register_fake refuses an override unless asked (allow_override), a later torch allows it."""
    native_build.register_fakes()
    native_build.register_fakes()


@needs_native
def test_custom_ops_are_registered():
    assert hasattr(torch.ops.infcl, "forward_block")
    assert hasattr(torch.ops.infcl, "backward_block")
    schema = str(torch.ops.infcl.backward_block.default._schema)
    assert "Tensor(a!) dq" in schema and "Tensor(b!) dk" in schema  # the in-place outputs are declared
    assert "Tensor pos" in schema and "Tensor? col_stats" in schema


@needs_native
@pytest.mark.parametrize("symmetric", (False, True))
def test_ops_pass_opcheck(symmetric):
    """Schema, fake (torch.compile) impls and in-place annotations agree with the real kernels."""
    q, k = _features(40, 50, 8, torch.float32)
    pos = torch.randint(-1, 50, (40,), generator=torch.Generator().manual_seed(0))
    rows, cols = torch.ops.infcl.forward_block(q, k, 2.0, pos, symmetric)
    assert rows.shape == (3, 40) and cols.shape == (2, 50 if symmetric else 0)
    torch.library.opcheck(torch.ops.infcl.forward_block.default, (q, k, 2.0, pos, symmetric))
    col_args = (cols.clone(), torch.rand(50)) if symmetric else (None, None)
    args = (q, k, 2.0, pos, rows[:2].clone(), torch.rand(40), *col_args, torch.zeros(40, 8), torch.zeros(50, 8))
    torch.library.opcheck(torch.ops.infcl.backward_block.default, args)


@needs_native
@pytest.mark.parametrize("symmetric", (False, True))
def test_masked_ops_with_kept_sums_pass_opcheck(symmetric):
    """The masked ops with label smoothing's kept sums (forward: [8, n]) and uniform weights (backward)."""
    q, k = _features(40, 50, 8, torch.float32)
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(-1, 50, (40,), generator=gen)
    q_ids, k_ids = torch.randint(0, 6, (40,), generator=gen), torch.randint(0, 6, (50,), generator=gen)
    masks = (None, q_ids, k_ids, None, None, None, None)
    rows, cols = torch.ops.infcl.masked_forward_block(q, k, 2.0, pos, symmetric, *masks, True)
    assert rows.shape == (8, 40) and cols.shape == (8, 50 if symmetric else 0)
    torch.library.opcheck(torch.ops.infcl.masked_forward_block.default, (q, k, 2.0, pos, symmetric, *masks, True))
    col_args = (cols[:2].clone(), torch.rand(50)) if symmetric else (None, None)
    uniform = (torch.rand(40), torch.rand(50) if symmetric else None)
    args = (q, k, 2.0, pos, rows[:2].clone(), torch.rand(40), *col_args, *masks, None, None, None, None)
    args += (torch.zeros(40, 8), torch.zeros(50, 8), *uniform)
    torch.library.opcheck(torch.ops.infcl.masked_backward_block.default, args)


@needs_native
def test_positions_out_of_range_are_rejected():
    q, k = _features(5, 4, 3, torch.float32)
    with pytest.raises(RuntimeError, match="pos must lie in"):
        torch.ops.infcl.forward_block(q, k, 1.0, torch.tensor([0, 1, 2, 3, 4]), False)
    with pytest.raises(RuntimeError, match="pos must be int64"):
        torch.ops.infcl.forward_block(q, k, 1.0, torch.zeros(5, dtype=torch.int32), False)


@needs_native
def test_auto_picks_native_on_cpu(monkeypatch):
    monkeypatch.delenv("INFCL_BACKEND", raising=False)
    assert resolve_backend("auto", CPU) == "cpu"


# ---------------------------------------------------------------------------------------------
# The block contract against the torch tiles


@needs_native
@pytest.mark.parametrize("bq, bk, d", ODD_SHAPES)
@pytest.mark.parametrize("symmetric", (False, True))
def test_block_matches_float64_torch_tiles(bq, bk, d, symmetric):
    """Every block output (stats, positive logits, dq, dk, the split scale gradient) against the float64
    torch tiles, float32 inputs; positives on a random subset of rows, the rest elsewhere (-1). As in
    test_loss.py, float32 round-off is taken relative to each output's largest entry (at D = 1 the dq
    rows are sums of ~500 terms of +-g/500 and one -g that cancel)."""
    atol, rtol = TOLERANCE[torch.float32]
    q, k = _features(bq, bk, d, torch.float64)
    gen = torch.Generator().manual_seed(4)
    pos = torch.where(torch.rand(bq, generator=gen) < 0.7, torch.randint(0, bk, (bq,), generator=gen), -1)
    truth = _block_outputs(TORCH_TILES, q, k, SCALE, pos, symmetric)
    ours = _block_outputs(native.BACKEND, q.float(), k.float(), SCALE, pos, symmetric)
    for name, a, t in zip(("rows", "cols", "dq", "dk", "dscale"), ours, truth):
        if t is None:
            assert a is None
            continue
        assert a.dtype == torch.float32 and a.shape == t.shape
        assert_close_verbose(a, t, atol * max(float(t.abs().max()), 1.0), rtol, f"{name} {bq}x{bk}x{d}")


@needs_native
@pytest.mark.parametrize("dtype, ds_tol", ((torch.float32, 1e-5), (torch.bfloat16, 2e-3)))
@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("scale", (SCALE, 400.0))
def test_one_and_two_exp_paths_match_float64_torch_tiles(dtype, ds_tol, symmetric, scale):
    """float32 and bfloat16 take one exp per entry where a tile's maxima (forward) and log-sum-exps
    (backward) lie within a span, two elsewhere: at scale 14.3 every tile takes the first, at scale 400
    the spread exceeds the spans and every tile the second. Stats are float32-accurate on the dtype's
    values either way; dq / dk / dscale carry float32 round-off, or dS rounded to bf16."""
    q, k = (t.to(dtype) for t in _features(300, 1100, 40, torch.float64))
    _assert_block_matches_float64_tiles(q, k, scale, _diagonal_pos(300, 1100), symmetric, ds_tol, 5 * ds_tol)


def _assert_block_matches_float64_tiles(q, k, scale, pos, symmetric, ds_atol, ds_rtol):
    """The native block outputs against the torch tiles' on the float64 values: the stats float32-accurate
    (relative 1e-5), dq / dk / dscale to ``ds_atol`` of each output's largest entry and ``ds_rtol``."""
    truth = _block_outputs(TORCH_TILES, q.double(), k.double(), scale, pos, symmetric)
    ours = _block_outputs(native.BACKEND, q, k, scale, pos, symmetric)
    for name, a, t in zip(("rows", "cols"), ours[:2], truth[:2]):
        if t is not None:
            assert_close_verbose(a, t, 1e-5 * max(float(t.abs().max()), 1.0), 1e-5, name)
    for name, a, t in zip(("dq", "dk", "dscale"), ours[2:], truth[2:]):
        assert_close_verbose(a, t, ds_atol * float(t.abs().max()), ds_rtol, name)


@needs_native
@pytest.mark.parametrize("symmetric", (False, True))
def test_float64_block_matches_torch_tiles_closely(symmetric):
    q, k = _features(300, 513, 40, torch.float64)
    pos = _diagonal_pos(300, 513)
    truth = _block_outputs(TORCH_TILES, q, k, SCALE, pos, symmetric)
    ours = _block_outputs(native.BACKEND, q, k, SCALE, pos, symmetric)
    for name, a, t in zip(("rows", "cols", "dq", "dk", "dscale"), ours, truth):
        if t is not None:
            assert_close_verbose(a, t, 1e-12, 1e-12, name)


@needs_native
def test_strided_dq_dk_accumulate_in_place():
    # g_row / g_col below: seeded, as the two backends' round-off differ by up to ~2.6e-6 over seeds (each within
    # ~2e-6 of float64) at entries where 1 + dq nearly cancels.
    torch.manual_seed(0)
    q, k = _features(100, 90, 8, torch.float32)
    pos = _diagonal_pos(100, 90)
    scale = torch.tensor(2.0)
    rows, cols = native.BACKEND.forward_block(Block(q=q, k=k, scale=scale, pos=pos), True)
    block = Block(
        q=q, k=k, scale=scale, pos=pos, row_stats=rows[:2], g_row=torch.rand(100), col_stats=cols, g_col=torch.rand(90)
    )
    dq_t, dk_t = torch.ones(8, 100), torch.ones(8, 90)
    native.BACKEND.backward_block(block, dq_t.T, dk_t.T)
    # The same kernel into contiguous buffers: the strides change where the sums land, never their bits.
    dq, dk = torch.ones(100, 8), torch.ones(90, 8)
    native.BACKEND.backward_block(block, dq, dk)
    assert torch.equal(dq_t.T, dq) and torch.equal(dk_t.T, dk)
    # And the values are the block's gradients, the torch tiles' to float32 round-off.
    ref_q, ref_k = torch.ones(100, 8), torch.ones(90, 8)
    TORCH_TILES.backward_block(block, ref_q, ref_k)
    assert_close_verbose(dq, ref_q, 1e-6, 1e-5, "dq")
    assert_close_verbose(dk, ref_k, 1e-6, 1e-5, "dk")


# ---------------------------------------------------------------------------------------------
# Exactness in every regime (issue 14)


def term_sizes(q, k, scale, symmetric, weights, logit_rounding):
    """Per output, the size of the rounded terms it is made of (float64, on the same values).

    An entry's dS = g (P - Y) is made of P and Y, each rounded: weight g (P + Y). With
    ``logit_rounding`` it also carries its logits' rounding, S at |S| eps (each implementation sums
    q . k in its own order), which dP/dS_j = P (delta - P_j) turns into ~2 P (1 - P) max|S| eps: this
    stands in for torch's own error in float64, where vanilla is the truth itself. dq: the largest row
    sum of weight * |scale| * max|k_j|; dk likewise by column; dscale: the sum of weight * |q_i . k_j|
    over all entries; the per-row losses: the largest |logit|.
    """
    q, k = q.double(), k.double()
    raw = q @ k.T
    logits = scale * raw
    eye = torch.eye(q.shape[0], dtype=torch.float64)

    def weight(dim):
        p = torch.softmax(logits, dim)
        spread = 2 * p * (1 - p) * logits.abs().amax(dim, keepdim=True) if logit_rounding else 0
        return p + spread + eye

    g = weights.abs()
    w = (weight(1) * g[:, None] + weight(0) * g[None]) / 2 if symmetric else weight(1) * g[:, None]
    return {
        "loss": float(logits.abs().max()),
        "dq": abs(scale) * float((w * k.abs().amax(1)[None]).sum(1).max()),
        "dk": abs(scale) * float((w * q.abs().amax(1)[:, None]).sum(0).max()),
        "dscale": float((w * raw.abs()).sum()),
    }


def _regime_errors(q64, k64, scale, dtype, symmetric, weights):
    """(ours, vanilla) max abs errors of loss [per row], dq, dk, dscale against float64 on the same values."""
    q, k = q64.to(dtype), k64.to(dtype)
    acc = accum_dtype(dtype)
    s = torch.tensor(scale, dtype=acc)

    def ours(a, b, c):
        return cal_inf_loss(a, b, scale=c, symmetric=symmetric, reduction="none", backend="cpu")

    def vanilla(a, b, c):
        return vanilla_loss(a, b, scale=c, symmetric=symmetric, reduction="none")

    truth = grads_of(vanilla, q.double(), k.double(), s.double(), weights)
    got = grads_of(ours, q, k, s, weights)
    lowp = grads_of(vanilla, q, k, s.to(dtype), weights)
    err = lambda xs: [float((x.double() - t).abs().max()) for x, t in zip(xs, truth)]  # noqa: E731
    return err(got), err(lowp), term_sizes(q, k, scale, symmetric, weights, logit_rounding=dtype == torch.float64)


REGIMES = {
    # |x| ~ 30, D = 32, scale 100: |S| up to ~2e6, where one ulp of S is ~0.1 and P ~ one-hot.
    "unnormalized-x30-scale100": lambda: (*_unnormalized(257, 32, 30.0), 100.0),
    # |x| ~ 3, scale 30: |S| ~ 1e3, P spread over a few entries.
    "unnormalized-x3-scale30": lambda: (*_unnormalized(257, 32, 3.0), 30.0),
    # confident pairs at scale 100 (B = 257 crosses the 256-row tile)
    "confident-scale100": lambda: (*_confident(257, 64), 100.0),
}


@needs_native
@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
@pytest.mark.parametrize("symmetric", (False, True))
def test_regimes_no_worse_than_vanilla(regime, dtype, symmetric):
    q, k, scale = REGIMES[regime]()
    weights = torch.rand(q.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    ours, vanilla, terms = _regime_errors(q, k, scale, dtype, symmetric, weights)
    for name, e, v in zip(("loss", "dq", "dk", "dscale"), ours, vanilla):
        bound = ERR_FACTOR * v + TERM_ULPS * EPS[dtype] * terms[name]
        assert e <= bound, f"{name}: error {e:.3g} > {bound:.3g} (vanilla {v:.3g}, terms {terms[name]:.3g})"


@needs_native
@pytest.mark.parametrize("dtype, rtol", ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)))
@pytest.mark.parametrize("symmetric", (False, True))
def test_confident_pairs_keep_their_digits(dtype, rtol, symmetric):
    """Scale 100: every row's loss is below float32's ulp of 1, and vanilla float32 returns P = 1 at the
    positives (gradients off by ~100%). The native kernel keeps r = log1p(rest) and g * expm1(x) at the
    positive, so its gradients are right to the rounding of the small terms (bfloat16: of dS)."""
    q64, k64 = _confident(257, 64)
    q, k = q64.to(dtype), k64.to(dtype)
    s = torch.tensor(100.0)
    fn = lambda a, b, c: cal_inf_loss(a, b, scale=c, symmetric=symmetric, reduction="sum", backend="cpu")  # noqa: E731
    got = grads_of(fn, q, k, s)
    truth = grads_of(
        lambda a, b, c: vanilla_loss(a, b, scale=c, symmetric=symmetric, reduction="sum"),
        q.double(),
        k.double(),
        s.double(),
    )
    for name, a, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
        assert_close_verbose(a, t, rtol * float(t.abs().max()), 10 * rtol, name)


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("threads", THREADS)
def test_backward_recomputes_the_forwards_logits_bit_for_bit(dtype, symmetric, threads):
    """Each positive beats its row and column by ~40000 at |S| ~ 1e5 (an ulp of S is ~0.01), so the loss
    is exactly 0 and the exact gradient is 0 to every digit: P = exp((S - m) - r) with r = 0, and at
    the positive expm1(S - m) = 0 only if the backward's S equals the forward's max bit for bit."""
    gen = torch.Generator().manual_seed(5)
    q = 30.0 * F.normalize(torch.randn(600, 48, generator=gen, dtype=torch.float64), dim=-1)
    q = q.to(dtype)
    with _threads(threads):
        loss, dq, dk, dscale = grads_of(
            lambda a, b, c: cal_inf_loss(a, b, scale=c, symmetric=symmetric, reduction="sum", backend="cpu"),
            q,
            q.clone(),
            torch.tensor(100.0, dtype=accum_dtype(dtype)),
        )
    assert float(loss) == 0.0
    for name, grad in (("dq", dq), ("dk", dk), ("dscale", dscale)):
        assert torch.count_nonzero(grad) == 0, f"{name}: max |grad| {float(grad.abs().max()):.3g}"


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("symmetric", (False, True))
def test_negated_upstream_weights_negate_the_gradients_exactly(dtype, symmetric):
    """grad(-w) == -grad(w) bit for bit: no value takes a different path by the sign of its gradient."""
    q, k = _features(700, 700, 64, dtype)
    weights = torch.rand(700, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2 - 0.5
    scale = torch.tensor(SCALE)

    def ours(a, b, c):
        return cal_inf_loss(a, b, scale=c, symmetric=symmetric, reduction="none", backend="cpu")

    plus = grads_of(ours, q, k, scale, weights)
    minus = grads_of(ours, q, k, scale, -weights)
    for name, a, b in zip(("dq", "dk", "dscale"), plus[1:], minus[1:]):
        assert torch.equal(a, -b), f"{name}: max |grad(w) + grad(-w)| {float((a + b).abs().max()):.3g}"


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
@pytest.mark.parametrize("symmetric", (False, True))
def test_row_losses_never_negative(dtype, symmetric):
    q, k = _confident(257, 64)
    rows = cal_inf_loss(q.to(dtype), k.to(dtype), scale=100.0, symmetric=symmetric, reduction="none", backend="cpu")
    assert float(rows.min()) >= 0.0


# ---------------------------------------------------------------------------------------------
# End to end, determinism, threads


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_bit_identical_run_to_run(dtype):
    q, k = _features(700, 1100, 64, dtype)
    pos = _diagonal_pos(700, 1100)
    first = _block_outputs(native.BACKEND, q, k, SCALE, pos, True)
    second = _block_outputs(native.BACKEND, q, k, SCALE, pos, True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize("b", (1, 129, 1000, 1100))
def test_loss_and_grads_match_vanilla(dtype_tolerance, b):
    """Symmetric loss end to end, non-unit upstream gradient and a tensor scale, against float64 vanilla.

    B=1100: 7 row tiles of 160 rows (the last 140) and 3 key tiles (the last ragged), in both directions.
    """
    dtype, atol, rtol = dtype_tolerance
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
@pytest.mark.parametrize("threads", THREADS)
def test_thread_counts_match_vanilla(threads):
    """float32 at B=1100 (7 row tiles) with 1, 2 and 3 lanes of whole row tiles. torch.set_num_threads also
    turns MKL's dynamic threading off, which the kernel must not depend on."""
    q, k = _features(1100, 1100, ODD_DIMS[2], torch.float32)
    scale = torch.tensor(SCALE)
    with _threads(threads):
        got = grads_of(
            lambda a, c, s: cal_inf_loss(a, c, scale=s, symmetric=True, backend="cpu"), q, k, scale, torch.tensor(0.7)
        )
    truth = grads_of(
        lambda a, c, s: vanilla_loss(a, c, scale=s, symmetric=True),
        q.double(),
        k.double(),
        scale.double(),
        torch.tensor(0.7),
    )
    for name, a, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
        assert_close_verbose(a, t, *TOLERANCE[torch.float32], f"{name} threads={threads}")


@needs_native
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
def test_thread_count_may_change_between_forward_and_backward(dtype, symmetric):
    """Forward with 2 threads, backward with 1 or 3 (a trainer's data loader or callback may change
    torch.set_num_threads in between): the forward's outputs are the same for every thread count, the
    backward recomputes S bit for bit whatever its own, so the result equals the run that used the
    backward's thread count throughout, bit for bit, and stays exact on confident rows (1 - P_pos ~ 1e-11
    .. 1e-24, which a backward S off by one ulp would break). B = 1100: several row tiles, one ragged."""
    q, k, labels = margin_features(1100, 64, 100.0, symmetric, seed=7)
    q, k, scale = q.to(dtype), k.to(dtype), torch.tensor(100.0, dtype=dtype)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, scale)]

    def loss_of(q_, k_, s_):
        return cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, reduction="none", backend="cpu")

    with _threads(2):
        forward_2 = loss_of(*leaves)
    truth = exact_softmax_truth(q, k, scale, labels, symmetric)
    for threads in (1, 3):
        with _threads(threads):
            same = grads_of(loss_of, q, k, scale)
            mixed = (
                forward_2.detach(),
                *torch.autograd.grad(forward_2, leaves, torch.ones_like(forward_2), retain_graph=True),
            )
        for name, a, b in zip(("loss", "dq", "dk", "dscale"), mixed, same):
            assert torch.equal(a, b), f"{name}: forward on 2 threads, backward on {threads} != {threads} throughout"
        assert_normwise(mixed, truth, EXACT_NORMWISE[dtype], f"backward on {threads} threads")


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


# ---------------------------------------------------------------------------------------------
# Availability


def test_failed_build_warns_once_and_auto_falls_back(monkeypatch):
    def broken_build():
        raise RuntimeError("no C++ compiler (simulated)")

    monkeypatch.setattr(native_build, "_build_and_load", broken_build)
    monkeypatch.delenv("INFCL_BACKEND", raising=False)
    native_build.load_error.cache_clear()
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
        native_build.load_error.cache_clear()  # the next caller reloads the real (cached) build


def test_cpu_backend_refuses_other_devices():
    assert "CPU tensors only" in native.unavailable_reason(torch.device("meta"))


def test_native_arch_option_sets_march_and_its_own_cache_key(monkeypatch):
    """INFCL_NATIVE_ARCH (e.g. x86-64-v3: an AVX2-only CPU's kernel on an AVX-512 one) replaces -march=native
    and is part of the build hash, so the two builds never share a cache entry; nothing is built here."""
    sources = native_build.source_files()
    monkeypatch.delenv(native_build.ARCH_VAR, raising=False)
    assert "-march=native" in native_build.compile_flags()
    default_name = native_build.extension_name(sources)
    monkeypatch.setenv(native_build.ARCH_VAR, "x86-64-v3")
    flags = native_build.compile_flags()
    assert "-march=x86-64-v3" in flags and not any(f == "-march=native" for f in flags)
    assert native_build.extension_name(sources) != default_name
    monkeypatch.setenv(native_build.ARCH_VAR, "x86-64-v3 -O0")
    with pytest.raises(ValueError, match=native_build.ARCH_VAR):
        native_build.compile_flags()


# ---------------------------------------------------------------------------------------------
# The bfloat16 GEMM routes of csrc/common.h (INFCL_BF16_GEMM forces one; "auto" picks by CPU), every one this
# CPU can take (support.BF16_ROUTES): odd D, an odd last row tile and an odd last key tile, where brgemm's
# even-depth padding matters.


def _force_bf16_route(monkeypatch, route):
    q, k = _features(2, 2, 2, torch.bfloat16)
    force_bf16_route(monkeypatch, route, lambda: torch.ops.infcl.forward_block(q, k, 1.0, torch.arange(2), False))


@needs_native
@pytest.mark.parametrize("route", BF16_ROUTES)
@pytest.mark.parametrize("symmetric", (False, True))
def test_bf16_routes_match_float64_torch_tiles(monkeypatch, route, symmetric):
    """Stats float32-accurate on the bfloat16 values; dq / dk / dscale to dS's bfloat16 rounding (float32 route:
    to float32 round-off)."""
    _force_bf16_route(monkeypatch, route)
    q, k = (t.to(torch.bfloat16) for t in _features(517, 1029, 63, torch.float64))
    _assert_block_matches_float64_tiles(q, k, SCALE, _diagonal_pos(517, 1029), symmetric, 2e-3, 1e-2)


@needs_native
@pytest.mark.parametrize("route", BF16_ROUTES)
@pytest.mark.parametrize("symmetric", (False, True))
def test_bf16_routes_recompute_the_forwards_logits_whatever_the_thread_count(monkeypatch, route, symmetric):
    """Forward on 2 threads, backward on 1 or 3: equal bit for bit to the run that used the backward's thread
    count throughout, and |S| ~ 1e5 with positives ~40000 ahead gives a loss and gradients of exactly 0, which
    needs the backward's S to be the forward's bit for bit (see test_backward_recomputes_the_forwards_logits...).
    B = 1101, D = 47: several row tiles, the last one odd, an odd key tile, an odd depth."""
    _force_bf16_route(monkeypatch, route)
    gen = torch.Generator().manual_seed(5)
    q = (30.0 * F.normalize(torch.randn(1101, 47, generator=gen, dtype=torch.float64), dim=-1)).bfloat16()
    leaves = [t.detach().requires_grad_(True) for t in (q, q.clone(), torch.tensor(100.0))]

    def loss_of(q_, k_, s_):
        return cal_inf_loss(q_, k_, scale=s_, symmetric=symmetric, reduction="sum", backend="cpu")

    with _threads(2):
        forward_2 = loss_of(*leaves)
    assert float(forward_2.detach()) == 0.0
    for threads in (1, 3):
        with _threads(threads):
            same = grads_of(loss_of, *leaves)
            mixed = (forward_2.detach(), *torch.autograd.grad(forward_2, leaves, retain_graph=True))
        for name, a, b in zip(("loss", "dq", "dk", "dscale"), mixed, same):
            assert torch.equal(a, b), f"{name}: forward on 2 threads, backward on {threads} != {threads} throughout"
            assert torch.count_nonzero(a) == 0, f"{name}: max |grad| {float(a.abs().max()):.3g}"
