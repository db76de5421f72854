"""cal_distill_loss against a float64 truth (normal, confident and huge-logit regimes), bad input, and
InfDistillClipLoss against open_clip's own DistillClipLoss on rings of 1 and 3 gloo ranks."""

import inspect

import pytest
import torch

from helpers.distributed import launch, results_by_ring
from helpers.support import TOLERANCE, assert_close_verbose, open_clip_loss_module
from infcl.backends.torch_tiles import TorchTilesBackend
from infcl.distill import InfDistillClipLoss, cal_distill_loss
from workers.distill_ring_worker import MAIN_WORLD, RINGS, run_uneven, uneven_inputs

TILES = ((None, None), (7, 11))
# Normwise relative error bounds against the exact truth: float32 keeps ~|S| * eps of each logit.
NORMWISE = {torch.float32: 1e-4, torch.float64: 1e-10}


@pytest.fixture(params=TILES, ids=lambda t: f"tiles{t[0]}x{t[1]}")
def tiles(request):
    """The backend these tests pass: the torch tiles at these sizes ("auto" would run the native kernel)."""
    return TorchTilesBackend(*request.param)


def _direction_truth(s, t):
    """(row losses, dS / g) of one direction in float64, exact where a naive softmax difference is not: the
    loss as sum_j p_T (m - S_j) + log1p(rest), and each row's entry at its student maximum as minus the sum
    of the row's other entries (the row of softmax(S) - softmax(T) sums to 0)."""
    m, top = s.max(dim=1, keepdim=True)
    shifted = torch.exp(s - m).scatter(1, top, 0.0)
    r = torch.log1p(shifted.sum(dim=1))
    p_t = torch.softmax(t, dim=1)
    loss = (p_t * (m - s)).sum(dim=1) + r
    gap = torch.softmax(s, dim=1) - p_t
    gap = gap.scatter(1, top, 0.0)
    gap = gap.scatter(1, top, -gap.sum(dim=1, keepdim=True))
    return loss, gap


def truth(q, k, tq, tk, scale, teacher_scale, symmetric=True, upstream=None):
    """(per-item losses, dq, dk, dscale) in float64 for the upstream gradient ``upstream`` of the per-item loss."""
    q, k, tq, tk = (x.detach().to(torch.float64) for x in (q, k, tq, tk))
    raw = q @ k.T
    s, t = scale * raw, teacher_scale * (tq @ tk.T)
    rows, d_rows = _direction_truth(s, t)
    g = torch.ones(q.shape[0], dtype=torch.float64) if upstream is None else upstream.to(torch.float64)
    if symmetric:
        cols, d_cols = _direction_truth(s.T, t.T)
        items = (rows + cols) / 2
        ds = (g[:, None] * d_rows + (g[:, None] * d_cols).T) / 2
    else:
        items, ds = rows, g[:, None] * d_rows
    return items, scale * ds @ k, scale * ds.T @ q, (ds * raw).sum()


def _autograd_truth(q, k, tq, tk, scale, teacher_scale, symmetric=True):
    """open_clip's formula with autograd in float64 (the normal regime only: its softmax difference rounds)."""
    q, k = (x.detach().to(torch.float64).requires_grad_() for x in (q, k))
    sc = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
    s, t = sc * q @ k.T, teacher_scale * tq.double() @ tk.double().T
    loss = -(t.softmax(1) * s.log_softmax(1)).sum(1).mean()
    if symmetric:
        loss = (loss - (t.T.softmax(1) * s.T.log_softmax(1)).sum(1).mean()) / 2
    loss.backward()
    return loss.detach(), q.grad, k.grad, sc.grad


def normwise(got, want):
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-300))


def _features(n, m, d, d_teacher, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1)
    k = torch.nn.functional.normalize(
        q[torch.arange(m) % n] + 0.3 * torch.randn(m, d, generator=gen, dtype=torch.float64), dim=1
    )
    tq = torch.nn.functional.normalize(torch.randn(n, d_teacher, generator=gen, dtype=torch.float64), dim=1)
    tk = torch.nn.functional.normalize(
        tq[torch.arange(m) % n] + 0.3 * torch.randn(m, d_teacher, generator=gen, dtype=torch.float64), dim=1
    )
    return tuple(x.to(dtype) for x in (q, k, tq, tk))


def _run(q, k, tq, tk, scale, teacher_scale, upstream=None, **kwargs):
    qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()
    sc = torch.tensor(scale, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, requires_grad=True)
    loss = cal_distill_loss(qs, ks, tq, tk, sc, teacher_scale, **kwargs)
    loss.backward(None if upstream is None else upstream.to(loss.dtype))
    return loss.detach(), qs.grad, ks.grad, sc.grad


