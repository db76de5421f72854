"""The chunked route (``backend="chunked"``, issue 45) on CPU tensors: its host loop with float32 products of
float32 copies and the torch passes, against the float64 truth; chunk boundaries, the budget, the hand-offs and
``auto``. Its Triton passes under the interpreter: tests/test_chunked_triton.py. (The shared regimes, loss and
ring suites run it too: ``chunked`` is one of support.tiled_backends.)"""

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


def _loss(labels, symmetric, reduction="none", **options):
    """The chunked route's loss with ``options`` (ChunkedBackend's), set from the call."""
    route = ChunkedBackend(**options)
    return lambda q, k, s: cal_inf_loss(q, k, labels, s, symmetric=symmetric, reduction=reduction, backend=route)


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
    on = [t.to(device) for t in (q, k, scale)]
    ours = [t.cpu() for t in grads_of(_loss(labels.to(device), symmetric, chunk_rows=rows), *on, w.to(device))]
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
    ours = grads_of(_loss(labels, symmetric, chunk_rows=13), q, k, scale_t)
    want = exact_softmax_truth(q, k, scale_t, labels, symmetric)
    assert float(want[0].max()) < 1e-10, "not the confident regime"
    assert_normwise(ours, want, EXACT_NORMWISE[torch.float32], f"chunked symmetric={symmetric}")


def test_huge_logits_and_rows_never_negative():
    """|S| ~ 1e5 (unnormalized features at scale 100): the loss from (m - positive) + r is never negative and
    matches float64 to round-off of the largest logit."""
    gen = torch.Generator().manual_seed(4)
    q, k = (30 * torch.randn(40, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    scale = torch.tensor(100.0)
    ours = grads_of(_loss(None, True, chunk_rows=9), q.float(), k.float(), scale)
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, None, s_, True), q, k, scale.double())
    assert bool((ours[0] >= 0).all())
    largest = float((100 * q @ k.T).abs().max())
    assert_close_verbose(ours[0], want[0], 8 * largest * 2**-24, 0, "row losses")


def test_upstream_sign_never_changes_the_path():
    q, k, labels = features_and_labels(30, 30, 16, "perm", torch.bfloat16, seed=1)
    w = _upstream(30)
    loss = _loss(labels, True, chunk_rows=7)
    plus = grads_of(loss, q, k, torch.tensor(20.0), w)
    minus = grads_of(loss, q, k, torch.tensor(20.0), -w)
    for name, a, b in zip(("dq", "dk", "dscale"), plus[1:], minus[1:]):
        assert torch.equal(a, -b), name


