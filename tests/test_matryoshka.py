"""``cal_inf_loss(matryoshka=...)`` against the float64 truth of sum_k w_k * F.cross_entropy on each prefix's
materialized logits (the prefix ``F.normalize``d where renormalized), built here without infcl: loss and the
gradients of q, k and the scale, one direction and symmetric, hard negatives, custom labels, reductions,
non-unit and negative upstream gradients, dims in any order (not multiples of anything), mixed renormalize
flags, a one-wide renormalized prefix (its gradient exactly 0, the Triton fused kernels included), shapes
past one tile, bfloat16 inputs; the
stats per dim; bad dims raise; the native ops' schemas (opcheck). The ring: tests/test_options_ring.py.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers.support import (
    EXACT_NORMWISE,
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    assert_normwise,
    exact_softmax_truth,
    features_and_labels,
    grads_of,
    margin_features,
    masked_truth_directions,
    reduce_masked_truth,
    tiled_backends,
)
from infcl import InfCLIPLoss, Matryoshka, cal_inf_loss
from infcl.backends.torch_tiles import TorchTilesBackend

# The native kernel ("cpu") and the torch tiles hold the fused pass; the others run one pass per prefix (infcl.api).
BACKENDS = ("reference", *tiled_backends(), "torch-small-tiles")
# (Bq, Bk, D, labels, symmetric, dims, renormalize)
CASES = (
    (7, 7, 9, "perm", True, (9, 4, 1), (True, True, False)),  # one-wide renormalized: test_one_wide_renormalized
    (7, 13, 9, "random", False, (3, 9), (False, True)),  # hard negatives
    (33, 33, 40, "diag", True, (17, 40, 5, 32), (True, False, True, False)),
    (20, 45, 23, "random", False, (23, 11), False),
)


def truth_losses(q, k, labels, scale, symmetric, dims, weights, renormalize):
    """Per-row (symmetric: per pair) sum_k w_k * loss_k in float64 on each prefix's logits."""
    q, k, scale = q.double(), k.double(), scale.double()
    labels = torch.arange(q.shape[0]) if labels is None else labels
    flags = (renormalize,) * len(dims) if isinstance(renormalize, bool) else renormalize
    total = 0
    for m, w, renorm in zip(dims, weights, flags):
        qm, km = q[:, :m], k[:, :m]
        if renorm:
            qm, km = F.normalize(qm, dim=-1), F.normalize(km, dim=-1)
        logits = scale * qm @ km.T
        per = F.cross_entropy(logits, labels, reduction="none")
        if symmetric:
            per = (per + F.cross_entropy(logits.T, torch.argsort(labels), reduction="none")) / 2
        total = total + w * per
    return total


def _backend(name):
    if name == "torch-small-tiles":
        return TorchTilesBackend(5, 7)  # the torch tiles at these sizes, passed by the call
    return name


