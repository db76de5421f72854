"""The Triton backend against the float64 vanilla loss and against the torch tiles' block contract.

Without CUDA these run the kernels in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1). The interpreter costs ~1 ms of Python per tile operation, so the matrix is
chosen, not crossed for every dtype. Every test pins a GPU-like tiling (small blocks, several feature
chunks and dq/dk slices, ragged last blocks), so the masks, loops and splits a GPU runs are the ones
tested; ``test_interpreter_default_tiles`` alone runs the interpreter's big default tiles.
GPU-only tests live in tests/test_triton_gpu.py.
"""

import dataclasses

import pytest
import torch

from helpers.support import TOLERANCE, assert_close_verbose, assert_no_worse, grads_of, vanilla_loss
from infcl import cal_inf_loss
from infcl.backends import resolve_backend, unavailable_reason
from infcl.contract import Block

pytestmark = pytest.mark.skipif(
    unavailable_reason("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu")) is not None,
    reason="triton backend unavailable here (no CUDA and TRITON_INTERPRET unset)",
)

from infcl.backends import triton as triton_backend  # noqa: E402  (needs the skip above when triton is missing)
from infcl.backends.torch_tiles import TORCH_TILES  # noqa: E402
from infcl.kernels import TileConfig, Tiling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCHES = (1, 33, 130)  # 130: two full 64-row blocks and a ragged one
DIMS = (16, 40, 72, 200)  # 16, 40: one chunk (exact, masked); 72, 200: several 32-wide chunks and 64-wide dq slices
# The batch x D cross minus its costliest corner: B=130 at D=72 already runs full and ragged row blocks with
# ragged chunks and two dq / dk slices, and B=33 at D=200 runs the six chunks and four slices of D=200, so
# (130, 200), the costliest case of the cross, repeats both.
SHAPES = [(b, d) for b in BATCHES for d in DIMS if (b, d) != (130, 200)]
GRAD_NAMES = ("loss", "dq", "dk", "dscale")

# GPU-like tiles, small enough for the interpreter: forward 64 x 32, dq 64 x 32 and dk 64 x 16 blocks,
# D up to 64 held in registers as one chunk, 32-wide chunks beyond it, 64-wide dq/dk slices. (BLOCK_M
# stays 64 in all three kernels so that, run on a GPU, their S tiles use the same MMA instruction.) The
# symmetric forward walks pairs of row blocks, as the tensor-core defaults do.
GPU_LIKE = Tiling(
    forward=TileConfig(block_m=64, block_n=32, row_tiles=2),
    dq=TileConfig(block_m=64, block_n=32, block_out=64),
    dk=TileConfig(block_m=64, block_n=16, block_out=64),
    resident_d=64,
    chunk_d=32,
)
# The same with the work split: 2 row groups and 3 k splits in the forward, 2 splits per dq/dk block.
SPLIT = GPU_LIKE.with_splits(groups=2, splits=3, backward_splits=2)
# The symmetric forward one row block at a time (the FMA classes' defaults, and every masked call).
SINGLE = dataclasses.replace(GPU_LIKE, forward=dataclasses.replace(GPU_LIKE.forward, row_tiles=1))


# The backend every call of this file runs, passed by the call (backend=TRITON): the GPU-like tiles.
TRITON = triton_backend.TritonBackend(tiling=GPU_LIKE)


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


def _ours(q, k, scale, labels=None, symmetric=False, reduction="mean", upstream=None, backend=TRITON):
    return grads_of(
        lambda q_, k_, s_: cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, reduction=reduction, backend=backend),
        q,
        k,
        scale,
        upstream,
    )


def _compare(q, k, scale, labels=None, symmetric=False, reduction="mean", upstream=None, backend=TRITON):
    """Our (loss, dq, dk, dscale) in q's dtype and the float64 vanilla truth on the same values."""
    truth = grads_of(
        lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_, symmetric, reduction),
        q.double(),
        k.double(),
        scale.double(),
        upstream,
    )
    return _ours(q, k, scale, labels, symmetric, reduction, upstream, backend), truth


def _torch_in_dtype(q, k, scale, labels, symmetric, reduction="mean", upstream=None):
    """Torch's own vanilla loss computed in q's dtype (the low-precision baseline)."""
    return grads_of(
        lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_.to(q.dtype), symmetric, reduction), q, k, scale, upstream
    )