def test_reruns_are_bit_identical():
    q, k, labels = features_and_labels(41, 41, 16, "perm", torch.bfloat16, seed=2)
    loss = _loss(labels, True, "mean", chunk_rows=6)
    first, second = (grads_of(loss, q, k, torch.tensor(14.0)) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_return_stats_match_the_torch_tiles():
    q, k, labels = features_and_labels(33, 33, 16, "perm", torch.float32, seed=6)
    route = ChunkedBackend(chunk_rows=8)
    _, ours = cal_inf_loss(q, k, labels, 10.0, symmetric=True, return_stats=True, backend=route)
    _, want = cal_inf_loss(q, k, labels, 10.0, symmetric=True, return_stats=True, backend="torch")
    for a, b in zip(ours, want):
        assert_close_verbose(a, b, 1e-6, 1e-6, "stats")


# ---- the budget ---------------------------------------------------------------------------------------------


def _block(bq, bk, d, dtype=torch.float32):
    q, k, _ = features_and_labels(bq, bk, d, "diag", dtype)
    return Block(q=q, k=k, scale=torch.tensor(10.0), pos=torch.arange(bq) % bk)


def test_chunk_rows_shrink_to_the_budget():
    """C is the most rows whose footprint fits: one more row would not."""
    block = _block(300, 512, 16)
    for budget_mb in (0.25, 0.5, 1.0):
        got = plan.plan_block(block, plan.budget_bytes(budget_mb), 10**6, "torch", False)
        need = got.footprint
        assert need.bytes(got.rows) <= budget_mb * 2**20 < need.bytes(got.rows + 1)
    assert plan.plan_block(block, plan.budget_bytes(1e-3), 10**6, "torch", False).reason.startswith("a block of")


def _stand_in(n_q, n_k, dim, dtype=torch.bfloat16):
    """A block of n_q x n_k rows of width dim that allocates nothing (expanded rows): for plans only."""
    q = torch.zeros(1, dim, dtype=dtype).expand(n_q, dim)
    k = torch.zeros(1, dim, dtype=dtype).expand(n_k, dim)
    return Block(q=q, k=k, scale=torch.tensor(1.0), pos=torch.zeros(1, dtype=torch.int64).expand(n_q))


@pytest.mark.parametrize("in_gemm,rows", ((True, 1984), (False, 1664)))
def test_a_million_rows_plan_on_a_gpu(in_gemm, rows):
    """B = 1,048,576 at D = 512 in bf16 on a GPU (planned, not run): the default budget cannot hold the float32 dq
    and dk (4 GiB) and says so; MILLION_BUDGET_MB (16 GiB, 20 GiB of an 80 GB H100 with the inputs and their
    gradients) runs the route with C = 1984 where the GEMMs accumulate in place, 1664 otherwise."""
    block = _stand_in(2**20, 2**20, 512)
    default = plan.plan_block(block, plan.budget_bytes(plan.DEFAULT_BUDGET_MB), None, None, True, True, in_gemm)
    assert isinstance(default, plan.HandOff) and "fits 0 rows" in default.reason
    budget = plan.budget_bytes(plan.MILLION_BUDGET_MB)
    got = plan.plan_block(block, budget, None, None, True, cuda=True, in_gemm=in_gemm)
    assert isinstance(got, plan.ChunkPlan) and got.rows == rows and got.in_gemm == in_gemm
    assert got.footprint.bytes(rows) <= budget < got.footprint.bytes(rows + plan.ROW_ALIGN)
    assert got.footprint.fixed >= 2**31 * 2  # the float32 dq and dk are counted


@pytest.mark.parametrize("in_gemm,rows", ((True, 1984), (False, 1664)))
def test_the_default_budget_at_64k(in_gemm, rows):
    """B = 65536, D = 512, bf16 (planned): everything the route holds fits the default 1 GiB."""
    block = _stand_in(2**16, 2**16, 512)
    budget = plan.budget_bytes(plan.DEFAULT_BUDGET_MB)
    got = plan.plan_block(block, budget, None, None, True, cuda=True, in_gemm=in_gemm)
    assert got.rows == rows and got.footprint.bytes(rows) <= budget == 2**30


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("budget_mb", (0.5, 1.0))
def test_the_budget_is_the_peak_on_cpu(dtype, budget_mb):
    """Counted with weak references to every tensor allocated: the CPU route's peak inside its block operations,
    the float32 dq and dk and its float32 copies of q and k included, stays within the budget, and holds at
    most its four [C, Bk] float32 buffers (S, dS, two scratch) at once."""
    bq, bk, d = 256, 1024, 13
    q, k, labels = features_and_labels(bq, bk, d, "random", dtype, seed=11)
    route = recording_inside(ChunkedBackend)(budget_mb=budget_mb, chunk_rows=10**6, passes="torch")
    c = route.for_call().plan(Block(q=q, k=k, scale=torch.tensor(1.0), pos=labels)).rows
    assert 1 < c < bq and c != d  # (a [C, Bk] buffer is told from [Bk, D] ones by its size)
    q, k, scale = (t.detach().requires_grad_() for t in (q, k, torch.tensor(10.0)))
    with LiveBuffers({c * bk * 4}) as tracker:
        cal_inf_loss(q, k, labels, scale, backend=route).backward()
    assert 0 < tracker.peak <= budget_mb * 2**20, (tracker.peak, budget_mb)
    assert tracker.peak_sized == 4


def test_budget_from_the_call_and_the_environment(monkeypatch):
    """The budget comes from the call's object, else INFCL_CHUNK_BUDGET_MB read once per call (for its forward
    and backward), else the default; a bad value names where it came from."""
    from infcl.backends.chunked import options

    calls = []
    real = plan.call_budget_mb

    def counted(budget_mb):
        calls.append(budget_mb)
        return real(budget_mb)

    monkeypatch.setattr(options, "call_budget_mb", counted)
    monkeypatch.setenv(plan.ENV_BUDGET, "2")
    assert ChunkedBackend().for_call().budget_mb == 2.0
    assert ChunkedBackend(budget_mb=3).for_call().budget_mb == 3.0
    q, k, _ = features_and_labels(64, 64, 8, "diag", torch.float32)
    q.requires_grad_()
    calls.clear()
    cal_inf_loss(q, k, symmetric=True, backend=ChunkedBackend(chunk_rows=8)).backward()
    assert calls.count(None) == 1  # one read of the environment for the whole call, forward and backward
    calls.clear()
    cal_inf_loss(q, k, symmetric=True, backend=ChunkedBackend(budget_mb=5, chunk_rows=8)).backward()
    assert None not in calls  # the call's own budget: the environment is not read
    monkeypatch.setenv(plan.ENV_BUDGET, "lots")
    with pytest.raises(ValueError, match=plan.ENV_BUDGET):
        cal_inf_loss(q, k, backend="chunked")


def test_backend_objects_from_the_call():
    """Any backend's options reach the call as its object; a bad argument names ``backend``."""
    import infcl
    from infcl import backends

    q, k, _ = features_and_labels(40, 40, 8, "diag", torch.float32)
    want = cal_inf_loss(q, k, backend="torch")
    for route in (backends.ChunkedBackend(budget_mb=0.01), backends.TorchTilesBackend(tile_q=7, tile_k=5)):
        assert_close_verbose(cal_inf_loss(q, k, backend=route), want, 1e-6, 1e-6, repr(route))
    assert backends.ChunkedBackend(budget_mb=0.01).plan(_block(40, 40, 8)).rows < 40
    with pytest.raises(TypeError, match="backend must be one of"):
        cal_inf_loss(q, k, backend=object())
    with pytest.raises(ValueError, match="cal_distill_loss has no backend='chunked'"):
        infcl.cal_distill_loss(q, k, q, k, 2.0, 3.0, backend=backends.ChunkedBackend())


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


@pytest.mark.parametrize("case", ("ids", "float64", "budget"))
def test_handoffs_run_the_fused_route(case):
    """What the route does not take runs the fallback (on CPU tensors the torch tiles) bit for bit."""
    dtype = torch.float64 if case == "float64" else torch.float32
    q, k, labels = features_and_labels(20, 20, 8, "perm", dtype, seed=7)
    scale = torch.tensor(9.0, dtype=torch.float64 if case == "float64" else torch.float32)
    kwargs = {"q_ids": torch.arange(20) % 6, "k_ids": torch.arange(20) % 6} if case == "ids" else {}

    def loss(backend):
        return lambda q_, k_, s_: cal_inf_loss(q_, k_, labels, s_, symmetric=True, backend=backend, **kwargs)

    route = ChunkedBackend(budget_mb=1e-4 if case == "budget" else None)
    if case == "budget":
        assert isinstance(route.plan(_block(20, 20, 8)), plan.HandOff)
    ours = grads_of(loss(route), q, k, scale)
    _same(ours, grads_of(loss("torch"), q, k, scale))


def test_auto_takes_the_route_only_where_measured():
    """The resolver's measured table: the route where a GPU measured it faster (Hopper, bf16, from 16384 rows, both
    losses), AUTO's choice everywhere else; never for a backend other than the fused kernels."""
    assert resolve.CHUNKED_FROM == {"softmax": {(90, "bfloat16"): 16384}, "sigmoid": {(90, "bfloat16"): 16384}}
    q = torch.zeros(70000, 4)
    for kind in ("softmax", "sigmoid", "distill"):
        for name in ("cpu", "torch"):
            assert measured_route(name, kind, q, q) == name
    assert measured_route("triton", "distill", q, q) == "triton"
    assert backend_object("chunked") is chunked.BACKEND


def test_a_measured_entry_takes_the_route(monkeypatch):
    """With an entry, auto takes the route from its Bq on, for that family and dtype only, where the budget fits
    MIN_CHUNK_ROWS rows; never for another kind of call, nor under INFCL_BACKEND."""
    table = {(90, "bfloat16"): 16384}
    big, small = torch.zeros(16384, 4, dtype=torch.bfloat16), torch.zeros(16383, 4, dtype=torch.bfloat16)
    budget = plan.DEFAULT_BUDGET_MB
    assert measured_faster(big, big, table, budget, family=90)
    assert not measured_faster(small, big, table, budget, family=90)
    assert not measured_faster(big, big, table, budget, family=80)
    assert not measured_faster(big.float(), big.float(), table, budget, family=90)
    assert not measured_faster(big, big, table, 1.0, family=90)  # 1 MiB fits no 256 rows of 16384 columns
    monkeypatch.setattr(resolve, "CHUNKED_FROM", {"softmax": table})
    monkeypatch.setattr(chunked, "measured_faster", lambda q, k, t, budget_mb: t is table)
    assert measured_route("triton", "softmax", big, big) == "chunked"
    assert measured_route("triton", "sigmoid", big, big) == "triton"  # no entry for this kind
    assert measured_route("cpu", "softmax", big, big) == "cpu"
    # Through a call's resolution (a CUDA call's auto choice stood in), unless INFCL_BACKEND names a backend.
    monkeypatch.setattr(resolve, "_resolve", lambda name, device, kind, env: env or "triton")
    name, route = resolve.call_backend("auto", big.device, "softmax", (big, big))
    assert name == "chunked" and isinstance(route, ChunkedBackend) and route.budget_mb == budget
    monkeypatch.setenv(resolve.ENV_VAR, "triton")
    assert resolve.call_backend("auto", big.device, "softmax", (big, big))[0] == "triton"


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
    ours = grads_of(_loss(None, True, chunk_rows=9), q.to(dtype), k.to(dtype), scale)
    want = grads_of(lambda q_, k_, s_: truth.truth_losses(q_, k_, None, s_, True), q, k, scale.double())
    checked = zip(("loss", "dq", "dk", "dscale"), ours, want)
    for name, a, b in checked if dtype == torch.float32 else [next(checked)]:
        assert_close_verbose(a, b, 1e-5, 1e-5, f"{dtype} {name}")


def test_nan_features_give_nan_losses():
    """A NaN in q makes its row's loss NaN (and, symmetric, every column's), as F.cross_entropy does."""
    q, k, labels = features_and_labels(20, 20, 8, "perm", torch.float32, seed=10)
    q[4, 2] = float("nan")
    route = ChunkedBackend(chunk_rows=6)
    rows = cal_inf_loss(q, k, labels, 5.0, reduction="none", backend=route)
    pairs = cal_inf_loss(q, k, labels, 5.0, symmetric=True, reduction="none", backend=route)
    assert torch.isnan(rows).tolist() == [i == 4 for i in range(20)]
    assert bool(torch.isnan(pairs).all())


# ---- the sigmoid (SigLIP) loss -------------------------------------------------------------------------------


class GemmFlops:
    """Counts the products' flops (aten mm / addmm, in place or not) under a TorchDispatchMode."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.flops = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.overloadpacket.__name__
                if name in ("mm", "addmm", "addmm_"):
                    a, b = args[-2:] if name != "mm" else args[:2]
                    counter.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _siglip_on(backend, labels, reduction):
    return lambda q, k, s, b: cal_siglip_loss(q, k, s, b, labels, reduction=reduction, backend=backend)


def _siglip(labels, reduction, **options):
    """The chunked route's sigmoid loss with ``options`` (ChunkedBackend's), set from the call."""
    return _siglip_on(ChunkedBackend(**options), labels, reduction)


@pytest.mark.parametrize("reduction,forward,backward", (("mean", 3, 0), ("sum", 3, 0), ("none", 1, 3)))
def test_siglip_gemm_equivalents(reduction, forward, backward):
    """A reduced loss takes its gradient in the forward's one pass: 3 GEMM-equivalents (S, dq, dk), none in the
    backward; "none" (per-row upstream gradients) takes 1 + 3; a forward that takes no gradient, 1."""
    bq, bk, d = 40, 56, 8
    q, k, labels = features_and_labels(bq, bk, d, "random", torch.bfloat16, seed=13)
    loss = _siglip(labels, reduction, chunk_rows=9)
    leaves = [t.detach().requires_grad_() for t in (q, k, torch.tensor(5.0), torch.tensor(-3.0))]
    one = 2 * bq * bk * d
    counted = GemmFlops()
    with counted.mode:
        out = loss(*leaves)
    assert counted.flops == forward * one
    counted.flops = 0
    with counted.mode:
        out.sum().backward()
    assert counted.flops == backward * one
    with torch.no_grad(), counted.mode:
        counted.flops = 0
        loss(*leaves)
    assert counted.flops == one


SIGLIP_CASES = ((37, 37, 5, "perm"), (23, 61, 7, "random"), (40, 40, 64, "diag"))


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
@pytest.mark.parametrize("bq,bk,rows,labels_kind", SIGLIP_CASES)
def test_siglip_against_float64_truth(dtype, reduction, bq, bk, rows, labels_kind):
    """Loss, the features', scale's and bias's gradients against float64 (relative to the magnitudes of their
    terms, support.siglip_magnitudes) in every reduction (mixed-sign, zero and large per-row upstream gradients
    for "none", a negative one for "mean"), labels, Bk > Bq, every chunking: fp32 to its tolerance, bf16 / fp16 no
    worse than torch's own loss in that dtype."""
    from helpers.support import grads_of_inputs, siglip_magnitudes, siglip_truth

    q, k, labels = features_and_labels(bq, bk, 24, labels_kind, dtype, seed=bq + rows)
    scale, bias = torch.tensor(10.0), torch.tensor(-4.0)
    upstream = _upstream(bq) if reduction == "none" else torch.tensor(-0.7, dtype=torch.float64)
    ours = grads_of_inputs(_siglip(labels, reduction, chunk_rows=rows), (q, k, scale, bias), upstream)
    want = grads_of_inputs(
        lambda *a: siglip_truth(*a, labels, reduction),
        (q.double(), k.double(), scale.double(), bias.double()),
        upstream,
    )
    names = ("loss", "dq", "dk", "dscale", "dbias")
    if dtype == torch.float32:
        atol, rtol = TOLERANCE[dtype]
        sizes = siglip_magnitudes(q, k, scale, bias, labels, reduction, upstream)
        for name, a, b, size in zip(names, ours, want, sizes):
            assert_close_verbose(a, b, atol, rtol, f"{name} C={rows}", magnitude=size)
        return
    vanilla = grads_of_inputs(
        lambda q_, k_, s_, b_: siglip_truth(q_, k_, s_.to(dtype), b_.to(dtype), labels, reduction),
        (q, k, scale, bias),
        upstream,
    )
    for name, a, v, b in zip(names, ours, vanilla, want):
        _no_worse_than_vanilla(a, v, b, dtype, f"{dtype} {reduction} {name} C={rows}")


