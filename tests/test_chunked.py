"""The chunked route (``backend="chunked"``, issue 45) on CPU tensors: its host loop with float32 products of
float32 copies and the torch passes, against the float64 truth; chunk boundaries, the budget, the hand-offs and
``auto``. Its Triton passes under the interpreter: tests/test_chunked_triton.py. (The shared regimes, loss and
ring suites run it too: ``chunked`` is one of support.tiled_backends.)"""

import contextlib

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
    margin_features,
    vanilla_loss,
)
from infcl import cal_inf_loss, cal_siglip_loss
from infcl.backends import backend_object, chunked, measured_route, resolve
from infcl.backends.chunked import ChunkedBackend, measured_faster, plan
from infcl.contract import Block

LOWP = (torch.float32, torch.bfloat16, torch.float16)
FACTOR, ULPS = 2.0, 4  # as tests/test_regimes.py
# (Bq, Bk, C): C = 1, odd C, Bq not a multiple of C, one chunk (C >= Bq), Bk > Bq.
CHUNKINGS = ((37, 37, 1), (37, 37, 5), (37, 37, 16), (37, 37, 64), (23, 61, 7))


@contextlib.contextmanager
def route(**options):
    """backend="chunked" with ``options`` (ChunkedBackend's) for the duration."""
    saved = chunked.BACKEND
    chunked.BACKEND = ChunkedBackend(**options)
    try:
        yield chunked.BACKEND
    finally:
        chunked.BACKEND = saved


def _loss(labels, symmetric, reduction="none"):
    return lambda q, k, s: cal_inf_loss(q, k, labels, s, symmetric=symmetric, reduction=reduction, backend="chunked")


def _upstream(n, seed=3):
    """Mixed signs, zeros and one large weight: every gradient path."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen, dtype=torch.float64) * 2
    w[::5] = 0.0
    w[n // 2] = 50.0
    return w


# CPU tensors here; on a machine with a GPU also CUDA tensors (cuBLAS products with float32 output, Triton passes).
DEVICES = ("cpu",) + (("cuda",) if torch.cuda.is_available() else ())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("bq,bk,rows", CHUNKINGS)
@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
def test_against_float64_truth(device, dtype, bq, bk, rows, symmetric):
    """Loss, dq, dk and the scale gradient against float64, under mixed-sign and zero upstream gradients, labels
    (a permutation, or any column with Bk > Bq), every chunking: no worse than torch's own loss in that dtype."""
    if symmetric and bq != bk:
        pytest.skip("the symmetric loss pairs every row with a column")
    q, k, labels = features_and_labels(bq, bk, 24, "perm" if symmetric else "random", dtype, seed=bq + rows)
    scale = torch.tensor(12.0)
    w = _upstream(bq)
    with route(chunk_rows=rows):
        on = [t.to(device) for t in (q, k, scale)]
        ours = [t.cpu() for t in grads_of(_loss(labels.to(device), symmetric), *on, w.to(device))]
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, labels, s_, symmetric), q, k, scale.double(), w)
    atol, rtol = TOLERANCE[dtype]
    if dtype == torch.float32:
        for name, a, b in zip(("loss", "dq", "dk", "dscale"), ours, want):
            assert_close_verbose(a, b, atol, rtol, f"{name} C={rows}")
        return
    vanilla = grads_of(lambda q_, k_, s_: vanilla_loss(q_, k_, labels, s_, symmetric, "none"), q, k, scale.to(dtype), w)
    for name, a, v, b in zip(("loss", "dq", "dk", "dscale"), ours, vanilla, want):
        _no_worse_than_vanilla(a, v, b, dtype, f"{dtype} {name} C={rows}")


def _no_worse_than_vanilla(ours, vanilla, want, dtype, what):
    """Max error at most FACTOR x torch's own max error in that dtype plus ULPS of the largest entry (the rule of
    tests/test_regimes.py: elementwise, one dS rounding of ours may land where vanilla's happened not to)."""
    err, ref = ((x.double() - want).abs().max() for x in (ours, vanilla))
    floor = ULPS * torch.finfo(dtype).eps * float(want.abs().max())
    assert err <= FACTOR * ref + floor, f"{what}: max error {float(err):.3g} vs vanilla's {float(ref):.3g}"