def _assert_exact(ours, truth, dtype, what):
    atol, rtol = TOLERANCE[dtype]
    for name, a, e in zip(GRAD_NAMES, ours, truth):
        assert_close_verbose(a, e, atol, rtol, f"{what} {name}")


# ---- against the float64 vanilla loss -----------------------------------------------------------


@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("batch,dim", SHAPES)
def test_float64_matches_vanilla(batch, dim, symmetric):
    q, k, scale = _inputs(batch, batch, dim)
    labels = _labels(batch, batch, True, seed=dim) if symmetric else None
    ours, truth = _compare(q, k, scale, labels, symmetric)
    _assert_exact(ours, truth, torch.float64, f"B={batch} D={dim} symmetric={symmetric}")


@pytest.mark.parametrize("batch,dim", SHAPES)
def test_float32_matches_vanilla(batch, dim):
    symmetric = dim in (40, 200)  # the float64 test crosses both losses; here half the dims each
    q, k, scale = _inputs(batch, batch, dim, dtype=torch.float32)
    ours, truth = _compare(q, k, scale, symmetric=symmetric, reduction="sum")
    _assert_exact(ours, truth, torch.float32, f"B={batch} D={dim} symmetric={symmetric}")


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_whole_chunks_with_a_ragged_last_slice(dtype):
    """D = 96: three whole 32-wide chunks and dq / dk slices of 64 + 32, so the last slice's operand is a masked
    load past D (the path D = 384 takes on sm_90's 128-wide chunks and 256-wide slices), on a ragged batch in
    both directions."""
    q, k, scale = _inputs(33, 33, 96, dtype=dtype)
    ours, truth = _compare(q, k, scale, _labels(33, 33, True, seed=96), symmetric=True)
    _assert_exact(ours, truth, dtype, "B=33 D=96 symmetric")


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
@pytest.mark.parametrize("bq,bk,dim,symmetric", ((70, 70, 72, True), (33, 33, 200, False), (33, 150, 40, False)))
def test_low_precision_no_worse_than_torch(dtype, bq, bk, dim, symmetric):
    """70 rows: a full 64-row block and a ragged one (the multi-block cross is test_float64_matches_vanilla's)."""
    q, k, scale = _inputs(bq, bk, dim, seed=7, dtype=dtype)
    labels = _labels(bq, bk, symmetric)
    ours, truth = _compare(q, k, scale, labels, symmetric)
    torch_lowp = _torch_in_dtype(q, k, scale, labels, symmetric)
    atol, rtol = TOLERANCE[dtype]
    for name, a, t, e in zip(GRAD_NAMES, ours, torch_lowp, truth):
        assert_no_worse(a, t, e, atol, rtol, f"{dtype} Bq={bq} Bk={bk} D={dim} {name}")


@pytest.mark.parametrize("symmetric", (False, True))
def test_split_work_matches_vanilla(symmetric):
    """Row groups and k splits (forward) and split dq/dk blocks (backward), merged in a fixed order."""
    q, k, scale = _inputs(130, 130, 72, seed=16)
    labels = _labels(130, 130, True) if symmetric else None
    ours, truth = _compare(q, k, scale, labels, symmetric, backend=triton_backend.TritonBackend(tiling=SPLIT))
    _assert_exact(ours, truth, torch.float64, f"split symmetric={symmetric}")


def test_interpreter_default_tiles():
    """No tiling: the interpreter's big tiles here (INTERPRETER_TILING), the device's defaults on a GPU."""
    # 130 rows: a full 128-row tile and a ragged one; D = 1030: 16 whole 64-wide chunks, a ragged one, and
    # a 1024-wide output slice plus a ragged one.
    q, k, scale = _inputs(130, 130, 1030, seed=15, dtype=torch.float32)
    untiled = triton_backend.TritonBackend(tiling=None)
    ours, truth = _compare(q, k, scale, _labels(130, 130, True), symmetric=True, backend=untiled)
    _assert_exact(ours, truth, torch.float32, "default tiles")


# ---- hard numerics ------------------------------------------------------------------------------


def _stats(s):
    """(m, r) per row of s, with r = log1p(rest) and rest = sum(exp(s - m)) - 1 taken without the 1."""
    m = s.amax(dim=1, keepdim=True)
    at_max = s == m
    rest = torch.where(at_max, 0.0, torch.exp(s - m)).sum(1, keepdim=True) + (at_max.sum(1, keepdim=True) - 1)
    return m, torch.log1p(rest)


