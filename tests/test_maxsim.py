"""cal_maxsim_loss on the torch tiles and the Triton kernels (under TRITON_INTERPRET=1 here: the tests with a
"triton" parameter are marked interpreter and slow) against the float64 MaxSim truth (tests/helpers/maxsim_truth.py):
every dtype, odd shapes in ragged tiles, masks, MeanMaxSim, labels with extra documents, false negatives, the
scale's gradient, strides, the lowest-index rule for ties, the edge rules and the input errors."""

import pytest
import torch

from helpers.maxsim_truth import maxsim_loss, maxsim_scores
from infcl import cal_maxsim_loss
from infcl.backends.torch_tiles import TorchTilesBackend

# (dtype, tolerance relative to the largest truth value): float32 round-off; the half types' tokens are rounded
# before the truth sees them, so what is left is float32 accumulation plus the gradients' own rounding.
DTYPES = (
    (torch.float64, 1e-10),
    (torch.float32, 2e-5),
    (torch.bfloat16, 1e-2),
    (torch.float16, 2e-3),
)
# (Bq, Bk, Lq, Lk, D): odd sizes, none a multiple of the small tiles below; Bk > Bq takes labels.
SHAPES = ((7, 7, 5, 11, 13), (3, 10, 1, 4, 1), (9, 9, 6, 3, 33))
SMALL_TILES = (8, 24)  # (query tokens, document tokens) per tile: several ragged tiles per block


@pytest.fixture(params=("torch", "triton"))
def small_tiles(request):
    """The backend the tests pass (``backend=small_tiles``): the torch tiles with SMALL_TILES token tiles, and the
    Triton kernels (the interpreter's tiles: 32 query-token rows x 16 document tokens, several ragged chunks)."""
    if request.param == "triton":
        return "triton"
    return TorchTilesBackend(token_tiles=SMALL_TILES)


def _inputs(bq, bk, lq, lk, d, dtype, seed=0, masks=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bq, lq, d, generator=gen, dtype=torch.float64).to(dtype)
    docs = torch.randn(bk, lk, d, generator=gen, dtype=torch.float64).to(dtype)
    q_mask = docs_mask = None
    if masks:
        q_mask = torch.rand(bq, lq, generator=gen) > 0.3
        q_mask[:, 0] = True
        docs_mask = torch.rand(bk, lk, generator=gen) > 0.3
        docs_mask[:, -1] = True
    labels = None if bq == bk else torch.randint(0, bk, (bq,), generator=gen)
    return q, docs, q_mask, docs_mask, labels


def _close(ours, truth, tol, what):
    ours, truth = ours.double(), truth.double()
    bound = tol * max(1.0, truth.abs().max().item())
    err = (ours - truth).abs()
    worst = err.argmax().item() if err.numel() else 0
    assert err.max().item() <= bound, f"{what}: max error {err.max().item():.3g} > {bound:.3g} at flat index {worst}"