@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
@pytest.mark.parametrize("scale", (60.0, 100.0))
def test_confident_rows_are_exact(symmetric, scale):
    """1 - P_pos ~ 1e-11 .. 1e-24 in fp32, against the cancellation-free truth, across chunk boundaries."""
    q, k, labels = margin_features(96, 32, scale, symmetric, seed=int(scale) + symmetric)
    q, k, scale_t = q.float(), k.float(), torch.tensor(scale)
    with route(chunk_rows=13):
        ours = grads_of(_loss(labels, symmetric), q, k, scale_t)
    want = exact_softmax_truth(q, k, scale_t, labels, symmetric)
    assert float(want[0].max()) < 1e-10, "not the confident regime"
    assert_normwise(ours, want, EXACT_NORMWISE[torch.float32], f"chunked symmetric={symmetric}")


def test_huge_logits_and_rows_never_negative():
    """|S| ~ 1e5 (unnormalized features at scale 100): the loss from (m - positive) + r is never negative and
    matches float64 to round-off of the largest logit."""
    gen = torch.Generator().manual_seed(4)
    q, k = (30 * torch.randn(40, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    scale = torch.tensor(100.0)
    with route(chunk_rows=9):
        ours = grads_of(_loss(None, True), q.float(), k.float(), scale)
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, None, s_, True), q, k, scale.double())
    assert bool((ours[0] >= 0).all())
    largest = float((100 * q @ k.T).abs().max())
    assert_close_verbose(ours[0], want[0], 8 * largest * 2**-24, 0, "row losses")


def test_upstream_sign_never_changes_the_path():
    q, k, labels = features_and_labels(30, 30, 16, "perm", torch.bfloat16, seed=1)
    w = _upstream(30)
    with route(chunk_rows=7):
        plus = grads_of(_loss(labels, True), q, k, torch.tensor(20.0), w)
        minus = grads_of(_loss(labels, True), q, k, torch.tensor(20.0), -w)
    for name, a, b in zip(("dq", "dk", "dscale"), plus[1:], minus[1:]):
        assert torch.equal(a, -b), name