def _grad_part(s, m, r, g, onehot):
    """g * (P - Y) with P = exp((s - m) - r), the positive's entry as g * expm1(x)."""
    x = (s - m) - r
    return g * torch.where(onehot, torch.expm1(x), torch.exp(x))


def careful_float64(q, k, scale, labels, symmetric, reduction="mean", upstream=None):
    """(loss, dq, dk, dscale) of the loss in float64 written so that confident rows keep their digits:
    r = log1p(rest) and 1 - p = -expm1(...), as the kernels do. The materialized float64 loss rounds
    log(1 + 1e-19) to 0 and p = 1 - 1e-19 to 1, so its "truth" for a confident row is off by the whole
    gradient; this one is accurate to float64 round-off (and equals it on ordinary inputs, see
    test_careful_reference_equals_vanilla)."""
    q, k, scale = q.double(), k.double(), scale.double()
    n = q.shape[0]
    labels = torch.arange(n, device=q.device) if labels is None else labels
    raw = q @ k.T
    s = scale * raw
    rows = torch.zeros_like(s, dtype=torch.bool)
    rows[torch.arange(n), labels] = True
    m_r, r_r = _stats(s)
    per_item = (m_r - s[rows][:, None] + r_r)[:, 0]
    if symmetric:
        m_c, r_c = _stats(s.T)
        col_loss = (m_c - s.T[rows.T][:, None] + r_c)[:, 0]
        per_item = (per_item + col_loss) / 2
    weight = {"mean": 1.0 / n, "sum": 1.0, "none": 1.0}[reduction]
    g = torch.full((n,), weight, dtype=torch.float64, device=q.device)
    if upstream is not None:
        g = g * upstream.double()
    loss = {"mean": per_item.mean, "sum": per_item.sum, "none": lambda: per_item}[reduction]()
    half = 0.5 if symmetric else 1.0
    ds = _grad_part(s, m_r, r_r, half * g[:, None], rows)
    if symmetric:
        ds = ds + _grad_part(s.T, m_c, r_c, half * g[:, None], rows.T).T
    return loss, scale * ds @ k, scale * ds.T @ q, (ds * raw).sum()


def test_careful_reference_equals_vanilla():
    q, k, scale = _inputs(40, 40, 24, seed=19)
    labels = _labels(40, 40, True)
    upstream = torch.randn(40, generator=torch.Generator().manual_seed(18), dtype=torch.float64).to(DEVICE)
    for symmetric in (False, True):
        careful = careful_float64(q, k, scale, labels, symmetric, "none", upstream)
        vanilla = grads_of(
            lambda q_, k_, s_, sym=symmetric: vanilla_loss(q_, k_, labels, s_, sym, "none"), q, k, scale, upstream
        )
        _assert_exact(careful, vanilla, torch.float64, f"careful reference symmetric={symmetric}")


# Output rounding: a gradient returned in a low-precision dtype is at least half an ulp off.
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-9, torch.float16: 2.0**-11, torch.float64: 2.0**-53}


def _assert_within_factor_of_torch(ours, torch_lowp, truth, factor, dtype, what):
    """Per output (loss, dq, dk, dscale), in the 2-norm: |ours - truth| <= factor * |torch - truth| plus
    half an ulp of |truth| in ``dtype`` (the rounding of the result itself). Norm-wise, not entry by
    entry: both sides round dS to ``dtype`` for the products, so single entries where torch's rounding
    happens to land closer say nothing about the method."""
    for name, a, t, e in zip(GRAD_NAMES, ours, torch_lowp, truth):
        a, t, e = (x.detach().to(torch.float64).cpu() for x in (a, t, e))
        err, torch_err, size = (a - e).norm(), (t - e).norm(), e.norm()
        assert err <= factor * torch_err + HALF_ULP[dtype] * size, (
            f"{what} {name}: error {err:.3g} > {factor} x torch's {torch_err:.3g} + half an ulp of |truth| = {size:.3g}"
        )


