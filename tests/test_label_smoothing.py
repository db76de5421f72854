"""``cal_inf_loss(label_smoothing=eps)`` on every backend against ``F.cross_entropy(..., label_smoothing=eps)`` in
float64 on the materialized logits (built here without infcl): loss and the gradients of q, k and the scale, one
direction and symmetric, hard negatives, custom labels, every reduction, non-unit and negative upstream
gradients, confident rows, low precision no worse than torch's own. The ring: tests/test_options_ring.py.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers.options_truth import kept_truth, masked_truth
from helpers.support import (
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    features_and_labels,
    reduce_masked_truth,
    tiled_backends,
)
from infcl import InfCLIPLoss, cal_inf_loss
from infcl.backends.torch_tiles import TorchTilesBackend
from infcl.backends.triton.backend import TritonBackend
from infcl.kernels.configs import TileConfig, Tiling

BACKENDS = ("reference", *tiled_backends(), "torch-small-tiles")
EPS = (0.1, 0.37, 1.0)
# (Bq, Bk, D, labels, symmetric)
CASES = (
    (7, 7, 3, "perm", True),
    (7, 7, 3, "random", False),
    (33, 70, 19, "random", False),  # hard negatives: Bk > Bq
    (129, 129, 40, "diag", True),
)


def truth_losses(q, k, labels, scale, eps, symmetric):
    """Per-row (symmetric: per pair) float64 losses of F.cross_entropy(label_smoothing=eps) on the logits."""
    q, k, scale = q.double(), k.double(), scale.double()
    logits = scale * q @ k.T
    labels = torch.arange(q.shape[0]) if labels is None else labels
    rows = F.cross_entropy(logits, labels, reduction="none", label_smoothing=eps)
    if not symmetric:
        return rows
    return (rows + F.cross_entropy(logits.T, torch.argsort(labels), reduction="none", label_smoothing=eps)) / 2


def reduce(per, reduction):
    return {"mean": per.mean, "sum": per.sum, "none": lambda: per}[reduction]()


def run(q, k, labels, scale, upstream, **kwargs):
    q, k, scale = (t.detach().clone().requires_grad_() for t in (q, k, scale))
    loss = cal_inf_loss(q, k, labels, scale, **kwargs)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), q.grad, k.grad, scale.grad


def truth(q, k, labels, scale, upstream, eps, symmetric, reduction):
    q, k, scale = (t.detach().double().requires_grad_() for t in (q, k, scale))
    loss = reduce(truth_losses(q, k, labels, scale, eps, symmetric), reduction)
    loss.backward(upstream.double())
    return loss.detach(), q.grad, k.grad, scale.grad


class NoKeptSums(TorchTilesBackend):
    """A backend object whose masked tiles do not sum the kept logits (every built-in one does): label smoothing
    with ids takes the same-id sums of the features (SmoothedIdsSteps), with a guide the torch tiles' own."""

    kept_sums = False


def _backend(name):
    if name == "torch-small-tiles":
        return TorchTilesBackend(5, 7)  # the torch tiles at these sizes, passed by the call
    if name == "no-kept-sums":
        return NoKeptSums(5, 7)
    return name


