"""The chunked route's Triton passes (infcl/kernels/chunked_softmax.py) under TRITON_INTERPRET=1 on CPU tensors:
against the torch passes on the same scores, and the whole route with them against the float64 truth. (Compiled
for sm_80/90/100 by tests/test_triton_api_compile.py's chunked calls.)"""

import pytest
import torch

from helpers import truth
from helpers.live_buffers import LiveBuffers, recording_inside
from helpers.support import (
    EXACT_NORMWISE,
    TOLERANCE,
    assert_close_verbose,
    assert_normwise,
    exact_softmax_truth,
    features_and_labels,
    grads_of,
    interpreting_triton,
    margin_features,
)
from infcl import cal_inf_loss, cal_siglip_loss
from infcl.backends.chunked import ChunkedBackend, plan, products, torch_passes
from infcl.contract import Block
from infcl.lse import lse_merge

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not interpreting_triton(), reason="the Triton passes on CPU tensors need TRITON_INTERPRET=1"),
]


@pytest.fixture
def kernels(monkeypatch):
    """The passes' module with one tile a split and two partials a load of the merge, so that small chunks have
    several splits and row blocks to merge, over several loads."""
    from infcl.kernels import chunked_softmax

    monkeypatch.setattr(chunked_softmax, "CHUNK_SPLIT_TILES", 1)
    monkeypatch.setattr(chunked_softmax, "CHUNK_MERGE_PARTS", 2)
    return chunked_softmax


@pytest.fixture
def sigmoid_kernels(monkeypatch):
    """The sigmoid pass's module with one tile a split (as :func:`kernels`)."""
    from infcl.kernels import chunked_sigmoid

    monkeypatch.setattr(chunked_sigmoid, "CHUNK_SPLIT_TILES", 1)
    return chunked_sigmoid


def _scores(c, n, seed):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(c, n, generator=gen) * 0.4
    pos = torch.randint(0, n, (c,), generator=gen)
    pos[::3] = -1  # positives in other blocks
    return raw, pos


def _scratch(c, n):
    return [torch.empty(c, n) for _ in range(2)]


@pytest.mark.parametrize("c,n", ((5, 300), (64, 129), (70, 40), (130, 70)))
@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
def test_stats_pass_matches_the_torch_pass(kernels, c, n, symmetric):
    raw, pos = _scores(c, n, seed=c + n)
    scale = torch.tensor(11.0)
    rows, want_rows = torch.empty(3, c), torch.empty(3, c)
    cols = kernels.chunk_stats(raw.clone(), scale, pos, symmetric, rows)
    want_cols = torch_passes.chunk_stats(raw.clone(), scale, pos, symmetric, want_rows, _scratch(c, n))
    assert_close_verbose(rows, want_rows, 1e-6, 1e-6, "rows")
    if symmetric:
        assert_close_verbose(cols, want_cols, 1e-6, 1e-6, "cols")


def test_stats_pass_merges_a_chunk_into_the_running_columns(kernels):
    """chunk_stats(..., cols) merges the chunk's column stats into the running ones in place, as lse_merge of the
    chunk's stats would: an empty running column (the first chunk's), a column whose running max is far above the
    chunk's and one far below, and a NaN running column."""
    c, n = 37, 130
    raw, pos = _scores(c, n, seed=11)
    scale = torch.tensor(11.0)
    running = torch.randn(2, n, generator=torch.Generator().manual_seed(12)).abs()
    running[0, :10] = float("-inf")  # empty so far
    running[1, :10] = float("-inf")
    running[0, 10:20] += 80.0  # the running max far above the chunk's
    running[0, 20:30] -= 80.0  # far below
    running[:, 30] = float("nan")
    want = lse_merge(running.clone(), kernels.chunk_stats(raw.clone(), scale, pos, True, torch.empty(3, c)))
    got = running.clone()
    assert kernels.chunk_stats(raw.clone(), scale, pos, True, torch.empty(3, c), got) is got
    assert torch.isnan(got[:, 30]).all() and not torch.isnan(got[:, 31:]).any()
    keep = torch.arange(n) != 30
    assert_close_verbose(got[:, keep], want[:, keep], 1e-6, 1e-6, "running cols")