def _confident(bq, dim, margin_scale, dtype, seed):
    """Positives far above the negatives: k_i is q_i plus a little noise, logits scale * cos."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(bq, dim, generator=gen, dtype=torch.float64), dim=1)
    k = torch.nn.functional.normalize(
        q + 0.3 * torch.randn(bq, dim, generator=gen, dtype=torch.float64) / dim**0.5, dim=1
    )
    scale = torch.tensor(margin_scale, dtype=torch.float64, device=DEVICE)
    return q.to(device=DEVICE, dtype=dtype), k.to(device=DEVICE, dtype=dtype), scale


@pytest.mark.parametrize(
    "dtype,scale,symmetric",
    (
        (torch.float32, 100.0, True),
        (torch.float32, 30.0, False),
        (torch.bfloat16, 60.0, True),
        (torch.float16, 30.0, True),
        (torch.bfloat16, 30.0, False),
    ),
)
def test_confident_batches_no_worse_than_torch(dtype, scale, symmetric):
    """Confident rows: 1 - p of order 1e-5 .. 1e-30. The gradient at the positive is formed as g * expm1(x)
    in fp32 before any rounding, so it keeps its digits where torch's own loss in that dtype does not."""
    q, k, scale_t = _confident(70, 48, scale, dtype, seed=20)
    labels = torch.randperm(70, generator=torch.Generator().manual_seed(21)).to(DEVICE) if symmetric else None
    if labels is not None:
        k = k[torch.argsort(labels)]  # row i's positive (its noisy copy) sits at column labels[i]
    ours = _ours(q, k, scale_t, labels, symmetric)
    truth = careful_float64(q, k, scale_t, labels, symmetric)
    torch_lowp = _torch_in_dtype(q, k, scale_t, labels, symmetric)
    _assert_within_factor_of_torch(ours, torch_lowp, truth, 2.0, dtype, f"confident {dtype} scale={scale}")


