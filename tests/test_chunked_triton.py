"""The chunked route's Triton passes (infcl/kernels/chunked_softmax.py) under TRITON_INTERPRET=1 on CPU tensors:
against the torch passes on the same scores, and the whole route with them against the float64 truth. (Compiled
for sm_80/90/100 by tests/test_triton_api_compile.py's chunked calls.)"""

import pytest
import torch

from helpers import truth
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
from infcl import cal_inf_loss
from infcl.backends import chunked
from infcl.backends.chunked import ChunkedBackend, torch_passes
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

    def loss(q_, k_, s_):
        return cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, reduction="none", backend="chunked")

    saved = chunked.BACKEND
    chunked.BACKEND = ChunkedBackend(chunk_rows=rows, passes="triton")
    try:
        ours = grads_of(loss, q, k, scale, w)
        again = grads_of(loss, q, k, scale, w)
    finally:
        chunked.BACKEND = saved
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, labels, s_, symmetric), q, k, scale.double(), w)
    atol, rtol = TOLERANCE[dtype]
    for name, a, b, c in zip(("loss", "dq", "dk", "dscale"), ours, want, again):
        assert torch.equal(a, c), f"{name}: a rerun differs"
        assert_close_verbose(a, b, atol, rtol, f"{dtype} {name}")


def test_confident_rows_are_exact(kernels):
    q, k, labels = margin_features(48, 32, 100.0, True, seed=9)
    q, k, scale = q.float(), k.float(), torch.tensor(100.0)
    saved = chunked.BACKEND
    chunked.BACKEND = ChunkedBackend(chunk_rows=11, passes="triton")
    try:
        ours = grads_of(lambda q_, k_, s_: cal_inf_loss(q_, k_, labels, s_, symmetric=True, reduction="none",
                                                       backend="chunked"), q, k, scale)  # fmt: skip
    finally:
        chunked.BACKEND = saved
    assert_normwise(ours, exact_softmax_truth(q, k, scale, labels, True), EXACT_NORMWISE[torch.float32], "confident")


def test_tied_maxima_and_nan(kernels):
    """Exact ties at the maxima (small-integer features, repeated rows) across row blocks, splits and chunks, and a
    NaN feature's row, through the Triton passes."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randint(-1, 2, (70, 6), generator=gen).double()
    k = q[torch.randint(0, 70, (70,), generator=gen)]
    k[::3] = q[::3]
    scale = torch.tensor(3.0)

    def loss(q_, k_, s_):
        return cal_inf_loss(q_, k_, None, s_, symmetric=True, reduction="none", backend="chunked")

    saved = chunked.BACKEND
    chunked.BACKEND = ChunkedBackend(chunk_rows=33, passes="triton")
    try:
        ours = grads_of(loss, q.float(), k.float(), scale)
        bad = q.float().clone()
        bad[5, 1] = float("nan")
        rows = cal_inf_loss(bad, k.float(), None, 3.0, reduction="none", backend="chunked")
    finally:
        chunked.BACKEND = saved
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, None, s_, True), q, k, scale.double())
    for name, a, b in zip(("loss", "dq", "dk", "dscale"), ours, want):
        assert_close_verbose(a, b, 1e-5, 1e-5, f"ties {name}")
    assert torch.isnan(rows).tolist() == [i == 5 for i in range(70)]
