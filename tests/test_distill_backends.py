"""cal_distill_loss on the native kernel and the Triton kernels (the interpreter without a GPU) against the
float64 truth of tests/test_distill.py: both directions, per-row upstream gradients, a teacher of another
width, the confident and the huge-logit regimes, NaN, and the teacher's lack of a gradient. Shapes cut
every block into several ragged tiles of each backend."""

import pytest
import torch

from helpers.support import TOLERANCE, assert_close_verbose
from infcl.backends import unavailable_reason
from infcl.distill import InfDistillClipLoss, cal_distill_loss
from test_distill import NORMWISE, _features, _run, normwise, truth

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = [name for name in ("cpu", "triton") if unavailable_reason(name, DEVICE) is None]
# Rows per case: past the native kernel's 512-column key tile and 96-row row tiles; three ragged blocks of
# the interpreter's 32 x 32 tiles.
SIZE = {"cpu": 600, "triton": 70}

pytestmark = [
    pytest.mark.skipif(not BACKENDS, reason="neither the native nor the Triton backend runs here"),
    # The interpreter's numpy warns on the padded lines of a ragged block (all -inf, never stored).
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _on_device(*tensors):
    return tuple(t.to(DEVICE) for t in tensors)


def _check(got, want, dtype, bound=None):
    bound = NORMWISE[dtype] if bound is None else bound
    for name, g, w in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert normwise(g.cpu(), w) < bound, f"{name}: {normwise(g.cpu(), w):.2e}"


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("symmetric", (True, False))
def test_matches_float64_truth(backend, dtype, symmetric):
    """Per-row losses with a random upstream gradient (reduction "none"); one direction with more columns."""
    n = SIZE[backend]
    m = n if symmetric else n + n // 3
    q, k, tq, tk = _features(n, m, 9, 5, dtype, 1)
    upstream = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = _run(
        *_on_device(q, k, tq, tk),
        12.0,
        20.0,
        upstream.to(DEVICE),
        symmetric=symmetric,
        reduction="none",
        backend=backend,
    )
    want = truth(q, k, tq, tk, 12.0, 20.0, symmetric, upstream)
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    atol, rtol = TOLERANCE[dtype]
    assert_close_verbose(got[0].cpu().double(), want[0], atol, rtol, "loss")
    _check(got, want, dtype)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
@pytest.mark.parametrize("margin", (25.0, 55.0))
def test_confident_teacher_and_student(backend, dtype, margin):
    """Both put 1 - 1e-11 .. 1e-24 on the diagonal: the difference of two probabilities near 1 keeps its digits
    (the interpreter, at ~0.5 s per call, runs the harder margin only)."""
    if backend == "triton" and margin < 55.0:
        pytest.skip("the interpreter runs margin 55 only")
    n = d = 40
    eye = torch.eye(n, d, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    q, k, tq = (eye + 0.05 * torch.randn(n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k, tq = (x.to(dtype) for x in (q, k, tq))
    got = _run(*_on_device(q, k, tq, tq), margin, 1.3 * margin, backend=backend)
    want = truth(q, k, tq, tq, margin, 1.3 * margin, upstream=torch.full((n,), 1 / n, dtype=torch.float64))
    assert float(want[0].mean()) < 1e-6, "the case must be confident"
    assert abs(float(got[0]) - float(want[0].mean())) <= NORMWISE[dtype] * float(want[0].mean())
    _check(got[1:], want[1:], dtype, NORMWISE[dtype] * 10)


def test_huge_logits(backend):
    """Logits of +-1e4: nothing overflows, float64 truth to round-off."""
    q, k, tq, tk = _features(37, 37, 6, 6, torch.float64, 4)
    got = _run(*_on_device(q, k, tq, tk), 1e4, 3e3, backend=backend)
    want = truth(q, k, tq, tk, 1e4, 3e3, upstream=torch.full((37,), 1 / 37, dtype=torch.float64))
    assert abs(float(got[0]) - float(want[0].mean())) <= 1e-10 * float(want[0].mean())
    _check(got[1:], want[1:], torch.float64, 1e-9)


def test_bfloat16_no_worse_than_torch(backend):
    """bfloat16 students (a float32 teacher): the loss and the scale's gradient to float32 round-off of the
    float64 truth, dq and dk no further from it than open_clip's formula under autograd in bfloat16 (the
    Triton kernels round dS to bfloat16 for the gradient products, as torch's bfloat16 backward does)."""
    n = SIZE[backend]
    q, k, tq, tk = _features(n, n, 16, 8, torch.bfloat16, 5)
    tq, tk = tq.float(), tk.float()
    got = _run(*_on_device(q, k, tq, tk), 20.0, 30.0, backend=backend)
    want = truth(q, k, tq, tk, 20.0, 30.0, upstream=torch.full((n,), 1 / n, dtype=torch.float64))
    assert abs(float(got[0]) - float(want[0].mean())) <= 1e-5 * float(want[0].mean())
    assert normwise(got[3].cpu(), want[3]) < 1e-5
    plain_q, plain_k = q.clone().requires_grad_(), k.clone().requires_grad_()
    s, t = 20.0 * plain_q @ plain_k.T, 30.0 * tq @ tk.T
    (
        (
            -(t.softmax(1) * s.float().log_softmax(1)).sum(1).mean()
            - (t.T.softmax(1) * s.float().T.log_softmax(1)).sum(1).mean()
        )
        / 2
    ).backward()
    for name, g, plain, w in (("dq", got[1], plain_q.grad, want[1]), ("dk", got[2], plain_k.grad, want[2])):
        ours, theirs = normwise(g.cpu(), w), normwise(plain, w)
        assert ours <= theirs, f"{name}: infcl {ours:.2e}, open_clip's formula in bfloat16 {theirs:.2e}"


def test_teacher_gets_no_gradient_and_nan_propagates(backend):
    q, k, tq, tk = _on_device(*_features(8, 8, 4, 3, torch.float32, 5))
    tq = tq.clone().requires_grad_()
    loss = cal_distill_loss(q.requires_grad_(), k, tq, tk, 10.0, 10.0, backend=backend)
    loss.backward()
    assert tq.grad is None or not bool(tq.grad.any())
    k = k.clone()
    k[2, 1] = float("nan")
    assert torch.isnan(cal_distill_loss(q, k, tq.detach(), tk, 10.0, 10.0, backend=backend))


def test_drop_in_takes_the_backend(backend):
    """InfDistillClipLoss runs both terms on its backend: the same losses as on the torch tiles."""
    q, k, tq, tk = _on_device(*_features(40, 40, 8, 6, torch.float32, 6))
    scale, teacher_scale = torch.tensor(20.0, device=DEVICE), torch.tensor(30.0, device=DEVICE)
    ours = InfDistillClipLoss(backend=backend)(q, k, scale, tq, tk, teacher_scale, output_dict=True)
    theirs = InfDistillClipLoss(backend="torch")(q, k, scale, tq, tk, teacher_scale, output_dict=True)
    for key in ("contrastive_loss", "distill_loss"):
        assert_close_verbose(ours[key].cpu(), theirs[key].cpu(), *TOLERANCE[torch.float32], key)


def test_reference_is_not_a_backend_of_the_distillation_loss():
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        features = (torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 2), torch.randn(4, 2))
        cal_distill_loss(*features, backend="reference")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_triton_on_a_gpu_at_size(dtype):
    """The Triton kernels on a GPU with their own tiles, 3000 rows and D = 200 (several chunks and slices)."""
    q, k, tq, tk = _features(3000, 3000, 200, 96, dtype, 12)
    got = _run(*_on_device(q, k, tq, tk), 30.0, 50.0, backend="triton")
    want = truth(q, k, tq, tk, 30.0, 50.0, upstream=torch.full((3000,), 1 / 3000, dtype=torch.float64))
    assert abs(float(got[0]) - float(want[0].mean())) <= NORMWISE[dtype] * float(want[0].mean())
    _check(got[1:], want[1:], dtype)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the native kernel is not built here")
def test_native_ops_pass_opcheck():
    """The native ops' schemas (dq, dk mutated in place) and fake impls agree with what they do."""
    q, k, tq, tk = _features(12, 12, 5, 3, torch.float32, 7)
    rows, cols = torch.ops.infcl.distill_forward_block(q, k, 3.0, tq, tk, 4.0, True)
    torch.library.opcheck(torch.ops.infcl.distill_forward_block.default, (q, k, 3.0, tq, tk, 4.0, True))
    g = torch.full((12,), 1 / 12)  # the block's own stats (m, r, mT, rT) stand in for the global ones
    args = (q, k, 3.0, tq, tk, 4.0, rows[:4], g, cols[:4], g, torch.zeros(12, 5), torch.zeros(12, 5))
    torch.library.opcheck(torch.ops.infcl.distill_backward_block.default, args)