def test_float16_small_gradients_do_not_flush(monkeypatch):
    """Mean over many rows: g * p is ~1e-8, below float16's normal range. Each dS row is divided by the
    largest |g| reaching it before the float16 products, so dq and dk keep float16 accuracy."""
    q, k, scale = _inputs(300, 300, 24, seed=22, dtype=torch.float16)
    labels = _labels(300, 300, True)
    upstream = torch.full((), 1e-3, dtype=torch.float64, device=DEVICE)  # on top of the 1/300 of the mean
    ours = _ours(q, k, scale, labels, True, upstream=upstream)
    truth = careful_float64(q, k, scale, labels, True, upstream=upstream)
    torch_lowp = _torch_in_dtype(q, k, scale, labels, True, upstream=upstream)
    _assert_within_factor_of_torch(ours, torch_lowp, truth, 1.0, torch.float16, "fp16 small gradients")
    rel = (ours[1].double() - truth[1]).norm() / truth[1].norm()
    assert rel < 4 * 2.0**-11, f"dq relative error {rel:.3g}: float16 products flushed small dS to zero"


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("magnitude", (1e4, 1e6))
def test_huge_unnormalized_logits(dtype, magnitude):
    """|S| ~ 1e4 .. 1e6 (raw features, scale 1): the stats never overflow, every row loss is >= 0 and
    the gradients are no worse than torch's in that dtype (float64: exact)."""
    gen = torch.Generator().manual_seed(23)
    dim = 40
    q = (torch.randn(50, dim, generator=gen, dtype=torch.float64) * (magnitude / dim) ** 0.5).to(DEVICE, dtype)
    k = (torch.randn(50, dim, generator=gen, dtype=torch.float64) * (magnitude / dim) ** 0.5).to(DEVICE, dtype)
    scale = torch.tensor(1.0, dtype=torch.float64, device=DEVICE)
    labels = _labels(50, 50, True, seed=24)
    ours = _ours(q, k, scale, labels, True, reduction="none")
    truth = careful_float64(q, k, scale, labels, True, reduction="none")
    assert torch.isfinite(ours[0]).all() and (ours[0] >= 0).all()
    if dtype == torch.float64:
        atol, rtol = TOLERANCE[dtype]
        for name, a, e in zip(GRAD_NAMES, ours, truth):
            assert_close_verbose(a, e, atol * magnitude, rtol, f"huge {magnitude:g} {name}")
        return
    torch_lowp = _torch_in_dtype(q, k, scale, labels, True, reduction="none")
    _assert_within_factor_of_torch(ours, torch_lowp, truth, 2.0, dtype, f"huge {magnitude:g}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_negated_upstream_gives_negated_gradients_exactly(dtype):
    """grad(-w) = -grad(w) bit for bit, with zeros and negative entries in w (reduction='none')."""
    q, k, scale = _inputs(70, 70, 40, seed=25, dtype=dtype)
    labels = _labels(70, 70, True)
    w = torch.randn(70, generator=torch.Generator().manual_seed(26), dtype=torch.float64).to(DEVICE)
    w[::7] = 0.0
    plus = _ours(q, k, scale, labels, True, "none", w)
    minus = _ours(q, k, scale, labels, True, "none", -w)
    for name, a, b in zip(GRAD_NAMES[1:], plus[1:], minus[1:]):
        assert torch.equal(a, -b), f"{name}: grad(-w) != -grad(w)"


def test_two_calls_are_bit_identical():
    """No atomics, fixed merge orders: the same inputs give the same bits (splits included)."""
    split = triton_backend.TritonBackend(tiling=SPLIT)
    q, k, scale = _inputs(100, 100, 72, seed=27, dtype=torch.float32)
    labels = _labels(100, 100, True)
    first = _ours(q, k, scale, labels, True, backend=split)
    second = _ours(q, k, scale, labels, True, backend=split)
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two calls"


@pytest.mark.parametrize("dtype,scale", ((torch.float32, 100.0), (torch.bfloat16, 60.0), (torch.float64, 100.0)))
def test_row_losses_are_never_negative(dtype, scale):
    """loss_i = (m - positive) + r with the positive read off the same tile as m: never below 0, even
    for rows whose loss rounds to 0."""
    q, k, scale_t = _confident(90, 32, scale, dtype, seed=28)
    losses = cal_inf_loss(q, k, scale=scale_t, symmetric=True, reduction="none", backend=TRITON)
    assert (losses >= 0).all(), losses.min()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's NaN warnings, in the interpreter
def test_nan_in_nan_out():
    q, k, scale = _inputs(33, 33, 16, seed=11)
    q[5, 3] = float("nan")
    loss = cal_inf_loss(q, k, scale=scale, reduction="none", backend=TRITON)
    expected = vanilla_loss(q, k, scale=scale, reduction="none")
    assert torch.equal(torch.isnan(loss), torch.isnan(expected)) and torch.isnan(loss[5])


# ---- the block contract alone -------------------------------------------------------------------


def _random_block(bq, bk, dim, symmetric, seed, dtype=torch.float64, strided=False):
    """A forward and a backward Block with random stats and gradients; pos hits some rows' blocks."""
    q, k, _ = _inputs(bq, bk, dim, seed=seed, dtype=dtype)
    if strided:
        k = k.T.contiguous().T
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    gen = torch.Generator().manual_seed(seed + 1)
    scale = torch.tensor(3.7, dtype=acc, device=DEVICE)
    if symmetric:  # a permutation of the block's columns
        pos = torch.randperm(bk, generator=gen)[:bq]
    else:  # some rows' positives lie in other blocks
        pos = torch.where(torch.rand(bq, generator=gen) < 0.6, torch.randint(0, bk, (bq,), generator=gen), -1)
    pos = pos.to(DEVICE)
    forward = Block(q=q, k=k, scale=scale, pos=pos)
    rows, cols = TORCH_TILES.forward_block(forward, symmetric)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=acc).to(DEVICE)

    backward = dataclasses.replace(
        forward,
        row_stats=rows[:2],
        g_row=rand(bq),
        col_stats=cols if symmetric else None,
        g_col=rand(bk) if symmetric else None,
    )
    return forward, backward, rand(bq, dim), rand(dim, bk).T  # a strided dk accumulator