def test_truth_is_open_clips_formula():
    """The exact truth agrees with open_clip's formula under autograd where the latter has its digits."""
    q, k, tq, tk = _features(13, 13, 6, 4, torch.float64, 0)
    items, dq, dk, dscale = truth(q, k, tq, tk, 5.0, 7.0, upstream=torch.full((13,), 1 / 13, dtype=torch.float64))
    loss, aq, ak, ascale = _autograd_truth(q, k, tq, tk, 5.0, 7.0)
    for got, want in ((items.mean(), loss), (dq, aq), (dk, ak), (dscale, ascale)):
        assert normwise(got, want) < 1e-12


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("symmetric", (True, False))
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_matches_float64_truth(tiles, dtype, symmetric, reduction):
    n, m = (29, 29) if symmetric else (23, 31)  # one direction: extra columns are allowed
    q, k, tq, tk = _features(n, m, 9, 5, dtype, 1)
    per_item = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    upstream = {
        "mean": torch.full((n,), 1 / n, dtype=torch.float64),
        "sum": torch.ones(n, dtype=torch.float64),
        "none": per_item,
    }[reduction]
    loss, dq, dk, dscale = _run(
        q,
        k,
        tq,
        tk,
        12.0,
        20.0,
        per_item if reduction == "none" else None,
        symmetric=symmetric,
        reduction=reduction,
        backend=tiles,
    )
    items, want_dq, want_dk, want_dscale = truth(q, k, tq, tk, 12.0, 20.0, symmetric, upstream)
    want_loss = {"mean": items.mean(), "sum": items.sum(), "none": items}[reduction]
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    atol, rtol = TOLERANCE[dtype]
    assert_close_verbose(loss.double(), want_loss, atol, rtol, "loss")
    for name, got, want in (("dq", dq, want_dq), ("dk", dk, want_dk), ("dscale", dscale, want_dscale)):
        assert normwise(got, want) < NORMWISE[dtype], f"{name}: {normwise(got, want)}"


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("margin", (25.0, 55.0))
def test_confident_teacher_and_student(tiles, dtype, margin):
    """Teacher and student both put 1 - 1e-11 .. 1e-24 on the diagonal: softmax(S) - softmax(T) at the diagonal
    is a difference of two numbers near 1 that a plain subtraction rounds to nothing, in float32 and float64."""
    n = d = 24
    eye = torch.eye(n, d, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    q = eye + 0.05 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    k = eye + 0.05 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    tq = eye + 0.05 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    q, k, tq = (x.to(dtype) for x in (q, k, tq))
    scale, teacher_scale = margin, 1.3 * margin
    loss, dq, dk, dscale = _run(q, k, tq, tq, scale, teacher_scale, backend=tiles)
    items, want_dq, want_dk, want_dscale = truth(
        q, k, tq, tq, scale, teacher_scale, upstream=torch.full((n,), 1 / n, dtype=torch.float64)
    )
    assert float(items.mean()) < 1e-6, "the case must be confident"
    assert abs(float(loss) - float(items.mean())) <= NORMWISE[dtype] * float(items.mean())
    for name, got, want in (("dq", dq, want_dq), ("dk", dk, want_dk), ("dscale", dscale, want_dscale)):
        assert normwise(got, want) < NORMWISE[dtype] * 10, f"{name}: {normwise(got, want)}"
    # open_clip's formula under autograd in the same dtype: never closer to the truth than we are.
    plain = q.clone().requires_grad_()
    s, t = scale * plain @ k.T, teacher_scale * tq @ tq.T
    (
        (-(t.softmax(1) * s.log_softmax(1)).sum(1).mean() - (t.T.softmax(1) * s.T.log_softmax(1)).sum(1).mean()) / 2
    ).backward()
    ours, theirs = normwise(dq, want_dq), normwise(plain.grad, want_dq)
    assert ours <= theirs + NORMWISE[dtype], f"infcl {ours:.2e}, open_clip's formula {theirs:.2e}"


def test_huge_logits(tiles):
    """Logits of +-1e4 (scale 1e4 on unit features): nothing overflows, float64 truth to round-off."""
    q, k, tq, tk = _features(17, 17, 6, 6, torch.float64, 4)
    loss, dq, dk, dscale = _run(q, k, tq, tk, 1e4, 3e3, backend=tiles)
    items, want_dq, want_dk, want_dscale = truth(
        q, k, tq, tk, 1e4, 3e3, upstream=torch.full((17,), 1 / 17, dtype=torch.float64)
    )
    assert torch.isfinite(loss) and abs(float(loss - items.mean())) <= 1e-10 * float(items.mean())
    for name, got, want in (("dq", dq, want_dq), ("dk", dk, want_dk), ("dscale", dscale, want_dscale)):
        assert normwise(got, want) < 1e-9, f"{name}: {normwise(got, want)}"


def test_teacher_gets_no_gradient_and_nan_propagates():
    q, k, tq, tk = _features(8, 8, 4, 3, torch.float32, 5)
    tq = tq.clone().requires_grad_()
    loss = cal_distill_loss(q.requires_grad_(), k, tq, tk, 10.0, 10.0)
    loss.backward()
    assert tq.grad is None or not bool(tq.grad.any())
    k = k.clone()
    k[2, 1] = float("nan")
    assert torch.isnan(cal_distill_loss(q, k, tq.detach(), tk, 10.0, 10.0))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"teacher_q": torch.randn(5, 3)}, ValueError, "teacher_q must have one row per row of student_q"),
        ({"teacher_k": torch.randn(4, 2)}, ValueError, "teacher_q and teacher_k must have the same feature"),
        ({"student_k": torch.randn(5, 6), "teacher_k": torch.randn(5, 3)}, ValueError, "symmetric=True needs"),
        ({"reduction": "avg"}, ValueError, "reduction must be one of"),
        ({"scale": "x"}, TypeError, "scale must be"),
        ({"teacher_scale": torch.ones(2)}, ValueError, "teacher_scale must be a 0-d"),
        ({"backend": "reference"}, NotImplementedError, "backend='reference'"),
        ({"backend": "gpu"}, ValueError, "backend must be one of"),
        ({"student_q": torch.randn(4, 6).long()}, TypeError, "student_q must be a floating-point"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = {
        "student_q": torch.randn(4, 6),
        "student_k": torch.randn(4, 6),
        "teacher_q": torch.randn(4, 3),
        "teacher_k": torch.randn(4, 3),
        "scale": 10.0,
        "teacher_scale": 10.0,
        **kwargs,
    }
    with pytest.raises(error, match=match):
        cal_distill_loss(**args)


def test_forward_accepts_open_clips_signature():
    theirs = list(inspect.signature(open_clip_loss_module().DistillClipLoss.forward).parameters)
    ours = list(inspect.signature(InfDistillClipLoss.forward).parameters)
    assert ours == theirs


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    open_clip_loss_module()  # skips without open_clip
    outcomes = launch(
        MAIN_WORLD,
        "workers.distill_ring_worker",
        str(tmp_path_factory.mktemp("distill")),
        pg_timeout_s=60.0,
        deadline_s=170.0,
    )
    return results_by_ring(outcomes, RINGS)


@pytest.mark.parametrize("world", tuple(RINGS))
def test_matches_open_clip_distill_clip_loss(spawned, world):
    """Per rank: both losses and the image, text and logit_scale gradients equal DistillClipLoss's."""
    for rank, results in enumerate(spawned(world)):
        want, got = results["open_clip"], results["infcl"]
        assert got["keys"] == want["keys"] == ["contrastive_loss", "distill_loss"]
        assert float(want["scale"].abs()) > 1e-4, "trivial scale gradient"
        for key in ("contrastive_loss", "distill_loss", "image", "text", "scale"):
            assert_close_verbose(got[key], want[key], *TOLERANCE[torch.float32], f"world={world} rank={rank} {key}")
        assert got["teacher_grad"] is None


def test_ring_matches_one_process(spawned):
    """cal_distill_loss on 3 ranks (uneven shards, one direction, per-row losses) equals one process's."""
    per_rank = [r["ring"] for r in spawned(3)]
    single = run_uneven(*uneven_inputs())
    for key in ("loss", "dq", "dk"):
        assert_close_verbose(torch.cat([r[key] for r in per_rank]), single[key], *TOLERANCE[torch.float64], key)
    # each rank's scale gets the derivative of its own rows' loss: their sum is the whole loss's
    assert_close_verbose(sum(r["dscale"] for r in per_rank), single["dscale"], *TOLERANCE[torch.float64], "dscale")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_cuda_matches_truth(dtype):
    q, k, tq, tk = _features(3000, 3000, 64, 48, dtype, 12)
    loss, dq, dk, dscale = _run(*(x.cuda() for x in (q, k, tq, tk)), 30.0, 50.0)
    items, want_dq, want_dk, want_dscale = truth(
        q, k, tq, tk, 30.0, 50.0, upstream=torch.full((3000,), 1 / 3000, dtype=torch.float64)
    )
    assert abs(float(loss) - float(items.mean())) <= NORMWISE[dtype] * float(items.mean())
    for name, got, want in (("dq", dq, want_dq), ("dk", dk, want_dk), ("dscale", dscale, want_dscale)):
        assert normwise(got.cpu(), want) < NORMWISE[dtype], f"{name}: {normwise(got.cpu(), want)}"