def _upstream(reduction, bq, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.randn(bq, generator=gen, dtype=torch.float64)  # both signs, non-unit
    return torch.tensor(-0.7, dtype=torch.float64)


def _check(got, want, dtype, what):
    atol, rtol = TOLERANCE[dtype]
    for name, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert_close_verbose(a, b, atol, rtol, f"{what} {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bq,bk,d,label_kind,symmetric", CASES)
@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_matches_cross_entropy(backend, bq, bk, d, label_kind, symmetric, reduction):
    name = _backend(backend)
    q, k, labels = features_and_labels(bq, bk, d, label_kind, torch.float32)
    scale = torch.tensor(14.3)
    g = _upstream(reduction, bq)
    for eps in EPS:
        kw = dict(symmetric=symmetric, reduction=reduction, label_smoothing=eps, backend=name)
        got = run(q, k, labels, scale, g, **kw)
        _check(got, truth(q, k, labels, scale, g, eps, symmetric, reduction), torch.float32, f"{backend} eps={eps}")


@pytest.mark.parametrize("backend", BACKENDS[:-1])
@pytest.mark.parametrize("symmetric", (False, True))
def test_float64_sum_and_confident_rows(backend, symmetric):
    # Confident rows (1 - P_pos ~ e^-60) and large logits: the smoothed target keeps the loss ~ eps * spread,
    # and the gradient's -eps / n terms must hold their digits next to P ~ 0.
    q, k, labels = features_and_labels(23, 23, 5, "perm", torch.float64, seed=3)
    k = k.clone()
    k[labels] = q * 1.0  # the positive is the row itself: the largest logit by far at scale 80
    scale = torch.tensor(80.0, dtype=torch.float64)
    g = torch.tensor(2.5, dtype=torch.float64)
    kw = dict(symmetric=symmetric, reduction="sum", label_smoothing=0.2, backend=backend)
    got = run(q, k, labels, scale, g, **kw)
    _check(got, truth(q, k, labels, scale, g, 0.2, symmetric, "sum"), torch.float64, backend)


@pytest.mark.parametrize("backend", [b for b in tiled_backends() if b != "chunked"])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_low_precision_no_worse_than_torch(backend, dtype):
    q, k, labels = features_and_labels(64, 64, 32, "perm", dtype, seed=5)
    scale = torch.tensor(14.3)
    g = torch.tensor(1.0, dtype=torch.float64)
    got = run(q, k, labels, scale, g, symmetric=True, label_smoothing=0.1, backend=backend)
    want = truth(q, k, labels, scale, g, 0.1, True, "mean")
    # torch itself in the low dtype: the logits in it, cross-entropy in float32 (as a user writes it)
    ql, kl = (t.detach().clone().requires_grad_() for t in (q, k))
    logits = (14.3 * ql @ kl.T).float()
    vanilla = (
        F.cross_entropy(logits, labels, label_smoothing=0.1)
        + F.cross_entropy(logits.T, torch.argsort(labels), label_smoothing=0.1)
    ) / 2
    vanilla.backward()
    atol, rtol = TOLERANCE[dtype]
    assert_no_worse(got[0], vanilla.detach(), want[0], atol, rtol, f"{backend} {dtype} loss")
    assert_no_worse(got[1], ql.grad, want[1], atol, rtol, f"{backend} {dtype} dq")
    assert_no_worse(got[2], kl.grad, want[2], atol, rtol, f"{backend} {dtype} dk")


@pytest.mark.parametrize("backend", tiled_backends())
def test_zero_eps_is_the_plain_loss_bit_for_bit(backend):
    q, k, labels = features_and_labels(40, 40, 8, "perm", torch.float32, seed=2)
    scale, g = torch.tensor(10.0), torch.tensor(1.0)
    plain = run(q, k, labels, scale, g, symmetric=True, backend=backend)
    zero = run(q, k, labels, scale, g, symmetric=True, label_smoothing=0.0, backend=backend)
    for a, b in zip(plain, zero):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", tiled_backends())
@pytest.mark.parametrize("symmetric", (False, True))
def test_nan_in_nan_out(backend, symmetric):
    # NaN where F.cross_entropy gives NaN: row 3's loss, and under the symmetric loss every column's.
    q, k, labels = features_and_labels(9, 9, 4, "perm", torch.float32)
    q = q.clone()
    q[3, 1] = float("nan")
    kw = dict(symmetric=symmetric, reduction="none", label_smoothing=0.1, backend=backend)
    loss = cal_inf_loss(q, k, labels, torch.tensor(5.0), **kw)
    want = truth_losses(q, k, labels, torch.tensor(5.0), 0.1, symmetric)
    assert torch.equal(torch.isnan(loss), torch.isnan(want)) and torch.isnan(loss[3])


@pytest.mark.parametrize(
    "value,error,match",
    (
        (-0.1, ValueError, r"label_smoothing must be in \[0, 1\], got -0.1"),
        (1.5, ValueError, r"label_smoothing must be in \[0, 1\]"),
        (float("nan"), ValueError, r"label_smoothing must be in \[0, 1\]"),
        ("0.1", TypeError, "label_smoothing must be a real number, got str"),
        (True, TypeError, "label_smoothing must be a real number, got bool"),
    ),
)
def test_bad_values_raise(value, error, match):
    q, k, _ = features_and_labels(4, 4, 3, "diag", torch.float32)
    with pytest.raises(error, match=match):
        cal_inf_loss(q, k, label_smoothing=value)


@pytest.mark.parametrize("backend", BACKENDS + ("no-kept-sums",))
@pytest.mark.parametrize("multi_positive", (None, "mean", "sum"))
@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("partnerless", (False, True))
def test_with_ids(backend, multi_positive, symmetric, partnerless):
    # Ids from few classes (false negatives under None; several positives under "mean" / "sum"); partnerless: k ids
    # drawn apart, so under "mean" / "sum" some rows and columns have no positive (no loss, left out of the mean).
    if partnerless and multi_positive is None:
        pytest.skip("one positive per row: every row has its label")
    name = _backend(backend)
    bq, bk = 17, 17 if symmetric else 29
    q, k, labels = features_and_labels(bq, bk, 6, "perm" if symmetric else "random", torch.float64, seed=8)
    gen = torch.Generator().manual_seed(9)
    q_ids = torch.randint(0, 4, (bq,), generator=gen)
    k_ids = torch.randint(0, 6 if partnerless else 4, (bk,), generator=gen)
    if not partnerless:
        k_ids[labels] = q_ids
    scale, g = torch.tensor(9.0, dtype=torch.float64), torch.tensor(0.7, dtype=torch.float64)
    kw = dict(symmetric=symmetric, label_smoothing=0.3, backend=name, q_ids=q_ids, k_ids=k_ids)
    got = run(q, k, labels, scale, g, multi_positive=multi_positive, **kw)

    def loss_fn(a, b, s):
        rows, cols = masked_truth(a, b, labels, s, q_ids, k_ids, multi_positive, 0.3, symmetric)
        return reduce_masked_truth(rows, cols, "mean")

    qa, ka, sa = (t.detach().clone().requires_grad_() for t in (q, k, scale))
    want_loss = loss_fn(qa, ka, sa)
    want_loss.backward(g)
    _check(got, (want_loss.detach(), qa.grad, ka.grad, sa.grad), torch.float64, f"{backend} {multi_positive}")


def test_infclip_loss_takes_it():
    q, k, _ = features_and_labels(16, 16, 8, "diag", torch.float32, seed=4)
    scale = torch.tensor(20.0)
    got = InfCLIPLoss(label_smoothing=0.15)(q, k, scale)
    want = truth_losses(q, k, None, scale, 0.15, True).mean()
    assert_close_verbose(got, want, 1e-5, 1e-5, "InfCLIPLoss(label_smoothing)")


@pytest.mark.parametrize("backend", ("triton",))  # the interpreter (TRITON_INTERPRET=1): small shapes only
@pytest.mark.parametrize("symmetric", (False, True))
def test_triton_interpreted(backend, symmetric):
    q, k, labels = features_and_labels(9, 9 if symmetric else 13, 5, "perm" if symmetric else "random", torch.float32)
    scale, g = torch.tensor(14.3), _upstream("none", 9)
    kw = dict(symmetric=symmetric, reduction="none", label_smoothing=0.25, backend=backend)
    got = run(q, k, labels, scale, g, **kw)
    _check(got, truth(q, k, labels, scale, g, 0.25, symmetric, "none"), torch.float32, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("symmetric", (False, True))
def test_sum_with_unique_ids_is_cross_entropy(backend, symmetric):
    # One positive per row (ids never repeat): "sum" is the plain loss, so F.cross_entropy(label_smoothing) itself
    # is the truth; eps = 1 too (the positives' part has weight 0).
    name = _backend(backend)
    q, k, labels = features_and_labels(19, 19, 6, "perm", torch.float64, seed=6)
    ids = torch.arange(19)
    scale, g = torch.tensor(11.0, dtype=torch.float64), _upstream("none", 19)
    for eps in (0.4, 1.0):
        kw = dict(symmetric=symmetric, reduction="none", label_smoothing=eps, backend=name)
        got = run(q, k, labels, scale, g, q_ids=ids, k_ids=ids[torch.argsort(labels)], multi_positive="sum", **kw)
        want = truth(q, k, labels, scale, g, eps, symmetric, "none")
        _check(got, want, torch.float64, f"{backend} eps={eps}")


@pytest.mark.parametrize("backend", BACKENDS[:-1])
@pytest.mark.parametrize("eps", (0.999, 1.0))
def test_sum_confident_and_eps_one(backend, eps):
    # Several positives per row, confident (scale 60): the positives' share 1 - P(P) ~ e^-40, the (1 - eps)
    # scaled target y' = (1 - eps) * y next to p ~ y; eps = 1 is "mean"'s uniform target.
    q, k, labels = features_and_labels(21, 21, 5, "perm", torch.float64, seed=12)
    q_ids = torch.arange(21) % 7
    k_ids = torch.empty_like(q_ids)
    k_ids[labels] = q_ids
    k = k.clone()
    k[labels] = q  # each row's positives: its own copy and those of its class
    scale, g = torch.tensor(60.0, dtype=torch.float64), torch.tensor(-1.7, dtype=torch.float64)
    kw = dict(symmetric=True, label_smoothing=eps, backend=backend, q_ids=q_ids, k_ids=k_ids, multi_positive="sum")
    got = run(q, k, labels, scale, g, **kw)
    qa, ka, sa = (t.detach().clone().requires_grad_() for t in (q, k, scale))
    rows, cols = masked_truth(qa, ka, labels, sa, q_ids, k_ids, "sum", eps, True)
    want = reduce_masked_truth(rows, cols, "mean")
    want.backward(g)
    _check(got, (want.detach(), qa.grad, ka.grad, sa.grad), torch.float64, f"{backend} eps={eps}")


@pytest.mark.parametrize("backend", ("triton",))  # the interpreter: small shapes only
@pytest.mark.parametrize("multi_positive", (None, "mean", "sum"))
def test_triton_interpreted_with_ids(backend, multi_positive):
    q, k, labels = features_and_labels(9, 9, 5, "perm", torch.float32, seed=3)
    q_ids = torch.tensor([0, 1, 0, 2, 1, 0, 3, 2, 1])
    k_ids = torch.empty_like(q_ids)
    k_ids[labels] = q_ids
    scale, g = torch.tensor(9.0), torch.tensor(1.3, dtype=torch.float64)
    kw = dict(symmetric=True, label_smoothing=0.2, backend=backend, q_ids=q_ids, k_ids=k_ids)
    got = run(q, k, labels, scale, g, multi_positive=multi_positive, **kw)
    qa, ka, sa = (t.detach().double().requires_grad_() for t in (q, k, scale))
    rows, cols = masked_truth(qa, ka, labels, sa, q_ids, k_ids, multi_positive, 0.2, True)
    want = reduce_masked_truth(rows, cols, "mean")
    want.backward(g)
    _check(got, (want.detach(), qa.grad, ka.grad, sa.grad), torch.float32, f"triton {multi_positive}")


def guided_inputs(bq, bk, symmetric, dtype=torch.float64, seed=21):
    """Features, labels, ids from few classes and integer-valued guide features (exact scores), where some
    columns duplicate a row's labelled column's guide features: at margin 0 they tie its threshold and stay."""
    q, k, labels = features_and_labels(bq, bk, 6, "perm" if symmetric else "random", dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q_ids = torch.randint(0, 4, (bq,), generator=gen)
    k_ids = torch.randint(0, 4, (bk,), generator=gen)
    k_ids[labels] = q_ids
    gq = torch.randint(-2, 3, (bq, 3), generator=gen).to(dtype)
    gk = torch.randint(-2, 3, (bk, 3), generator=gen).to(dtype)
    for i in range(0, bq, 3):  # ties: a column that is not row i's label with its guide features
        j = (int(labels[i]) + 1) % bk
        gk[j] = gk[labels[i]]
    return q, k, labels, q_ids, k_ids, (gq, gk)


GUIDE_MODES = (("guide", None), ("both", None), ("both", "mean"), ("both", "sum"))
MARGINS = ((0.0, "absolute"), (0.25, "relative"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,multi_positive", GUIDE_MODES)
@pytest.mark.parametrize("symmetric", (False, True))
def test_with_guide(backend, kind, multi_positive, symmetric):
    # The uniform part over the columns the guide (and the ids) leave in the denominator, ties at margin 0 kept;
    # against F.cross_entropy on each row's logits with its excluded columns removed.
    name = _backend(backend)
    bq, bk = 17, 17 if symmetric else 23
    q, k, labels, q_ids, k_ids, guide = guided_inputs(bq, bk, symmetric)
    scale, g = torch.tensor(9.0, dtype=torch.float64), _upstream("none", bq)
    ids = {} if kind == "guide" else dict(q_ids=q_ids, k_ids=k_ids, multi_positive=multi_positive)
    for (margin, strategy), eps in zip(MARGINS, (0.3, 1.0 if multi_positive == "sum" else 0.15)):
        kw = dict(symmetric=symmetric, reduction="none", label_smoothing=eps, backend=name, guide=guide)
        kw.update(guide_margin=margin, guide_margin_strategy=strategy, **ids)
        got = run(q, k, labels, scale, g, **kw)
        qa, ka, sa = (t.detach().clone().requires_grad_() for t in (q, k, scale))
        rows, cols = kept_truth(
            qa,
            ka,
            labels,
            sa,
            ids.get("q_ids"),
            ids.get("k_ids"),
            multi_positive,
            guide,
            margin,
            strategy,
            eps,
            symmetric,
        )
        want = reduce_masked_truth(rows, cols, "none")
        torch.where(torch.isnan(want), 0.0, want * g).sum().backward()
        got_loss = torch.where(torch.isnan(got[0]), 0.0, got[0])
        want_loss = torch.where(torch.isnan(want), 0.0, want.detach())
        assert torch.equal(torch.isnan(got[0]), torch.isnan(want))
        what = f"{backend} {kind} {multi_positive} margin={margin} eps={eps}"
        _check((got_loss, *got[1:]), (want_loss, qa.grad, ka.grad, sa.grad), torch.float64, what)


@pytest.mark.parametrize("backend", BACKENDS[:-1])
def test_with_guide_float32(backend):
    q, k, labels, q_ids, k_ids, guide = guided_inputs(29, 29, True, torch.float32, seed=4)
    scale, g = torch.tensor(14.0), torch.tensor(1.0, dtype=torch.float64)
    kw = dict(symmetric=True, label_smoothing=0.2, backend=backend, guide=guide, q_ids=q_ids, k_ids=k_ids)
    got = run(q, k, labels, scale, g, **kw)
    qa, ka, sa = (t.detach().double().requires_grad_() for t in (q, k, scale))
    rows, cols = kept_truth(qa, ka, labels, sa, q_ids, k_ids, None, guide, 0.0, "absolute", 0.2, True)
    want = reduce_masked_truth(rows, cols, "mean")
    want.backward(g)
    _check(got, (want.detach(), qa.grad, ka.grad, sa.grad), torch.float32, f"{backend} float32 guide")


def test_kept_truth_is_masked_truth_without_guide():
    # The row-by-row F.cross_entropy truth and the closed form of test_with_ids agree where both apply.
    q, k, labels, q_ids, k_ids, _ = guided_inputs(13, 13, True)
    for mode in (None, "mean", "sum"):
        a = kept_truth(q, k, labels, torch.tensor(5.0), q_ids, k_ids, mode, None, 0.0, "absolute", 0.3, True)
        b = masked_truth(q, k, labels, torch.tensor(5.0), q_ids, k_ids, mode, 0.3, True)
        for x, y in zip(a, b):
            assert_close_verbose(x, y, 1e-12, 1e-12, f"truths {mode}")


def _in_tile(monkeypatch, steps, name):
    """Records the masked block steps' kept-sums requests on the backend class ``steps`` (its forward_block and
    backward_block) and fails any call on the torch tiles: a guide (or ids) smoothed on backend ``name`` must sum
    and subtract the uniform part in its own tiles, not be rerouted."""
    from infcl.backends.torch_tiles.softmax import SoftmaxTiles

    seen = []
    forward, backward = steps.forward_block, steps.backward_block

    def spy_forward(self, block, symmetric):
        seen.append(("forward", block.kept_sums))
        return forward(self, block, symmetric)

    def spy_backward(self, block, dq, dk):
        seen.append(("backward", block.row_uniform is not None))
        return backward(self, block, dq, dk)

    def rerouted(*args, **kwargs):
        raise AssertionError(f"label smoothing on {name!r} ran on the torch tiles")

    monkeypatch.setattr(steps, "forward_block", spy_forward)
    monkeypatch.setattr(steps, "backward_block", spy_backward)
    monkeypatch.setattr(SoftmaxTiles, "forward_block", rerouted)
    monkeypatch.setattr(SoftmaxTiles, "backward_block", rerouted)
    return seen


def _native_in_tile(monkeypatch):
    from infcl.backends.native.softmax import NativeSoftmax

    return _in_tile(monkeypatch, NativeSoftmax, "cpu")


@pytest.mark.parametrize("kind,multi_positive", GUIDE_MODES + (("ids", None), ("ids", "mean"), ("ids", "sum")))
@pytest.mark.parametrize("symmetric", (False, True))
def test_native_in_tile(monkeypatch, kind, multi_positive, symmetric):
    # The native kernel sums the kept logits in its masked forward and subtracts eps * g / n_kept in its masked
    # backward (a guide is no longer rerouted; ids take the in-tile path too), against the float64 truth.
    if "cpu" not in tiled_backends():
        pytest.skip("the native kernel is unavailable here")
    seen = _native_in_tile(monkeypatch)
    bq, bk = 17, 17 if symmetric else 23
    q, k, labels, q_ids, k_ids, guide = guided_inputs(bq, bk, symmetric, seed=31)
    scale, g = torch.tensor(9.0, dtype=torch.float64), _upstream("none", bq)
    masks = dict(q_ids=q_ids, k_ids=k_ids, multi_positive=multi_positive) if kind != "guide" else {}
    if kind != "ids":
        masks["guide"] = guide
    kw = dict(symmetric=symmetric, reduction="none", label_smoothing=0.3, backend="cpu", **masks)
    got = run(q, k, labels, scale, g, **kw)
    assert seen and all(flag for _, flag in seen), seen
    qa, ka, sa = (t.detach().clone().requires_grad_() for t in (q, k, scale))
    rows, cols = kept_truth(
        qa, ka, labels, sa, masks.get("q_ids"), masks.get("k_ids"), multi_positive, masks.get("guide"), 0.0,
        "absolute", 0.3, symmetric,
    )  # fmt: skip
    want = reduce_masked_truth(rows, cols, "none")
    torch.where(torch.isnan(want), 0.0, want * g).sum().backward()
    assert torch.equal(torch.isnan(got[0]), torch.isnan(want))
    got_loss = torch.where(torch.isnan(got[0]), 0.0, got[0])
    want_loss = torch.where(torch.isnan(want), 0.0, want.detach())
    _check((got_loss, *got[1:]), (want_loss, qa.grad, ka.grad, sa.grad), torch.float64, f"cpu {kind} {multi_positive}")


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_native_in_tile_many_tiles(monkeypatch, dtype):
    # Several row tiles, column groups and key tiles (Bk > the kernel's 512-wide key tile): the kept sums of the
    # columns merged across groups, the uniform weights across key tiles; guide and ids, symmetric.
    if "cpu" not in tiled_backends():
        pytest.skip("the native kernel is unavailable here")
    seen = _native_in_tile(monkeypatch)
    q, k, labels, q_ids, k_ids, guide = guided_inputs(530, 530, True, dtype, seed=5)
    scale, g = torch.tensor(12.0, dtype=dtype), torch.tensor(0.8, dtype=torch.float64)
    kw = dict(symmetric=True, label_smoothing=0.2, backend="cpu", guide=guide, q_ids=q_ids, k_ids=k_ids)
    got = run(q, k, labels, scale, g, **kw)
    assert seen and all(flag for _, flag in seen), seen
    qa, ka, sa = (t.detach().double().requires_grad_() for t in (q, k, scale))
    rows, cols = kept_truth(qa, ka, labels, sa, q_ids, k_ids, None, guide, 0.0, "absolute", 0.2, True)
    want = reduce_masked_truth(rows, cols, "mean")
    want.backward(g)
    _check(got, (want.detach(), qa.grad, ka.grad, sa.grad), dtype, f"cpu many tiles {dtype}")


# --- the Triton kernels' kept sums (the interpreter: small shapes) ----------------------------------------------

# 16 x 16 tiles, 2 row groups and 2 k splits in the forward, 2 splits per dq / dk block: the kept sums of rows merged
# across splits, of columns across groups, the uniform weights over several ragged tiles of 37 x 45.
SMALL_SPLIT = Tiling(*(TileConfig(16, 16, block_out=16),) * 3, resident_d=16, chunk_d=16).with_splits(2, 2, 2)


def _triton_kept_case(
    monkeypatch, backend, kind, multi_positive, symmetric, margin, strategy, eps, bq, bk, seed, dtype=torch.float32
):
    """One call on the Triton kernels (spied: in-tile, never rerouted) against the float64 row-by-row truth, with
    upstream gradients of both signs and a zero."""
    from infcl.backends.triton.softmax import TritonSoftmax

    seen = _in_tile(monkeypatch, TritonSoftmax, "triton")
    q, k, labels, q_ids, k_ids, guide = guided_inputs(bq, bk, symmetric, dtype, seed=seed)
    g = _upstream("none", bq)
    g[1] = 0.0
    masks = dict(q_ids=q_ids, k_ids=k_ids, multi_positive=multi_positive) if kind != "guide" else {}
    if kind != "ids":
        masks.update(guide=guide, guide_margin=margin, guide_margin_strategy=strategy)
    kw = dict(symmetric=symmetric, reduction="none", label_smoothing=eps, backend=backend, **masks)
    got = run(q, k, labels, torch.tensor(9.0, dtype=dtype), g, **kw)
    assert seen and all(flag for _, flag in seen), seen
    qa, ka, sa = (t.detach().double().requires_grad_() for t in (q, k, torch.tensor(9.0)))
    rows, cols = kept_truth(
        qa, ka, labels, sa, masks.get("q_ids"), masks.get("k_ids"), multi_positive, masks.get("guide"), margin,
        strategy, eps, symmetric,
    )  # fmt: skip
    want = reduce_masked_truth(rows, cols, "none")
    torch.where(torch.isnan(want), 0.0, want * g).sum().backward()
    assert torch.equal(torch.isnan(got[0]), torch.isnan(want))
    got_loss = torch.where(torch.isnan(got[0]), 0.0, got[0])
    want_loss = torch.where(torch.isnan(want), 0.0, want.detach())
    what = f"triton {kind} {multi_positive} margin={margin} eps={eps}"
    _check((got_loss, *got[1:]), (want_loss, qa.grad, ka.grad, sa.grad), dtype, what)


@pytest.mark.parametrize("backend", ("triton",))  # the interpreter (marker: interpreter)
@pytest.mark.parametrize("kind,multi_positive", GUIDE_MODES + (("ids", None), ("ids", "mean"), ("ids", "sum")))
@pytest.mark.parametrize("symmetric", (False, True))
def test_triton_in_tile(monkeypatch, backend, kind, multi_positive, symmetric):
    # The Triton kernels sum the kept logits in their masked forward and subtract eps * g / n_kept in their masked
    # backward (a guide is no longer rerouted to the torch tiles; ids take the in-tile path too). One tile.
    margin, strategy, eps = (0.25, "relative", 1.0) if multi_positive == "sum" else (0.0, "absolute", 0.3)
    bq, bk = 17, 17 if symmetric else 23
    _triton_kept_case(monkeypatch, backend, kind, multi_positive, symmetric, margin, strategy, eps, bq, bk, 31)


@pytest.mark.parametrize("backend", ("triton",))
@pytest.mark.parametrize("kind,multi_positive", (("guide", None), ("both", "mean"), ("both", "sum")))
@pytest.mark.parametrize("symmetric", (False, True))
def test_triton_in_tile_many_tiles(monkeypatch, backend, kind, multi_positive, symmetric):
    # Ragged 16 x 16 tiles, row groups and k splits (SMALL_SPLIT): the partials' kept rows merged on the host.
    name = TritonBackend(tiling=SMALL_SPLIT)
    margin, strategy = (0.25, "relative") if symmetric else (0.0, "absolute")
    bk = 37 if symmetric else 45
    _triton_kept_case(monkeypatch, name, kind, multi_positive, symmetric, margin, strategy, 0.2, 37, bk, 5)


@pytest.mark.parametrize("backend", ("triton",))
@pytest.mark.parametrize("multi_positive", (None, "mean"))
def test_triton_in_tile_float64(monkeypatch, backend, multi_positive):
    # float64 features and guide (the FMA kernels in float64, the interpreter's tl.dot): float64's tolerance.
    kw = dict(kind="both", multi_positive=multi_positive, symmetric=True, margin=0.0, strategy="absolute", eps=0.4)
    _triton_kept_case(monkeypatch, backend, **kw, bq=19, bk=19, seed=7, dtype=torch.float64)


@pytest.mark.parametrize("name", ("triton", "chunked", "torch", "cpu"))
def test_guided_smoothing_is_not_rerouted(name):
    # Every built-in backend's masked tiles sum the kept logits, so a guided, smoothed call runs where it was sent.
    from infcl.api import smoothing_backend
    from infcl.backends import backend_object
    from infcl.masks import MaskOptions

    if name == "cpu" and "cpu" not in tiled_backends():
        pytest.skip("the native kernel is unavailable here")
    backend = backend_object(name)
    assert getattr(backend, "kept_sums", False), name
    guide = (torch.zeros(3, 2), torch.zeros(3, 2))
    masks = MaskOptions(guide_q=guide[0], guide_k=guide[1])
    assert smoothing_backend(backend, masks, 0.1) is backend
    # one without kept sums is rerouted (the torch tiles decide both the thresholds and the exclusions)
    assert smoothing_backend(NoKeptSums(), masks, 0.1) is backend_object("torch")