@pytest.mark.parametrize("tiling", (GPU_LIKE, SPLIT, SINGLE), ids=("gpu-like", "split", "single-row-blocks"))
@pytest.mark.parametrize(
    "bq,bk,dim,symmetric,strided",
    (
        (33, 50, 40, True, False),
        (33, 50, 72, False, True),
        (45, 70, 200, True, True),
        (1, 17, 3, False, False),
        # 128 rows: a whole pair of row blocks; 200: two pairs, the second's second block past the end
        (128, 130, 72, True, False),
        (200, 210, 40, True, True),
    ),
)
def test_blocks_match_torch_tiles(tiling, bq, bk, dim, symmetric, strided):
    """forward_block / backward_block alone equal the torch tiles (the reference of the contract),
    accumulating into given dq / dk; the positive logits come from the same tiles as the stats."""
    backend = triton_backend.TritonBackend(tiling=tiling)
    forward, backward, dq0, dk0 = _random_block(bq, bk, dim, symmetric, seed=bq + dim, strided=strided)
    ours, ref = backend.forward_block(forward, symmetric), TORCH_TILES.forward_block(forward, symmetric)
    assert_close_verbose(ours[0], ref[0], 1e-12, 1e-12, "forward rows (max, rel, positive)")
    if symmetric:
        assert_close_verbose(ours[1], ref[1], 1e-12, 1e-12, "forward cols (max, rel)")
    else:
        assert ours[1] is None
    results = []
    for impl in (backend, TORCH_TILES):
        dq, dk = dq0.clone(), dk0.clone()
        results.append((dq, dk, impl.backward_block(backward, dq, dk)))
    for name, a, e in zip(("dq", "dk", "dscale"), *results):
        assert_close_verbose(a, e, 1e-12, 1e-10, f"backward {name} symmetric={symmetric}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf - inf warnings, in the interpreter
def test_blocks_with_an_infinite_logit():
    """+inf in the features: the row's stats are NaN-free only where F.cross_entropy's are (its loss is
    NaN after the ring's finiteness check), and no other row is touched."""
    forward, _, _, _ = _random_block(20, 20, 16, True, seed=29)
    q = forward.q.clone()
    q[3, 0] = float("inf")
    block = dataclasses.replace(forward, q=q)
    with torch.no_grad():
        rows, cols = triton_backend.TritonBackend(tiling=GPU_LIKE).forward_block(block, True)
        ref_rows, ref_cols = TORCH_TILES.forward_block(block, True)
    assert torch.equal(torch.isfinite(rows[:2]).all(0), torch.isfinite(ref_rows[:2]).all(0))
    keep = torch.arange(20, device=DEVICE) != 3
    assert_close_verbose(rows[:, keep], ref_rows[:, keep], 1e-12, 1e-12, "rows other than the infinite one")


# ---- plumbing -----------------------------------------------------------------------------------


def test_custom_ops_pass_opcheck():
    """The custom ops' schemas, fake impls and mutation declarations hold (torch.library.opcheck)."""
    forward, backward, dq, dk = _random_block(20, 24, 16, True, seed=30)
    tiling = GPU_LIKE.to_ints()
    torch.library.opcheck(
        torch.ops.infcl.triton_forward_block.default,
        (forward.q, forward.k, forward.scale, forward.pos, True, "ieee", tiling),
    )
    b = backward
    torch.library.opcheck(
        torch.ops.infcl.triton_backward_block.default,
        (b.q, b.k, b.scale, b.pos, b.row_stats, b.g_row, b.col_stats, b.g_col, dq.clone(), dk.clone(), "ieee", tiling),
    )


def test_torch_compile_matches_eager():
    """The custom ops' fake impls let torch.compile trace cal_inf_loss (here the custom_op registration;
    on a GPU the triton_op one, which tests/test_triton_gpu.py compiles)."""
    q, k, scale = _inputs(40, 40, 16, seed=31)
    labels = _labels(40, 40, True)

    def loss(q_, k_, s_):
        return cal_inf_loss(q_, k_, labels, s_, symmetric=True, backend=TRITON)

    eager = grads_of(loss, q, k, scale)
    compiled = grads_of(torch.compile(loss, backend="aot_eager"), q, k, scale)
    for name, a, b in zip(GRAD_NAMES, compiled, eager):
        assert torch.equal(a, b), name


def test_tiling_round_trips_through_ints():
    assert Tiling.from_ints(SPLIT.to_ints()) == SPLIT
    assert Tiling.from_ints(GPU_LIKE.to_ints()) == GPU_LIKE


def test_autotune_restores_every_buffer_a_trial_writes():
    """INFCL_AUTOTUNE=1 benchmarks configs on the real buffers: each trial must start from the same state."""
    from infcl.kernels import softmax_backward, softmax_forward

    forward, dq, dk = (
        f()
        for f in (softmax_forward._forward_autotuned, softmax_backward._dq_autotuned, softmax_backward._dk_autotuned)
    )
    assert set(forward.restore_value) == {"rows_ptr", "cols_ptr"}
    assert set(dq.restore_value) == {"out_ptr"} and set(dq.reset_to_zero) == {"dscale_ptr"}
    assert set(dk.restore_value) == {"out_ptr"}
    for tuner in (forward, dq, dk):
        assert {"D", "PRECISION", "BUCKET"} <= set(tuner.keys)


def test_auto_picks_triton_for_cuda_tensors():
    assert resolve_backend("auto", torch.device("cuda")) == "triton"


def test_unavailable_reason_is_a_sentence_elsewhere():
    assert "CUDA" in unavailable_reason("triton", torch.device("meta"))


def test_bad_launch_options_raise():
    from infcl.kernels.kernel_args import launch_options

    with pytest.raises(ValueError, match="block_m"):
        TileConfig(block_m=8, block_n=64)
    with pytest.raises(ValueError, match="block_out"):
        TileConfig(block_m=64, block_n=64, block_out=48)
    with pytest.raises(ValueError, match="chunk_d"):
        dataclasses.replace(GPU_LIKE, chunk_d=24)
    with pytest.raises(ValueError, match="splits"):
        GPU_LIKE.with_splits(splits=0)
    with pytest.raises(ValueError, match="precision"):
        launch_options(torch.float32, "fast")
    with pytest.raises(ValueError, match="precision"):
        triton_backend.TritonBackend(precision="fast")


def _tf32_nearest(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to 10 mantissa bits, to nearest with ties away from zero, in float64 arithmetic
    (subnormals on float32's fixed grid)."""
    v = x.double()
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-126))).clamp_min(-126)
    ulp = torch.exp2(exponent - 10)
    return (torch.sign(v) * torch.floor(v.abs() / ulp + 0.5) * ulp).float()