def _run(q, docs, labels=None, scale=1.0, reduction="mean", upstream=None, backend="auto", **kwargs):
    """(loss, grads of q, docs and the scale) of infcl (by ``backend``) and of the truth, with ``upstream`` the
    gradient of a "none" loss."""
    results = []
    for fn in (cal_maxsim_loss, maxsim_loss):
        qq = q.detach().clone().requires_grad_()
        dd = docs.detach().clone().requires_grad_()
        ss = torch.tensor(float(scale), dtype=torch.float64, requires_grad=True)
        if fn is maxsim_loss:
            loss = fn(qq.double(), dd.double(), labels, ss, reduction=reduction, **kwargs)
        else:
            loss = fn(qq, dd, labels, ss, reduction=reduction, backend=backend, **kwargs)
        weights = torch.ones_like(loss) if upstream is None else upstream.to(loss.dtype)
        (loss * weights).sum().backward()
        results.append((loss.detach(), qq.grad, dd.grad, ss.grad))
    return results


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("length_normalize", (False, True))
def test_matches_float64_truth(small_tiles, dtype, tol, shape, length_normalize):
    if small_tiles == "triton" and not length_normalize:
        pytest.skip("the kernels' path with length_normalize=True (the weights are formed on the host), interpreted")
    q, docs, q_mask, docs_mask, labels = _inputs(*shape, dtype)
    ours, truth = _run(
        q, docs, labels, 1.7, q_mask=q_mask, docs_mask=docs_mask, length_normalize=length_normalize, backend=small_tiles
    )
    assert ours[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert ours[1].dtype == dtype and ours[2].dtype == dtype
    for name, a, b in zip(("loss", "dq", "docs grad", "dscale"), ours, truth):
        _close(a, b, tol, f"{dtype} {name}")


@pytest.mark.parametrize("scale", (0.05, 30.0))
def test_upstream_grads_ids_and_confident_rows(small_tiles, scale):
    """reduction="none" with negative, zero and large upstream gradients; ids leave false negatives out; a large
    scale makes confident rows (huge logits)."""
    q, docs, q_mask, docs_mask, labels = _inputs(8, 12, 4, 6, 16, torch.float32, seed=3)
    labels = torch.arange(8) + 2
    q_ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    k_ids = torch.tensor([9, 0, 0, 1, 2, 2, 4, 5, 6, 7, 7, 3])  # several false negatives, positives kept
    upstream = torch.tensor([1.0, -2.0, 0.0, 3.5, 1e3, -0.5, 2.0, 0.25])
    ours, truth = _run(
        q,
        docs,
        labels,
        scale,
        "none",
        upstream,
        small_tiles,
        q_mask=q_mask,
        docs_mask=docs_mask,
        q_ids=q_ids,
        k_ids=k_ids,
    )
    for name, a, b in zip(("loss", "dq", "docs grad", "dscale"), ours, truth):
        _close(a, b, 2e-5, name)


def test_sum_reduction_strides_and_tensor_scale(small_tiles):
    """Non-contiguous token tensors (a transposed and a strided view) and a [1]-shaped scale parameter."""
    q_base = torch.randn(6, 16, 5, dtype=torch.float64)
    d_base = torch.randn(6, 20, 9, dtype=torch.float64)
    q = q_base.transpose(1, 2)[:, :, ::2].float()  # [6, 5, 8], strided
    docs = d_base[:, ::2].float().transpose(1, 2).contiguous().transpose(1, 2)  # [6, 10, 9] column-major tokens
    docs = docs[..., :8]
    assert not q.is_contiguous() and not docs.is_contiguous()
    scale = torch.tensor([2.5], requires_grad=True)
    loss = cal_maxsim_loss(q.requires_grad_(), docs.requires_grad_(), scale=scale, reduction="sum", backend=small_tiles)
    loss.backward()
    qq = q.detach().double().requires_grad_()
    dd = docs.detach().double().requires_grad_()
    ss = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    truth = maxsim_loss(qq, dd, None, ss, reduction="sum")
    truth.backward()
    assert scale.grad.shape == (1,)
    for name, a, b in (("loss", loss, truth), ("dq", q.grad, qq.grad), ("dd", docs.grad, dd.grad)):
        _close(a.detach(), b.detach(), 2e-5, name)
    _close(scale.grad[0], ss.grad, 2e-5, "dscale")


def test_ties_go_to_the_lowest_index(small_tiles):
    """Exact copies of a document token (small integers: every product exact): the lowest copy gets the whole
    gradient, the others none, wherever the copies sit in the tiles."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-3, 4, (5, 3, 4), generator=gen).float()
    docs = torch.randint(-3, 4, (5, 9, 4), generator=gen).float()
    docs[:, 6] = docs[:, 1]  # a copy of token 1 in each document
    docs[:, 8] = docs[:, 1]
    docs[2, 4] = docs[2, 0]
    q.requires_grad_()
    docs.requires_grad_()
    loss = cal_maxsim_loss(q, docs, scale=0.25, backend=small_tiles)
    loss.backward()
    dd = docs.detach().double().requires_grad_()
    qq = q.detach().double().requires_grad_()
    maxsim_loss(qq, dd, None, 0.25).backward()
    assert torch.equal(docs.grad[:, 6], torch.zeros_like(docs.grad[:, 6]))
    assert torch.equal(docs.grad[:, 8], torch.zeros_like(docs.grad[:, 8]))
    _close(docs.grad, dd.grad, 2e-5, "dd")
    _close(q.grad, qq.grad, 2e-5, "dq")
    assert docs.grad[:, 1].abs().sum() > 0  # the copies' gradient went somewhere: to token 1


@pytest.mark.parametrize("tiles", (SMALL_TILES, (40, 63), None, "triton"))
def test_random_float_copies_route_to_the_first(tiles):
    """Exact copies of random float32 document tokens, at the ends of the token products and across tiles (the
    Triton kernels' 16-token document chunks: copies in the first, second and last chunk): each copy scores the
    same bits as its original, so only the lowest index gets a gradient."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(6, 5, 16, generator=gen)
    docs = torch.randn(7, 21, 16, generator=gen)
    docs[:, 2] *= 4.0  # a large token: it wins most maxima
    docs[:, 17] = docs[:, 2]
    docs[:, 20] = docs[:, 2]
    docs[:, 15] = docs[:, 0]
    q.requires_grad_()
    docs.requires_grad_()
    backend = tiles if tiles == "triton" else TorchTilesBackend(token_tiles=tiles)
    loss = cal_maxsim_loss(q, docs, torch.arange(6), scale=0.5, backend=backend)
    loss.backward()
    for copy in (17, 20, 15):
        assert torch.equal(docs.grad[:, copy], torch.zeros_like(docs.grad[:, copy])), copy
    assert (docs.grad[:, 2].abs().sum(dim=1) > 0).all()
    _close(loss.detach(), maxsim_loss(q.detach().double(), docs.detach().double(), torch.arange(6), 0.5), 2e-5, "loss")


def test_long_queries_wide_features_and_views(small_tiles):
    """Queries longer than one row block of the Triton kernels (Lq = 37 > 32 rows: two token chunks, whose scores the
    backward needs before routing; ragged feature chunks and gradient slices: D = 33 in test_matches_float64_truth),
    documents over two chunks, masks, ids, MeanMaxSim, non-unit upstream gradients, and views of the tokens (a
    transposed document tensor) and of the masks."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(3, 37, 40, generator=gen)[:, :, ::2]  # [3, 37, 20]
    docs = torch.randn(5, 20, 20, generator=gen).transpose(1, 2)  # [5, 20, 20], token stride 1
    q_mask = (torch.rand(37, 3, generator=gen) > 0.3).T  # a transposed view
    q_mask[:, 0] = True
    docs_mask = torch.rand(5, 20, generator=gen) > 0.3
    docs_mask[:, 19] = True
    labels = torch.tensor([4, 0, 2])
    q_ids, k_ids = torch.tensor([0, 1, 0]), torch.tensor([1, 1, 0, 2, 0])
    upstream = torch.tensor([1.5, -0.5, 2.0])
    ours, truth = _run(
        q,
        docs,
        labels,
        2.0,
        "none",
        upstream,
        small_tiles,
        q_mask=q_mask,
        docs_mask=docs_mask,
        length_normalize=True,
        q_ids=q_ids,
        k_ids=k_ids,
    )
    for name, a, b in zip(("loss", "dq", "docs grad", "dscale"), ours, truth):
        _close(a, b, 2e-5, name)


def test_empty_document_and_empty_query(small_tiles):
    """A document with no real token scores -inf (no negative; its own query's loss is inf, routing nothing); a
    query with no real token scores 0 against every document (loss log Bk, no gradient to its tokens)."""
    q, docs, q_mask, docs_mask, _ = _inputs(5, 5, 3, 4, 6, torch.float32, seed=7)
    docs_mask[3] = False
    q_mask[1] = False
    ours, truth = _run(q, docs, None, 1.3, "none", backend=small_tiles, q_mask=q_mask, docs_mask=docs_mask)
    loss = ours[0]
    assert torch.isinf(loss[3]) and loss[3] > 0
    assert torch.allclose(loss[1], torch.tensor(5.0).log(), rtol=1e-6)
    assert torch.equal(ours[1][1], torch.zeros_like(ours[1][1]))
    assert torch.equal(ours[2][3], torch.zeros_like(ours[2][3]))
    finite = torch.isfinite(truth[0])
    _close(loss[finite], truth[0][finite], 2e-5, "finite losses")
    upstream = torch.tensor([1.0, 0.5, -1.0, 0.0, 2.0])  # the inf row's upstream 0: its terms drop out
    ours, truth = _run(q, docs, None, 1.3, "none", upstream, small_tiles, q_mask=q_mask, docs_mask=docs_mask)
    for name, a, b in zip(("dq", "docs grad"), ours[1:3], truth[1:3]):
        _close(a, b, 2e-5, name)


def test_nan_in_a_real_token_and_in_a_masked_token(small_tiles):
    q, docs, q_mask, docs_mask, _ = _inputs(4, 4, 3, 5, 6, torch.float32, seed=11)
    docs_mask[2, 1] = False
    docs[2, 1, 0] = float("nan")  # in a masked token: never read
    q_mask[0, 2] = False
    q[0, 2, 3] = float("nan")
    ours, truth = _run(q, docs, None, 1.0, "mean", backend=small_tiles, q_mask=q_mask, docs_mask=docs_mask)
    assert torch.isfinite(ours[0]) and torch.isfinite(ours[1]).all() and torch.isfinite(ours[2]).all()
    _close(ours[0], truth[0], 2e-5, "loss")
    docs[1, 0, 0] = float("nan")  # in a real token: every query's score against it is NaN
    loss = cal_maxsim_loss(q, docs, q_mask=q_mask, docs_mask=docs_mask, reduction="none", backend=small_tiles)
    assert torch.isnan(loss).all()


def test_return_stats_and_defaults():
    q, docs, _, _, _ = _inputs(6, 6, 4, 5, 8, torch.float32, seed=2)
    docs[:, :2] = q[:, :2]  # the positives score high
    loss, stats = cal_maxsim_loss(q, docs, return_stats=True)
    scores = maxsim_scores(q, docs)
    assert stats.q2k_accuracy.item() == pytest.approx((scores.argmax(1) == torch.arange(6)).double().mean().item())
    assert stats.q2k_positive_logit.item() == pytest.approx(scores.diagonal().mean().item(), rel=1e-5)
    assert stats.k2q_accuracy is None
    _close(loss, maxsim_loss(q.double(), docs.double()), 2e-5, "loss")


@pytest.mark.parametrize(
    "call,error,match",
    (
        (lambda q, d: cal_maxsim_loss(q[0], d), ValueError, "q must be 3-d"),
        (lambda q, d: cal_maxsim_loss(q, d[..., :3]), ValueError, "same feature dimension"),
        (lambda q, d: cal_maxsim_loss(q, d.double()), TypeError, "same dtype"),
        (lambda q, d: cal_maxsim_loss(q.int(), d), TypeError, "q must be a floating"),
        (lambda q, d: cal_maxsim_loss(q, d, q_mask=torch.ones(4, 2)), ValueError, r"q_mask must have shape \[4, 3\]"),
        (lambda q, d: cal_maxsim_loss(q, d, docs_mask=[1]), TypeError, "docs_mask must be None or a tensor"),
        (lambda q, d: cal_maxsim_loss(q, d[:3]), ValueError, "labels=None means the diagonal"),
        (lambda q, d: cal_maxsim_loss(q, d, labels=torch.tensor([0, 1, 2, 9])), ValueError, "labels must be"),
        (lambda q, d: cal_maxsim_loss(q, d, q_ids=torch.arange(4)), ValueError, "q_ids was given without k_ids"),
        (lambda q, d: cal_maxsim_loss(q, d, length_normalize=1), TypeError, "length_normalize must be a bool"),
        (lambda q, d: cal_maxsim_loss(q, d, reduction="max"), ValueError, "reduction must be"),
        (
            lambda q, d: cal_maxsim_loss(q, d, backend="cpu"),
            ValueError,
            "no backend='cpu' yet; use 'auto', 'torch' or 'triton'",
        ),
        (lambda q, d: cal_maxsim_loss(q, d, backend="reference"), NotImplementedError, "no backend='reference'"),
        (lambda q, d: cal_maxsim_loss(q, d[:, :0]), ValueError, "docs has token dimension 0"),
    ),
)
def test_bad_input_names_the_argument(call, error, match):
    q, docs = torch.randn(4, 3, 5), torch.randn(4, 6, 5)
    with pytest.raises(error, match=match):
        call(q, docs)