def test_siglip_one_pass_is_the_two_pass_gradient():
    """The one-pass gradient scaled by the upstream gradient equals the 4-GEMM route's under the same uniform
    upstream gradient ("none" with every row's weight 1/B): the same dS, products and sums, up to rounding the
    weight before (4-GEMM) or after (one pass) the operand rounding; bit for bit where the weight is a power of 2."""
    from helpers.support import grads_of_inputs

    q, k, labels = features_and_labels(32, 48, 16, "random", torch.bfloat16, seed=14)
    params = (torch.tensor(7.0), torch.tensor(-2.0))
    one_pass = grads_of_inputs(_siglip(labels, "mean", chunk_rows=6), (q, k, *params))
    uniform = torch.full((32,), 1 / 32, dtype=torch.float64)
    two_pass = grads_of_inputs(_siglip(labels, "none", chunk_rows=6), (q, k, *params), uniform)
    assert torch.equal(one_pass[0], two_pass[0].mean())
    for name, a, b in zip(("dq", "dk", "dscale", "dbias"), one_pass[1:], two_pass[1:]):
        assert torch.equal(a, b), name


def test_siglip_reruns_nan_and_handoffs():
    """Reruns are bit-identical; a NaN feature makes its row's loss NaN; float64 and a budget too small run the
    fused route (the torch tiles on CPU): bit for bit for "none"; for "mean" its forward and backward under a
    unit upstream gradient, scaled after (to round-off of that scaling)."""
    from helpers.support import grads_of_inputs

    q, k, labels = features_and_labels(30, 30, 8, "perm", torch.float32, seed=15)
    params = (torch.tensor(6.0), torch.tensor(-1.0))
    loss = _siglip(labels, "mean", chunk_rows=7)
    first, second = (grads_of_inputs(loss, (q, k, *params)) for _ in range(2))
    _same(first, second)
    bad = q.clone()
    bad[4, 1] = float("nan")
    rows = _siglip(labels, "none", chunk_rows=7)(bad, k, *params)
    assert torch.isnan(rows).tolist() == [i == 4 for i in range(30)]
    for dtype, options in ((torch.float64, {}), (torch.float32, {"budget_mb": 1e-4})):
        inputs = (q.to(dtype), k.to(dtype), *(p.to(dtype) for p in params))
        for reduction in ("mean", "none"):
            route = _siglip(labels, reduction, **options)
            fused = _siglip_on("torch", labels, reduction)
            ours, want = grads_of_inputs(route, inputs, None), grads_of_inputs(fused, inputs, None)
            if reduction == "none":
                _same(ours, want)
            for a, b in zip(ours, want):
                slack = 16 * torch.finfo(dtype).eps * float(b.abs().max())  # the dq, dk entries' sums cancel
                assert_close_verbose(a, b, slack, 0, f"{dtype} {reduction}")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_siglip_budget_is_the_peak_on_cpu(dtype):
    """The one-pass forward holds what the backward does (S, dS, scratch, the float32 dq and dk): within the budget."""
    bq, bk, d = 256, 1024, 13
    q, k, labels = features_and_labels(bq, bk, d, "random", dtype, seed=16)
    route = recording_inside(ChunkedBackend)(budget_mb=0.75, chunk_rows=10**6, passes="torch")
    c = route.for_call().plan(Block(q=q, k=k, scale=torch.tensor(1.0), pos=labels)).rows
    assert 1 < c < bq and c != d
    q, k, scale, bias = (t.detach().requires_grad_() for t in (q, k, torch.tensor(10.0), torch.tensor(-3.0)))
    with LiveBuffers({c * bk * 4}) as tracker:
        cal_siglip_loss(q, k, scale, bias, labels, backend=route).backward()
    assert 0 < tracker.peak <= 0.75 * 2**20, tracker.peak
    assert tracker.peak_sized == 4