def test_round_to_tf32_is_nearest_ties_away():
    """configs.round_to_tf32 (the tf32 products' operands) against a float64 rounding: random values over
    the whole range, subnormals, exact ties both ways, the largest float (inf), inf and NaN."""
    from infcl.kernels.kernel_args import round_to_tf32

    gen = torch.Generator().manual_seed(0)
    mantissas = torch.rand(4000, generator=gen, dtype=torch.float64) + 1
    exponents = torch.randint(-149, 127, (4000,), generator=gen).double()
    x = (mantissas * torch.exp2(exponents) * torch.where(torch.rand(4000, generator=gen) < 0.5, -1.0, 1.0)).float()
    ties = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11), 2.0**-140 + 2.0**-149 * 2**12])
    x = torch.cat([x, ties.float()])
    expected = _tf32_nearest(x)
    rounded = round_to_tf32(x)
    assert torch.equal(rounded, expected), (x[rounded != expected][:5], rounded[rounded != expected][:5])
    assert torch.equal(rounded[-4:-1], torch.tensor([1 + 2.0**-10, 1 + 4 * 2.0**-10 / 2, -(1 + 2.0**-10)]))
    assert (rounded.view(torch.int32) & (2**13 - 1) == 0).all()
    special = torch.tensor([torch.finfo(torch.float32).max, float("inf"), -float("inf"), float("nan"), 0.0, -0.0])
    out = round_to_tf32(special)
    assert out[0] == float("inf") and out[1] == float("inf") and out[2] == -float("inf") and out[3].isnan()
    assert torch.equal(out[4:].view(torch.int32), special[4:].view(torch.int32))  # signed zeros kept
    strided = x.view(-1, 2)[:, 0]
    assert torch.equal(round_to_tf32(strided), expected.view(-1, 2)[:, 0])


def test_float32_precision_follows_torchs_setting(float32_matmul):
    """None resolves to torch's float32 matmul precision, set either way: the legacy allow_tf32 or (torch
    2.9+) fp32_precision, whose "tf32" makes reading allow_tf32 raise."""
    from infcl.kernels.kernel_args import torch_matmul_precision

    matmul = float32_matmul(True)
    assert torch_matmul_precision() == "tf32" and triton_backend.TritonBackend()._options()[0] == "tf32"
    float32_matmul(False)
    assert torch_matmul_precision() == "ieee"
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has no fp32_precision")
    matmul.fp32_precision = "tf32"  # the fixture restores the saved precision, whichever API set it
    assert torch_matmul_precision() == "tf32" and triton_backend.TritonBackend()._options()[0] == "tf32"
    matmul.fp32_precision = "ieee"
    assert torch_matmul_precision() == "ieee"