def test_reruns_are_bit_identical():
    q, k, labels = features_and_labels(41, 41, 16, "perm", torch.bfloat16, seed=2)
    with route(chunk_rows=6):
        first, second = (grads_of(_loss(labels, True, "mean"), q, k, torch.tensor(14.0)) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_return_stats_match_the_torch_tiles():
    q, k, labels = features_and_labels(33, 33, 16, "perm", torch.float32, seed=6)
    with route(chunk_rows=8):
        _, ours = cal_inf_loss(q, k, labels, 10.0, symmetric=True, return_stats=True, backend="chunked")
    _, want = cal_inf_loss(q, k, labels, 10.0, symmetric=True, return_stats=True, backend="torch")
    for a, b in zip(ours, want):
        assert_close_verbose(a, b, 1e-6, 1e-6, "stats")


# ---- the budget ---------------------------------------------------------------------------------------------


def _block(bq, bk, d, dtype=torch.float32):
    q, k, _ = features_and_labels(bq, bk, d, "diag", dtype)
    return Block(q=q, k=k, scale=torch.tensor(10.0), pos=torch.arange(bq) % bk)


def test_chunk_rows_shrink_to_the_budget():
    block = _block(300, 512, 16)
    per_entry = plan.entry_bytes(False, False, torch.float32)
    for budget_mb in (0.25, 0.5, 1.0):
        got = plan.plan_block(block, plan.budget_bytes(budget_mb), 10**6, "torch", False)
        used = plan.workspace_bytes(got.rows, 512, 16, per_entry)
        assert used <= budget_mb * 2**20 < plan.workspace_bytes(got.rows + 1, 512, 16, per_entry)
    assert plan.plan_block(block, plan.budget_bytes(1e-3), 10**6, "torch", False).reason.startswith("a block of")


def _peak_bytes(fn) -> int:
    """The peak of CPU bytes allocated by torch during ``fn()`` beyond what was live before: the profiler's
    allocations (each op's own, at its start) and frees ("[memory]" events) summed in time order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("budget_mb", (0.25, 1.0))
def test_workspace_stays_within_the_budget(budget_mb):
    """Measured: one block's forward and backward allocate at most the budget plus O((Bq + Bk) * D), far below
    the Bq x Bk scores, and the smaller budget takes less."""
    bq, bk, d = 256, 1024, 16
    block = _block(bq, bk, d)
    backend = ChunkedBackend(budget_mb=budget_mb, chunk_rows=10**6, passes="torch")
    rows, cols = backend.forward_block(block, True)
    upstream = Block(
        q=block.q, k=block.k, scale=block.scale, pos=block.pos, row_stats=rows[:2].contiguous(),
        g_row=torch.ones(bq), col_stats=cols, g_col=torch.ones(bk),
    )  # fmt: skip
    dq, dk = torch.zeros(bq, d), torch.zeros(bk, d)
    forward = _peak_bytes(lambda: backend.forward_block(block, True))
    backward = _peak_bytes(lambda: backend.backward_block(upstream, dq, dk))
    linear = 16 * (bq + bk) * (d + 8)  # stats, partials, the products' results, float32 copies
    for peak in (forward, backward):
        assert peak <= budget_mb * 2**20 + linear, (peak, budget_mb)
        assert peak < bq * bk * 4, peak
    assert backend.plan(block).rows < bq


def test_budget_from_the_environment(monkeypatch):
    monkeypatch.setenv(plan.ENV_BUDGET, "2")
    assert plan.budget_bytes(None) == 2 * 2**20
    monkeypatch.setenv(plan.ENV_BUDGET, "lots")
    with pytest.raises(ValueError, match=plan.ENV_BUDGET):
        plan.budget_bytes(None)


@pytest.mark.parametrize(
    "options,match",
    (({"budget_mb": 0}, "budget_mb"), ({"chunk_rows": 0}, "chunk_rows"), ({"passes": "cuda"}, "passes")),
)
def test_bad_options_name_the_argument(options, match):
    with pytest.raises(ValueError, match=match):
        ChunkedBackend(**options)


# ---- hand-offs and auto -------------------------------------------------------------------------------------


def _same(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("case", ("ids", "float64", "siglip", "budget"))
def test_handoffs_run_the_fused_route(case):
    """What the route does not take runs the fallback (on CPU tensors the torch tiles) bit for bit."""
    dtype = torch.float64 if case == "float64" else torch.float32
    q, k, labels = features_and_labels(20, 20, 8, "perm", dtype, seed=7)
    scale = torch.tensor(9.0, dtype=torch.float64 if case == "float64" else torch.float32)
    kwargs = {"q_ids": torch.arange(20) % 6, "k_ids": torch.arange(20) % 6} if case == "ids" else {}

    def loss(backend):
        if case == "siglip":
            return lambda q_, k_, s_: cal_siglip_loss(q_, k_, s_, -2.0, labels, backend=backend)
        return lambda q_, k_, s_: cal_inf_loss(q_, k_, labels, s_, symmetric=True, backend=backend, **kwargs)

    with route(budget_mb=1e-4 if case == "budget" else None):
        if case == "budget":
            assert isinstance(chunked.BACKEND.plan(_block(20, 20, 8)), plan.HandOff)
        ours = grads_of(loss("chunked"), q, k, scale)
    _same(ours, grads_of(loss("torch"), q, k, scale))


def test_auto_keeps_todays_choice_until_measured():
    """The resolver's measured table is empty: auto's choice is AUTO's wherever it was made."""
    assert resolve.CHUNKED_FROM == {}
    q = torch.zeros(70000, 4)
    for name in ("triton", "cpu", "torch"):
        assert measured_route(name, "softmax", q, q) == name
    assert backend_object("chunked") is chunked.BACKEND


def test_a_measured_entry_takes_the_route(monkeypatch):
    """With an entry, auto takes the route from its Bq on, for that family and dtype only, where the budget fits
    MIN_CHUNK_ROWS rows; never for another kind of call, nor under INFCL_BACKEND."""
    table = {(90, "bfloat16"): 16384}
    big, small = torch.zeros(16384, 4, dtype=torch.bfloat16), torch.zeros(16383, 4, dtype=torch.bfloat16)
    assert measured_faster(big, big, table, None, family=90)
    assert not measured_faster(small, big, table, None, family=90)
    assert not measured_faster(big, big, table, None, family=80)
    assert not measured_faster(big.float(), big.float(), table, None, family=90)
    assert not measured_faster(big, big, table, 1.0, family=90)  # 1 MiB fits no 256 rows of 16384 columns
    monkeypatch.setattr(resolve, "CHUNKED_FROM", table)
    monkeypatch.setattr(chunked, "measured_faster", lambda q, k, t, budget_mb: t is table)
    assert measured_route("triton", "softmax", big, big) == "chunked"
    assert measured_route("triton", "sigmoid", big, big) == "triton"
    assert measured_route("cpu", "softmax", big, big) == "cpu"
    monkeypatch.setenv(resolve.ENV_VAR, "triton")
    assert measured_route("triton", "softmax", big, big) == "triton"


@pytest.mark.parametrize("api", ("retrieval_metrics", "cal_distill_loss"))
def test_other_apis_name_the_argument(api, monkeypatch):
    """The ranks and the distillation loss have no chunked route: the resolver refuses the name, and
    INFCL_BACKEND=chunked runs their own "auto" choice."""
    import infcl

    x = torch.randn(8, 4)
    call = {
        "retrieval_metrics": lambda b: infcl.retrieval_metrics(x, x, backend=b),
        "cal_distill_loss": lambda b: infcl.cal_distill_loss(x, x, x, x, 2.0, 3.0, backend=b),
    }[api]
    with pytest.raises(ValueError, match=f"{api} has no backend='chunked'"):
        call("chunked")
    kind = "rank" if api == "retrieval_metrics" else "distill"
    own_auto = resolve.resolve_backend("auto", x.device, kind)
    monkeypatch.setenv(resolve.ENV_VAR, "chunked")
    assert resolve.resolve_backend("auto", x.device, kind) == own_auto
    call("auto")


def _tied(b, d, seed):
    """Small-integer features with repeated rows: exact products in every dtype, rows whose maximum is shared by
    several columns (the positive among them), and columns likewise."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (b, d), generator=gen).double()
    k = q[torch.randint(0, b, (b,), generator=gen)]
    k[::3] = q[::3]
    return q, k


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_tied_maxima_are_counted_exactly(dtype):
    """The scores are exact in both dtypes, so the losses (float32 stats) are the truth's to round-off; the
    gradients too in float32 (bf16's are rounded to bf16 twice: dS and the result)."""
    q, k = _tied(40, 6, seed=8)
    scale = torch.tensor(3.0)
    with route(chunk_rows=9):
        ours = grads_of(_loss(None, True), q.to(dtype), k.to(dtype), scale)
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, None, s_, True), q, k, scale.double())
    checked = zip(("loss", "dq", "dk", "dscale"), ours, want)
    for name, a, b in checked if dtype == torch.float32 else [next(checked)]:
        assert_close_verbose(a, b, 1e-5, 1e-5, f"{dtype} {name}")


def test_nan_features_give_nan_losses():
    """A NaN in q makes its row's loss NaN (and, symmetric, every column's), as F.cross_entropy does."""
    q, k, labels = features_and_labels(20, 20, 8, "perm", torch.float32, seed=10)
    q[4, 2] = float("nan")
    with route(chunk_rows=6):
        rows = cal_inf_loss(q, k, labels, 5.0, reduction="none", backend="chunked")
        pairs = cal_inf_loss(q, k, labels, 5.0, symmetric=True, reduction="none", backend="chunked")
    assert torch.isnan(rows).tolist() == [i == 4 for i in range(20)]
    assert bool(torch.isnan(pairs).all())