@pytest.mark.parametrize("with_ids", (False, True))
def test_the_sigmoid_loss_offers_its_operands_to_the_measured_table(with_ids, monkeypatch):
    """cal_siglip_loss hands "auto" its features (so the measured table can route it) unless ids mask it, as
    cal_inf_loss does without mask options."""
    import infcl
    import infcl.siglip as siglip

    seen = []

    def spy(backend, device, kind, operands=None):
        seen.append((kind, operands))
        return resolve.call_backend(backend, device, kind, operands)

    monkeypatch.setattr(siglip, "call_backend", spy)
    x = torch.randn(6, 4)
    ids = {"q_ids": torch.arange(6) % 3, "k_ids": torch.arange(6) % 3} if with_ids else {}
    infcl.cal_siglip_loss(x, x, 10.0, -10.0, **ids)
    ((kind, operands),) = seen
    assert kind == "sigmoid" and (operands is None) == with_ids
    if not with_ids:
        assert operands[0] is x and operands[1] is x


def test_a_cpu_call_never_consults_the_route(monkeypatch):
    """auto on CPU tensors resolves without the chunked route's object or its environment (the measured table
    answers only for the fused kernels' calls)."""

    def refuse(name):
        if name == "chunked":
            raise AssertionError("the chunked route was consulted for a CPU call")
        return backend_object(name)

    monkeypatch.setattr(resolve, "backend_object", refuse)
    q = torch.zeros(20000, 4, dtype=torch.bfloat16)
    name, _ = resolve.call_backend("auto", q.device, "softmax", (q, q))
    assert name in ("cpu", "torch")