def _grads(q, k, scale, upstream, fn):
    q, k, scale = (t.detach().clone().requires_grad_() for t in (q, k, scale))
    loss = fn(q, k, scale)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), q.grad, k.grad, scale.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bq,bk,d,label_kind,symmetric,dims,renormalize", CASES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_matches_per_prefix_cross_entropy(
    backend, bq, bk, d, label_kind, symmetric, dims, renormalize, dtype, reduction
):
    name = _backend(backend)
    q, k, labels = features_and_labels(bq, bk, d, label_kind, dtype)
    q = q * torch.linspace(0.5, 2.0, d, dtype=dtype)  # rows not unit-norm: the renormalization matters
    scale = torch.tensor(9.0, dtype=dtype)
    weights = tuple(0.25 + 0.5 * i for i in range(len(dims)))
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(bq, generator=gen, dtype=torch.float64) if reduction == "none" else torch.tensor(-1.3)
    spec = Matryoshka(dims, weights, renormalize)
    opts = dict(symmetric=symmetric, reduction=reduction, backend=name, matryoshka=spec)
    got = _grads(q, k, scale, g, lambda a, b, s: cal_inf_loss(a, b, labels, s, **opts))

    def want_fn(a, b, s):
        per = truth_losses(a, b, labels, s, symmetric, dims, weights, renormalize)
        return per.mean() if reduction == "mean" else per

    want = _grads(q.double(), k.double(), scale.double(), g.double(), want_fn)
    atol, rtol = TOLERANCE[dtype]
    for what, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert_close_verbose(a, b, atol, rtol, f"{backend} {dims} {what}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_wide_renormalized_prefix(backend):
    """A one-wide renormalized prefix is scale * sign(q_0) * sign(k_0): its features' gradient is exactly 0
    (F.normalize's backward gives it to rounding). The fused passes (native, torch tiles, Triton) leave it out
    of the gradient instead of cancelling two equal sums of size |g| / |x_0| (which left ~7e-5 relative);
    alone, it gives exact zeros (and its dscale)."""
    _assert_one_wide_renormalized(_backend(backend), backend in ("cpu", "torch", "torch-small-tiles", "triton"))


@pytest.mark.interpreter
def test_triton_fused_one_wide_renormalized_prefix():
    """test_one_wide_renormalized_prefix on the fused Triton kernels under the interpreter (their SIGN_ONLY)."""
    _assert_one_wide_renormalized("triton", True)


def _assert_one_wide_renormalized(backend, fused):
    """Dims (9, 4, 1), all renormalized, against the float64 truth; ``fused``: dims (1,) alone gives q and k
    gradients of exactly 0 and the truth's dscale."""
    bq, bk, d, label_kind, symmetric, dims, _ = CASES[0]
    q, k, labels = features_and_labels(bq, bk, d, label_kind, torch.float32)
    q = q * torch.linspace(0.5, 2.0, d)
    scale, g, weights = torch.tensor(9.0), torch.tensor(-1.3), (0.25, 0.75, 1.25)
    spec = Matryoshka(dims, weights, True)
    opts = dict(symmetric=symmetric, backend=backend, matryoshka=spec)
    got = _grads(q, k, scale, g, lambda a, b, s: cal_inf_loss(a, b, labels, s, **opts))
    want = _grads(
        q.double(),
        k.double(),
        scale.double(),
        g.double(),
        lambda a, b, s: truth_losses(a, b, labels, s, symmetric, dims, weights, True).mean(),
    )
    for what, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert_close_verbose(a, b, *TOLERANCE[torch.float32], f"{backend} {what}")
    if fused:
        alone = dict(opts, matryoshka=Matryoshka((1,), renormalize=True))
        _, dq, dk, dscale = _grads(q, k, scale, g, lambda a, b, s: cal_inf_loss(a, b, labels, s, **alone))
        assert not dq.any() and not dk.any(), f"{backend}: the one-wide prefix's gradient is not exactly 0"
        _, _, _, want_dscale = _grads(
            q.double(),
            k.double(),
            scale.double(),
            g.double(),
            lambda a, b, s: truth_losses(a, b, labels, s, symmetric, (1,), (1.0,), True).mean(),
        )
        assert_close_verbose(dscale, want_dscale, *TOLERANCE[torch.float32], f"{backend} alone dscale")


@pytest.mark.parametrize("backend", BACKENDS[:-1])
def test_stats_per_dim_in_the_order_given(backend):
    q, k, labels = features_and_labels(17, 17, 12, "perm", torch.float32, seed=2)
    dims = (12, 3, 7)
    loss, stats = cal_inf_loss(q, k, labels, 8.0, symmetric=True, matryoshka=dims, backend=backend, return_stats=True)
    assert tuple(stats) == dims
    for m in dims:
        _, one = cal_inf_loss(
            F.normalize(q[:, :m]),
            F.normalize(k[:, :m]),
            labels,
            8.0,
            symmetric=True,
            backend="reference",
            return_stats=True,
        )
        for a, b in zip(stats[m], one):
            assert_close_verbose(a, b, 1e-6, 1e-6, f"stats dim {m}")


def test_one_full_unnormalized_prefix_is_the_plain_loss():
    q, k, labels = features_and_labels(30, 30, 16, "perm", torch.float64, seed=3)
    scale = torch.tensor(12.0, dtype=torch.float64)
    got = _grads(
        q,
        k,
        scale,
        torch.tensor(1.0),
        lambda a, b, s: cal_inf_loss(
            a, b, labels, s, symmetric=True, backend="torch", matryoshka=Matryoshka((16,), renormalize=False)
        ),
    )
    want = _grads(
        q, k, scale, torch.tensor(1.0), lambda a, b, s: cal_inf_loss(a, b, labels, s, symmetric=True, backend="torch")
    )
    for a, b in zip(got, want):
        assert_close_verbose(a, b, 1e-12, 1e-12, "one prefix")


@pytest.mark.parametrize("backend", tiled_backends())
@pytest.mark.parametrize("renormalize", (False, True))
def test_nan_in_nan_out(backend, renormalize):
    q, k, labels = features_and_labels(9, 9, 6, "perm", torch.float32)
    q = q.clone()
    q[2, 5] = float("nan")  # outside the 3-wide prefix: only the 6-wide prefix's row 2 is NaN
    per = cal_inf_loss(
        q, k, labels, 5.0, reduction="none", backend=backend, matryoshka=Matryoshka((3, 6), renormalize=renormalize)
    )
    assert torch.isnan(per[2]) and not torch.isnan(per[torch.arange(9) != 2]).any()


@pytest.mark.parametrize(
    "spec,error,match",
    (
        ((), ValueError, "at least one dimension"),
        ((8, 9), ValueError, r"in \[1, 8\]"),
        ((0, 4), ValueError, r"in \[1, 8\]"),
        ((4, 4), ValueError, "distinct"),
        ((4.0, 2), TypeError, "integers"),
        (Matryoshka((4, 2), weights=(1.0,)), ValueError, "one per dim"),
        (Matryoshka((4, 2), weights=(1.0, float("inf"))), ValueError, "finite"),
        (Matryoshka((4, 2), renormalize=(True,)), ValueError, "renormalize"),
        ("8", TypeError, "matryoshka must be"),
    ),
)
def test_bad_specs_raise(spec, error, match):
    q, k, _ = features_and_labels(4, 4, 8, "diag", torch.float32)
    with pytest.raises(error, match=match):
        cal_inf_loss(q, k, matryoshka=spec)


@pytest.mark.parametrize("backend", BACKENDS[:-1])
def test_with_ids_and_label_smoothing_per_prefix(backend):
    # The truth is the float64 loss per prefix (mask options: fused on the torch tiles and the native kernel, one
    # call per prefix elsewhere, tests/test_matryoshka_masks.py; label smoothing: one call per prefix everywhere).
    q, k, labels = features_and_labels(12, 12, 10, "perm", torch.float64, seed=6)
    ids = torch.tensor([0, 1, 2, 0, 1, 3, 4, 5, 2, 6, 7, 8])
    k_ids = torch.empty_like(ids)
    k_ids[labels] = ids
    scale, dims, weights = torch.tensor(7.0, dtype=torch.float64), (10, 4), (1.0, 0.5)
    spec = Matryoshka(dims, weights)
    opts = dict(symmetric=True, backend=backend, matryoshka=spec)
    got = _grads(
        q,
        k,
        scale,
        torch.tensor(1.0),
        lambda a, b, s: cal_inf_loss(a, b, labels, s, q_ids=ids, k_ids=k_ids, multi_positive="mean", **opts),
    )

    def ids_truth(a, b, s):
        total = 0
        for m, w in zip(dims, weights):
            rows, cols = masked_truth_directions(
                F.normalize(a[:, :m], dim=-1),
                F.normalize(b[:, :m], dim=-1),
                labels,
                s,
                symmetric=True,
                q_ids=ids,
                k_ids=k_ids,
                multi_positive="mean",
            )
            total = total + w * reduce_masked_truth(rows, cols, "mean")
        return total

    want = _grads(q, k, scale, torch.tensor(1.0), ids_truth)
    for what, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert_close_verbose(a, b, 1e-10, 1e-10, f"{backend} ids {what}")
    got = _grads(
        q, k, scale, torch.tensor(1.0), lambda a, b, s: cal_inf_loss(a, b, labels, s, label_smoothing=0.2, **opts)
    )

    def smoothed_truth(a, b, s):
        total = 0
        for m, w in zip(dims, weights):
            logits = s * F.normalize(a[:, :m], dim=-1) @ F.normalize(b[:, :m], dim=-1).T
            pair = F.cross_entropy(logits, labels, label_smoothing=0.2, reduction="none")
            pair = (pair + F.cross_entropy(logits.T, torch.argsort(labels), label_smoothing=0.2, reduction="none")) / 2
            total = total + w * pair.mean()
        return total

    want = _grads(q, k, scale, torch.tensor(1.0), smoothed_truth)
    for what, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert_close_verbose(a, b, 1e-10, 1e-10, f"{backend} smoothing {what}")


def test_infclip_loss_takes_it():
    q, k, _ = features_and_labels(16, 16, 8, "diag", torch.float32, seed=4)
    scale = torch.tensor(20.0)
    got = InfCLIPLoss(matryoshka=(8, 4))(q, k, scale)
    want = truth_losses(q, k, None, scale, True, (8, 4), (1.0, 1.0), True).mean()
    assert_close_verbose(got, want, 1e-5, 1e-5, "InfCLIPLoss(matryoshka)")


# The fused Triton kernels (infcl/kernels/matryoshka.py) under the interpreter (TRITON_INTERPRET=1, set by
# conftest.py): small shapes, every case of CASES in float32 (the rank tiling's 32 x 32 tiles cut them into
# ragged blocks, every prefix boundary inside a 32-wide chunk), and one case in each 16-bit dtype.
TRITON_DTYPES = (
    (torch.float32, CASES),
    (torch.bfloat16, CASES[2:3]),
    (torch.float16, CASES[2:3]),
)


def _truth_in_dtype(q, k, labels, scale, symmetric, dims, weights, renormalize):
    """truth_losses' formula in q's own dtype (torch's low-precision error, for assert_no_worse)."""
    labels = torch.arange(q.shape[0]) if labels is None else labels
    flags = (renormalize,) * len(dims) if isinstance(renormalize, bool) else renormalize
    total = 0
    for m, w, renorm in zip(dims, weights, flags):
        qm, km = q[:, :m], k[:, :m]
        if renorm:
            qm, km = F.normalize(qm, dim=-1), F.normalize(km, dim=-1)
        logits = scale.to(q.dtype) * qm @ km.T
        per = F.cross_entropy(logits, labels, reduction="none")
        if symmetric:
            per = (per + F.cross_entropy(logits.T, torch.argsort(labels), reduction="none")) / 2
        total = total + w * per
    return total


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "dtype,case", [(dtype, case) for dtype, cases in TRITON_DTYPES for case in cases], ids=lambda x: str(x)
)
def test_triton_fused_interpreted(dtype, case):
    """backend="triton" (the fused kernels) against the float64 truth: loss and the gradients of q, k and the
    scale under a non-unit, mixed-sign upstream gradient (reduction "none"); float32 to round-off, the 16-bit
    dtypes no worse than torch's own formula in that dtype."""
    bq, bk, d, label_kind, symmetric, dims, renormalize = case
    q, k, labels = features_and_labels(bq, bk, d, label_kind, dtype)
    q, k = q * 1.5, k * 0.7  # renormalization differs from the identity
    weights = tuple(0.5 + i for i in range(len(dims)))
    spec = Matryoshka(dims, weights, renormalize)
    scale = torch.tensor(6.0)
    upstream = torch.randn(bq, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    opts = dict(symmetric=symmetric, reduction="none", matryoshka=spec)
    got = _grads(q, k, scale, upstream, lambda a, b, s: cal_inf_loss(a, b, labels, s, backend="triton", **opts))
    want = _grads(
        q.double(),
        k.double(),
        scale.double(),
        upstream.double(),
        lambda a, b, s: truth_losses(a, b, labels, s, symmetric, dims, weights, renormalize),
    )
    if dtype == torch.float32:
        for what, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
            assert_close_verbose(a, b, *TOLERANCE[dtype], f"triton {dims} {what}")
        return
    lowp = _grads(
        q, k, scale, upstream, lambda a, b, s: _truth_in_dtype(a, b, labels, s, symmetric, dims, weights, renormalize)
    )
    atol, rtol = TOLERANCE[dtype]
    for what, a, t, e in zip(("loss", "dq", "dk", "dscale"), got, lowp, want):
        assert_no_worse(a, t, e, atol, rtol, f"triton {dtype} {dims} {what}")


@pytest.mark.interpreter
def test_triton_fused_stats_per_dim():
    """return_stats on the fused kernels: {dim: stats} in the order given, each the reference's."""
    q, k, labels = features_and_labels(20, 20, 23, "perm", torch.float32)
    dims = (7, 23, 12)
    got = cal_inf_loss(q, k, labels, 8.0, symmetric=True, matryoshka=dims, backend="triton", return_stats=True)
    want = cal_inf_loss(q, k, labels, 8.0, symmetric=True, matryoshka=dims, backend="reference", return_stats=True)
    assert list(got[1]) == list(dims)
    assert_close_verbose(got[0], want[0], 1e-5, 1e-5, "loss")
    for dim in dims:
        for name, a, b in zip(got[1][dim]._fields, got[1][dim], want[1][dim]):
            assert_close_verbose(a, b, 1e-5, 1e-5, f"{dim} {name}")


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
def test_confident_prefixes_are_exact(backend, dtype, symmetric):
    """Both prefixes of a confident batch (1 - P_pos ~ 1e-11 .. 1e-24 at scale 100) against the weighted sum of
    the cancellation-free float64 truth per prefix, where F.cross_entropy, even in float64, rounds the loss and
    its gradient to 0: the fused pass's per-prefix statistics must keep those digits."""
    _assert_confident_exact(_backend(backend), dtype, symmetric, 128)


@pytest.mark.interpreter
@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
def test_triton_fused_confident_prefixes_are_exact(symmetric):
    """test_confident_prefixes_are_exact on the fused Triton kernels under the interpreter (float32; 40 rows: a
    whole 32-row block and a ragged one)."""
    _assert_confident_exact("triton", torch.float32, symmetric, 40)


def _assert_confident_exact(backend, dtype, symmetric, batch):
    scale = 100.0
    base_q, base_k, labels = margin_features(batch, 32, scale, symmetric, seed=3 + symmetric)
    gen = torch.Generator().manual_seed(11)
    tail_q, tail_k = (1e-3 * torch.randn(batch, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    q, k = torch.cat([base_q, tail_q], 1).to(dtype), torch.cat([base_k, tail_k], 1).to(dtype)
    dims, weights = (48, 32), (1.0, 0.5)
    spec = Matryoshka(dims, weights, renormalize=False)
    scale_t = torch.tensor(scale, dtype=dtype)
    ours = grads_of(
        lambda a, b, s: cal_inf_loss(
            a, b, labels, s, symmetric=symmetric, reduction="none", backend=backend, matryoshka=spec
        ),
        q,
        k,
        scale_t,
    )
    truth = [torch.zeros(batch, dtype=torch.float64), torch.zeros(q.shape, dtype=torch.float64)]
    truth += [torch.zeros(k.shape, dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
    for m, w in zip(dims, weights):
        loss, dq, dk, dscale = exact_softmax_truth(q[:, :m], k[:, :m], scale_t, labels, symmetric)
        lo, hi = float(loss.min()), float(loss.max())
        assert lo < 1e-20 and hi < 1e-9, f"prefix {m}: losses {lo:.3g} .. {hi:.3g}: not the confident regime"
        truth[0] += w * loss
        truth[1][:, :m] += w * dq
        truth[2][:, :m] += w * dk
        truth[3] += w * dscale
    assert_normwise(ours, truth, EXACT_NORMWISE[dtype], f"{backend} {dtype}")


@pytest.mark.interpreter
@pytest.mark.parametrize("symmetric", [True, False])
def test_triton_fused_ops_pass_opcheck(symmetric):
    """torch.library.opcheck (schema, fake impls, the mutated dq and dk, FakeTensor and AOT tracing) of the fused
    kernels' custom ops: the forward, then the backward on the forward's own stats (standing in for the global
    ones); 14 columns against 12 rows, so each side's outputs have their own size."""
    from infcl.kernels.matryoshka_ops import backward_op, forward_op

    gen = torch.Generator().manual_seed(5)
    bq, bk, dim = 12, 14, 9
    q, k = torch.randn(bq, dim, generator=gen), torch.randn(bk, dim, generator=gen)
    pos = torch.randint(-1, bk, (bq,), generator=gen)
    bounds = torch.tensor((0, 4, 9), dtype=torch.int32)
    q_factors, k_factors = torch.rand(2, bq, generator=gen) + 0.5, torch.rand(2, bk, generator=gen) + 0.5
    scale = torch.tensor(3.0)
    forward = (q, k, scale, pos, bounds, q_factors, k_factors, symmetric, "ieee")
    torch.library.opcheck(forward_op, forward)
    rows, cols = forward_op(*forward)
    g_row, g_col = torch.full((2, bq), 1 / bq), torch.full((2, bk), 1 / bk)
    col_args = (cols[:2], g_col) if symmetric else (None, None)
    grads = (torch.zeros(bq, dim), torch.zeros(bk, dim))
    backward = (q, k, scale, pos, bounds, q_factors, k_factors, rows[:2], g_row, *col_args, *grads, False, "ieee")
    torch.library.opcheck(backward_op, backward)


@pytest.mark.interpreter
def test_triton_fused_strided_inputs():
    """A q that skips every other feature and a column-major k: the fused kernels read through the strides
    (the segments' views included)."""
    q_wide, k, labels = features_and_labels(20, 20, 46, "perm", torch.float32)
    q, k = q_wide[:, ::2], k[:, :23].T.contiguous().T
    assert not q.is_contiguous() and not k.is_contiguous()
    scale, upstream = torch.tensor(5.0), torch.linspace(-1.0, 2.0, 20, dtype=torch.float64)
    dims, weights, renormalize = (23, 6, 15), (1.0, 0.5, 2.0), (True, False, True)
    spec = Matryoshka(dims, weights, renormalize)
    got = _grads(
        q,
        k,
        scale,
        upstream,
        lambda a, b, s: cal_inf_loss(a, b, labels, s, reduction="none", backend="triton", matryoshka=spec),
    )
    want = _grads(
        q.double(),
        k.double(),
        scale.double(),
        upstream,
        lambda a, b, s: truth_losses(a, b, labels, s, False, dims, weights, renormalize),
    )
    for what, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert_close_verbose(a, b, *TOLERANCE[torch.float32], f"strided {what}")


# Past one tile of each side: 600 rows make 7 row tiles of 96 (the last ragged) and 3 key tiles of the native
# kernel's 256 (several column groups forward, two lanes backward on two threads), 2 key tiles of the torch tiles.
# Seventeen prefixes cap the native symmetric forward's column groups at 64 // 17 = 3, fewer than the row tiles.
PAST_ONE_TILE = (
    ((70, 33, 1, 9), (True, False, True, True)),
    (tuple(range(70, 5, -4)), True),
)


@pytest.mark.parametrize("backend", tiled_backends())
@pytest.mark.parametrize("symmetric", (False, True), ids=("one-way", "symmetric"))
@pytest.mark.parametrize("dims,renormalize", PAST_ONE_TILE, ids=("4-dims", "17-dims"))
def test_past_one_tile(backend, symmetric, dims, renormalize):
    bq, bk, d = 600, 600, 70
    q, k, labels = features_and_labels(bq, bk, d, "perm", torch.float64, seed=8)
    q = q * torch.linspace(0.5, 2.0, d, dtype=torch.float64)
    scale, weights = torch.tensor(11.0, dtype=torch.float64), tuple(0.25 + 0.125 * i for i in range(len(dims)))
    g = torch.randn(bq, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    spec = Matryoshka(dims, weights, renormalize)
    got = _grads(
        q,
        k,
        scale,
        g,
        lambda a, b, s: cal_inf_loss(
            a, b, labels, s, symmetric=symmetric, reduction="none", backend=backend, matryoshka=spec
        ),
    )
    want = _grads(q, k, scale, g, lambda a, b, s: truth_losses(a, b, labels, s, symmetric, dims, weights, renormalize))
    for what, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert_close_verbose(a, b, 1e-10, 1e-10, f"{backend} {what}")


@pytest.mark.parametrize("backend", tiled_backends())
def test_bfloat16_inputs(backend):
    # bfloat16 features are exact in float32, which the fused passes accumulate in: the truth is their float64.
    q, k, labels = features_and_labels(40, 40, 24, "perm", torch.bfloat16, seed=10)
    spec, scale = Matryoshka((24, 8, 16), (1.0, 0.5, 0.5)), torch.tensor(10.0)
    got = _grads(
        q,
        k,
        scale,
        torch.tensor(1.0),
        lambda a, b, s: cal_inf_loss(a, b, labels, s, symmetric=True, backend=backend, matryoshka=spec),
    )
    want = _grads(
        q.double(),
        k.double(),
        scale.double(),
        torch.tensor(1.0, dtype=torch.float64),
        lambda a, b, s: truth_losses(a, b, labels, s, True, (24, 8, 16), (1.0, 0.5, 0.5), True).mean(),
    )
    assert got[1].dtype == torch.bfloat16
    atol, rtol = TOLERANCE[torch.float32]
    for what, a, b in zip(("loss", "dscale"), (got[0], got[3]), (want[0], want[3])):
        assert_close_verbose(a, b, atol, rtol, f"{backend} bf16 {what}")
    for what, a, b in zip(("dq", "dk"), got[1:3], want[1:3]):  # rounded to bfloat16 on the way out
        assert_close_verbose(a, b, 0, 2.0**-8, f"{backend} bf16 {what}")


def test_native_ops_pass_opcheck():
    """The fused Matryoshka ops' schemas, fake impls and mutation declarations hold (torch.library.opcheck)."""
    if "cpu" not in tiled_backends():
        pytest.skip("the native kernel is not available here")
    q, k, labels = features_and_labels(12, 12, 10, "perm", torch.float32, seed=11)
    pos, dims, renorm = labels, [3, 10], [True, False]
    torch.library.opcheck(torch.ops.infcl.matryoshka_forward_block.default, (q, k, 5.0, pos, True, dims, renorm))
    rows, cols = torch.ops.infcl.matryoshka_forward_block(q, k, 5.0, pos, True, dims, renorm)
    args = (q, k, 5.0, pos, dims, renorm, rows[:2].contiguous(), torch.ones(2, 12), cols, torch.ones(2, 12))
    torch.library.opcheck(
        torch.ops.infcl.matryoshka_backward_block.default, (*args, torch.zeros(12, 10), torch.zeros(12, 10))
    )