@pytest.mark.parametrize("operand", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
def test_grad_pass_matches_the_torch_pass(kernels, operand, symmetric):
    c, n = 37, 300
    raw, pos = _scores(c, n, seed=3)
    scale = torch.tensor(11.0)
    rows = torch.empty(3, c)
    cols = kernels.chunk_stats(raw.clone(), scale, pos, symmetric, rows)
    gen = torch.Generator().manual_seed(4)
    g_row, g_col = torch.randn(c, generator=gen), torch.randn(n, generator=gen)
    g_row[::4] = 0.0
    factor = 1 / g_row.abs().clamp_min(0.5) if operand == torch.float16 else scale
    args = (scale, factor, pos, rows[:2].contiguous(), g_row, cols if symmetric else None, g_col, operand)
    ds, want_ds = torch.empty(c, n), torch.empty(c, n)
    dscale = kernels.chunk_grad(raw, ds, *args)
    want_dscale = torch_passes.chunk_grad(raw, want_ds, *args, _scratch(c, n))
    assert torch.equal(ds.to(operand).float(), ds), "dS is not rounded to the operand dtype"
    # Up to two roundings of the operand apart, plus the exponentials' own |x| * 2**-24 (torch's exp2 on CPU) of
    # the terms, which the symmetric loss's row and column terms may cancel.
    slack = 4e-6 * float(want_ds.abs().max())
    assert_close_verbose(ds, want_ds, slack, 2 * torch.finfo(operand).eps, "dS")
    assert_close_verbose(dscale, want_dscale, 1e-6, 1e-5, "dscale")


@pytest.mark.parametrize(
    "dtype,bq,bk,rows,symmetric",
    (
        (torch.float32, 37, 37, 5, True),
        (torch.bfloat16, 23, 150, 7, False),
        (torch.float16, 40, 40, 16, True),
    ),
    ids=("fp32-symmetric", "bf16-labels-wide", "fp16-symmetric"),
)
def test_route_against_float64_truth(kernels, dtype, bq, bk, rows, symmetric):
    q, k, labels = features_and_labels(bq, bk, 24, "perm" if symmetric else "random", dtype, seed=rows)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(bq, generator=gen, dtype=torch.float64)
    scale = torch.tensor(12.0)

    route = ChunkedBackend(chunk_rows=rows, passes="triton")

    def loss(q_, k_, s_):
        return cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, reduction="none", backend=route)

    ours = grads_of(loss, q, k, scale, w)
    again = grads_of(loss, q, k, scale, w)
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, labels, s_, symmetric), q, k, scale.double(), w)
    atol, rtol = TOLERANCE[dtype]
    for name, a, b, c in zip(("loss", "dq", "dk", "dscale"), ours, want, again):
        assert torch.equal(a, c), f"{name}: a rerun differs"
        assert_close_verbose(a, b, atol, rtol, f"{dtype} {name}")


def test_confident_rows_are_exact(kernels):
    q, k, labels = margin_features(48, 32, 100.0, True, seed=9)
    q, k, scale = q.float(), k.float(), torch.tensor(100.0)
    route = ChunkedBackend(chunk_rows=11, passes="triton")
    ours = grads_of(lambda q_, k_, s_: cal_inf_loss(q_, k_, labels, s_, symmetric=True, reduction="none",
                                                   backend=route), q, k, scale)  # fmt: skip
    assert_normwise(ours, exact_softmax_truth(q, k, scale, labels, True), EXACT_NORMWISE[torch.float32], "confident")


def test_tied_maxima_and_nan(kernels):
    """Exact ties at the maxima (small-integer features, repeated rows) across row blocks, splits and chunks, and a
    NaN feature's row, through the Triton passes."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randint(-1, 2, (70, 6), generator=gen).double()
    k = q[torch.randint(0, 70, (70,), generator=gen)]
    k[::3] = q[::3]
    scale = torch.tensor(3.0)

    route = ChunkedBackend(chunk_rows=33, passes="triton")

    def loss(q_, k_, s_):
        return cal_inf_loss(q_, k_, None, s_, symmetric=True, reduction="none", backend=route)

    ours = grads_of(loss, q.float(), k.float(), scale)
    bad = q.float().clone()
    bad[5, 1] = float("nan")
    rows = cal_inf_loss(bad, k.float(), None, 3.0, reduction="none", backend=route)
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, None, s_, True), q, k, scale.double())
    for name, a, b in zip(("loss", "dq", "dk", "dscale"), ours, want):
        assert_close_verbose(a, b, 1e-5, 1e-5, f"ties {name}")
    assert torch.isnan(rows).tolist() == [i == 5 for i in range(70)]


# ---- the budget on a GPU's terms, with stand-ins for its products --------------------------------------------


def _gpu_product_stand_ins(monkeypatch, tracker):
    """cuBLAS's products as the GPU runs them, on CPU tensors: ``mm(out_dtype=float32, out=S)`` writes into the
    workspace and ``addmm(out_dtype=float32, out=acc)`` accumulates in place, allocating nothing (their float32
    arithmetic runs with the tracker paused: the GPU op has no such temporaries)."""

    def mm_f32(a, b, out):
        with tracker.paused():
            torch.mm(a.float(), b.float(), out=out)
        return out

    def addmm_f32(acc, a, b):
        with tracker.paused():
            acc.addmm_(a.float(), b.float())
        return acc

    monkeypatch.setattr(products, "mm_f32", mm_f32)
    monkeypatch.setattr(products, "addmm_f32", addmm_f32)


def _on_a_gpu(in_gemm):
    """The chunked route planning as on a GPU (cuBLAS products, the Triton passes) for CPU tensors, its block
    operations recorded by the innermost LiveBuffers."""

    class OnAGpu(ChunkedBackend):
        def plan(self, block):
            # chunk_rows past any C: the budget alone sizes the chunks (no small-block hand-off)
            return plan.plan_block(block, plan.budget_bytes(self.budget_mb), 10**6, "triton", True, True, in_gemm)

        def for_call(self):
            return self

    return recording_inside(OnAGpu)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("in_gemm", (True, False), ids=("in-gemm", "product-and-add"))
def test_the_budget_is_the_peak_on_a_gpu(kernels, monkeypatch, dtype, in_gemm):
    """The GPU's memory, counted with weak references on CPU tensors: with the products standing in for cuBLAS's
    (allocating as ``torch.mm(out_dtype=, out=)`` and ``addmm`` do) and the Triton passes, the peak inside the
    route's block operations, the float32 dq and dk included, stays within the budget at every chunk, and at most
    two [C, Bk] buffers (S and dS; S alone in the forward) are alive at once. 4 chunks of C = 64 rows."""
    if in_gemm != plan.gemm_accumulates(False, dtype, None) and dtype != torch.bfloat16:
        pytest.skip("float16 always adds a product (its dS rows are rescaled), float32 always accumulates (addmm_)")
    bq, bk, d = 256, 512, 40
    q, k, labels = features_and_labels(bq, bk, d, "random", dtype, seed=12)
    budget_mb = 0.5
    route = _on_a_gpu(in_gemm)(budget_mb=budget_mb)
    c = route.plan(Block(q=q, k=k, scale=torch.tensor(1.0), pos=labels)).rows
    assert c == 64 and bq % c == 0  # whole chunks of the GPU's 64-row alignment: several of them
    sizes = {c * bk * e for e in (4, torch.empty((), dtype=dtype).element_size())}
    q, k, scale = (t.detach().requires_grad_() for t in (q, k, torch.tensor(10.0)))
    with LiveBuffers(sizes) as tracker:
        _gpu_product_stand_ins(monkeypatch, tracker)
        loss = cal_inf_loss(q, k, labels, scale, backend=route)
        forward_sized = tracker.peak_sized
        loss.backward()
    assert 0 < tracker.peak <= budget_mb * 2**20, (tracker.peak, budget_mb)
    assert forward_sized == 1 and tracker.peak_sized == 2


# ---- the sigmoid pass ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("operand", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("what", ("loss", "grad", "both"))
@pytest.mark.parametrize("c,n", ((5, 300), (64, 128), (37, 70)))
def test_sigmoid_pass_matches_the_torch_pass(sigmoid_kernels, operand, what, c, n):
    """Row losses, dS (rounded to the operand) and the (scale, bias) parts, against the torch pass on the same
    scores: ragged and whole tiles, several splits, positives in and out of the chunk, mixed-sign and zero g."""
    raw, pos = _scores(c, n, seed=c * n)
    params = torch.tensor([11.0, -4.0])
    gen = torch.Generator().manual_seed(6)
    g = torch.randn(c, generator=gen)
    g[::4] = 0.0
    factor = 1 / g.abs().clamp_min(0.5) if operand == torch.float16 else params[0]
    loss, want_loss = (torch.empty(c) if what != "grad" else None for _ in range(2))
    ds, want_ds = (torch.empty(c, n) if what != "loss" else None for _ in range(2))
    parts = sigmoid_kernels.sigmoid_chunk(raw, params, pos, loss, ds, factor, g, operand)
    want_parts = torch_passes.sigmoid_chunk(raw, params, pos, want_loss, want_ds, factor, g, operand, _scratch(c, n))
    if loss is not None:
        assert_close_verbose(loss, want_loss, 1e-6, 1e-6, "row losses")
    if ds is None:
        assert parts is None
        return
    assert torch.equal(ds.to(operand).float(), ds), "dS is not rounded to the operand dtype"
    # One rounding of the operand apart, plus the two sigmoids' own few float32 ulps (the fused kernels'
    # e / (1 + e) from e = exp(-|t|) against torch.sigmoid).
    assert_close_verbose(ds, want_ds, 1e-7, 2 * torch.finfo(operand).eps + 8 * 2**-24, "dS")
    assert_close_verbose(parts, want_parts, 1e-6, 1e-5, "(dscale, dbias)")


@pytest.mark.parametrize(
    "dtype,bq,bk,rows,reduction",
    (
        (torch.float32, 37, 37, 5, "mean"),
        (torch.bfloat16, 23, 150, 7, "sum"),
        (torch.float16, 40, 40, 16, "none"),
        (torch.bfloat16, 40, 40, 16, "none"),
    ),
    ids=("fp32-mean", "bf16-labels-wide-sum", "fp16-none", "bf16-none"),
)
def test_sigmoid_route_against_float64_truth(sigmoid_kernels, dtype, bq, bk, rows, reduction):
    """The SigLIP route on the Triton passes (one pass for "mean" / "sum", two for "none") against float64, to the
    tolerance of the dtype relative to the magnitudes of the terms; reruns bit-identical."""
    from helpers.support import grads_of_inputs, siglip_magnitudes, siglip_truth

    q, k, labels = features_and_labels(bq, bk, 24, "random", dtype, seed=rows)
    scale, bias = torch.tensor(10.0), torch.tensor(-5.0)
    gen = torch.Generator().manual_seed(7)
    upstream = torch.randn(bq, generator=gen, dtype=torch.float64) if reduction == "none" else None
    route = ChunkedBackend(chunk_rows=rows, passes="triton")

    def loss(*a):
        return cal_siglip_loss(*a, labels, reduction=reduction, backend=route)

    ours, again = (grads_of_inputs(loss, (q, k, scale, bias), upstream) for _ in range(2))
    want = grads_of_inputs(
        lambda *a: siglip_truth(*a, labels, reduction),
        (q.double(), k.double(), scale.double(), bias.double()),
        upstream,
    )
    sizes = siglip_magnitudes(q, k, scale, bias, labels, reduction, upstream)
    atol, rtol = TOLERANCE[dtype]
    for name, a, b, c, size in zip(("loss", "dq", "dk", "dscale", "dbias"), ours, want, again, sizes):
        assert torch.equal(a, c), f"{name}: a rerun differs"
        assert_close_verbose(a, b, atol, rtol, f"{dtype} {reduction} {name}", magnitude=size)


@pytest.mark.parametrize("in_gemm", (True, False), ids=("in-gemm", "product-and-add"))
def test_the_sigmoid_budget_is_the_peak_on_a_gpu(sigmoid_kernels, monkeypatch, in_gemm):
    """The SigLIP one-pass forward on the GPU's terms (as above): S and dS at once in its forward, nothing of
    [C, Bk] size in its backward, the peak within the budget with the float32 dq and dk it saves."""
    bq, bk, d = 256, 512, 40
    q, k, labels = features_and_labels(bq, bk, d, "random", torch.bfloat16, seed=13)
    route = _on_a_gpu(in_gemm)(budget_mb=0.5)
    c = route.plan(Block(q=q, k=k, scale=torch.tensor(1.0), pos=labels)).rows
    assert c == 64
    q, k, scale, bias = (t.detach().requires_grad_() for t in (q, k, torch.tensor(10.0), torch.tensor(-3.0)))
    with LiveBuffers({c * bk * 4, c * bk * 2}) as tracker:
        _gpu_product_stand_ins(monkeypatch, tracker)
        loss = cal_siglip_loss(q, k, scale, bias, labels, backend=route)
        forward = tracker.peak, tracker.peak_sized
        tracker.peak = tracker.peak_sized = 0
        loss.backward()
    assert 0 < forward[0] <= 0.5 * 2**20 and forward[1] == 2, forward
    assert tracker.peak_sized == 0
