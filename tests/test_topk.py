"""infcl.topk_scores on every backend against a float64 stable-sort truth built without infcl
(tests/helpers/topk_truth.py): exact ties (quarter features, duplicate columns), ids, exclude_labels,
n beyond the eligible columns, largest=False, NaN, strided views, thread counts, tile sizes and bad input.
The ring is tests/test_topk_ring.py."""

import pytest
import torch

from helpers.topk_truth import quarter_features, separated_rows, topk_truth
from infcl import TopK, topk_scores
from infcl.backends import unavailable_reason
from infcl.backends.torch_tiles import TorchTilesBackend

CPU = torch.device("cpu")
# torch tiles at their default size (one tile at these shapes) and cut small and ragged; the native kernel;
# the Triton kernel (under the interpreter without a GPU: marked interpreter and slow by conftest.py).
BACKENDS = ["torch", "torch-7x13"] + [name for name in ("cpu", "triton") if unavailable_reason(name, CPU) is None]
# The odd shape of the brief: no side a multiple of any tile.
BQ, BK, DIM = 41, 401, 37
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@pytest.fixture(params=BACKENDS)
def backend(request):
    name = request.param
    if name == "torch-7x13":
        name = TorchTilesBackend(7, 13)  # the torch tiles at these sizes, passed by the call
    return name


def _exact_case(dtype, seed=0, bq=BQ, bk=BK, dim=DIM):
    """Quarter features (exact scores, ties everywhere) with exact duplicate columns, some far apart."""
    q = quarter_features(bq, dim, seed, dtype)
    k = quarter_features(bk, dim, seed + 1, dtype)
    k[3] = k[bk - 2]
    k[bk // 3] = k[bk // 10]
    k[bk // 2] = k[3]
    return q, k


def assert_topk(got: TopK, want, what: str = "", exact_scores: bool = True, atol: float = 0.0):
    want_scores, want_index = want
    assert isinstance(got, TopK)
    assert got.indices.dtype == torch.int64 and got.indices.shape == want_index.shape, what
    bad = got.indices.cpu() != want_index
    assert not bool(bad.any()), (
        f"{what}: rows {bad.any(dim=1).nonzero().flatten()[:6].tolist()}: got "
        f"{got.indices.cpu()[bad.any(dim=1)][:2].tolist()} want {want_index[bad.any(dim=1)][:2].tolist()}"
    )
    scores = got.scores.cpu().to(torch.float64)
    assert torch.equal(scores.isnan(), want_scores.isnan()), what
    if exact_scores:
        assert torch.equal(scores.nan_to_num(0.0), want_scores.nan_to_num(0.0)), what
    else:
        torch.testing.assert_close(scores, want_scores, atol=atol, rtol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("largest", (True, False), ids=("largest", "smallest"))
@pytest.mark.parametrize("n", (1, 10))
def test_exact_ties_match_the_truth(backend, dtype, largest, n):
    q, k = _exact_case(dtype)
    got = topk_scores(q, k, n, largest=largest, backend=backend)
    assert got.scores.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = topk_truth(q, k, n, largest=largest)
    assert_topk(got, want, f"{backend} {dtype}")
    # the case holds ties inside the returned lists, and duplicates of a returned column
    assert int((want[0][:, 1:] == want[0][:, :-1]).sum()) > (BQ // 2 if n > 1 else -1)


def test_random_float64_matches_the_truth(backend):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(BQ, DIM, generator=gen, dtype=torch.float64)
    k = torch.randn(BK, DIM, generator=gen, dtype=torch.float64)
    got = topk_scores(q, k, 12, backend=backend)
    assert_topk(got, topk_truth(q, k, 12), backend, exact_scores=False, atol=1e-12)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_random_low_precision_matches_where_separated(backend, dtype):
    """Random features: scores within float32 round-off of the truth, and the truth's order wherever the
    row's n + 1 best differ by more than that round-off."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(BQ, DIM, generator=gen).to(dtype)
    k = torch.randn(BK, DIM, generator=gen).to(dtype)
    n = 8
    got = topk_scores(q, k, n, backend=backend)
    want_scores, want_index = topk_truth(q, k, n + 1)
    torch.testing.assert_close(got.scores.double(), want_scores[:, :n], atol=1e-4, rtol=0)
    rows = separated_rows(want_scores, 1e-4)
    assert int(rows.sum()) > BQ // 2
    assert torch.equal(got.indices[rows], want_index[rows, :n])


@pytest.mark.parametrize("tiles", ((None, None), (4, 4), (3, 5), (7, 10)), ids=lambda t: f"{t[0]}x{t[1]}")
def test_rounded_duplicates_tie_across_ragged_tiles(tiles):
    """Random unit features (rounded float32 scores) with columns repeated in other tiles, ragged ones
    included: a copy's score equals its original's whatever the tile's shape (a BLAS may sum a ragged
    tile's dot products in another order), so the lower index comes first, as in the float64 truth."""
    gen = torch.Generator().manual_seed(8)
    bq, bk = 22, 21  # every block ends in a ragged tile of one column (MKL's sgemm sums that one otherwise)
    q = torch.nn.functional.normalize(torch.randn(bq, 32, generator=gen), dim=1)
    k = torch.nn.functional.normalize(torch.randn(bk, 32, generator=gen), dim=1)
    for original, copy in ((4, 20), (0, 18), (19, 10), (2, 11)):
        k[copy] = k[original]
    got = topk_scores(q, k, bk, backend=TorchTilesBackend(*tiles))
    want_scores, want_index = topk_truth(q, k, bk)
    torch.testing.assert_close(got.scores.double(), want_scores, atol=1e-6, rtol=0)
    gaps = want_scores[:, :-1] - want_scores[:, 1:]
    rows = ((gaps == 0) | (gaps > 1e-5)).all(dim=1)  # exact ties and clear gaps only
    assert int(rows.sum()) > bq // 2 and int((gaps == 0).sum()) == 4 * bq
    assert torch.equal(got.indices[rows], want_index[rows])


@pytest.mark.parametrize("largest", (True, False), ids=("largest", "smallest"))
def test_ids_and_labels_leave_columns_out(backend, largest):
    q, k = _exact_case(torch.float32, seed=2)
    gen = torch.Generator().manual_seed(7)
    q_ids = torch.randint(0, 30, (BQ,), generator=gen)
    k_ids = torch.randint(0, 40, (BK,), generator=gen)
    labels = torch.randint(-1, BK, (BQ,), generator=gen)
    labels[:3] = torch.tensor([3, BK - 2, 17])  # duplicated columns: only the labelled copy goes
    for kwargs in (
        dict(q_ids=q_ids, k_ids=k_ids),
        dict(labels=labels, exclude_labels=True),
        dict(q_ids=q_ids, k_ids=k_ids, labels=labels, exclude_labels=True),
    ):
        got = topk_scores(q, k, 9, largest=largest, backend=backend, **kwargs)
        want = topk_truth(q, k, 9, kwargs.get("labels"), kwargs.get("q_ids"), kwargs.get("k_ids"), largest)
        assert_topk(got, want, f"{backend} {sorted(kwargs)}")


@pytest.mark.parametrize("largest", (True, False), ids=("largest", "smallest"))
def test_n_beyond_the_eligible_columns(backend, largest):
    """n > Bk, and rows whose ids leave out most columns: the empty slots are (-inf / +inf, -1)."""
    q, k = _exact_case(torch.float32, seed=3, bq=9, bk=23, dim=5)
    q_ids = torch.arange(9) % 3
    k_ids = torch.arange(23) % 4  # rows with id 0..2 keep the columns of the other ids
    labels = torch.tensor([0, 5, -1, 22, 1, 1, 7, -1, 3])
    got = topk_scores(q, k, 30, largest=largest, backend=backend)
    assert_topk(got, topk_truth(q, k, 30, largest=largest), f"{backend} n > Bk")
    assert bool((got.indices[:, 23:] == -1).all())
    got = topk_scores(
        q, k, 20, q_ids=q_ids, k_ids=k_ids, labels=labels, exclude_labels=True, largest=largest, backend=backend
    )
    want = topk_truth(q, k, 20, labels, q_ids, k_ids, largest)
    assert_topk(got, want, f"{backend} ids")
    assert bool((want[1] == -1).any(dim=1).all())


def test_infinite_scores_order_as_numbers(backend):
    """An infinite score is a score: +inf first, -inf before the empty slots (lower index first)."""
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    k = torch.tensor([[float("inf"), 0.0], [1.0, 0.0], [float("-inf"), 0.0], [2.0, 0.0], [float("-inf"), 0.0]])
    k[:, 1] = 0.5
    got = topk_scores(q, k, 7, backend=backend)
    assert_topk(got, topk_truth(q, k, 7), backend)
    assert got.indices[0].tolist() == [0, 3, 1, 2, 4, -1, -1]


def test_nan_row_is_nan(backend):
    """Rule: a row with a NaN among its eligible scores returns NaN scores and index -1 in every slot; a NaN
    in a column the row leaves out does not count."""
    q, k = _exact_case(torch.float32, seed=4)
    q[3, 5] = float("nan")
    k[7, 0] = float("nan")  # every row's score with column 7 is NaN ...
    q_ids = torch.full((BQ,), 1)
    q_ids[10:20] = 2
    k_ids = torch.zeros(BK, dtype=torch.int64)
    k_ids[7] = 2  # ... but rows 10..19 leave column 7 out
    got = topk_scores(q, k, 5, q_ids=q_ids, k_ids=k_ids, backend=backend)
    want = topk_truth(q, k, 5, q_ids=q_ids, k_ids=k_ids)
    assert_topk(got, want, backend)
    nan_rows = got.scores.isnan().all(dim=1)
    assert nan_rows.tolist() == [i not in range(10, 20) for i in range(BQ)]
    assert bool((got.indices[nan_rows] == -1).all()) and bool((got.indices[~nan_rows] >= 0).all())


def test_strided_views(backend):
    """Non-contiguous q, k, ids and labels (views of bigger tensors) give the contiguous inputs' result."""
    base_q = quarter_features(2 * BQ, DIM + 3, 8, torch.float32)
    base_k = quarter_features(DIM, 2 * BK, 9, torch.float32)
    q = base_q[::2, 3:]  # row stride 2 (DIM + 3), offset
    k = base_k.T[1::2]  # column-major
    meta = torch.randint(0, 9, (BQ + BK, 3), generator=torch.Generator().manual_seed(1))
    q_ids, k_ids = meta[:BQ, 1], meta[BQ:, 2]
    labels = torch.arange(BQ).expand(2, BQ)[1] * 3
    kwargs = dict(q_ids=q_ids, k_ids=k_ids, labels=labels, exclude_labels=True)
    got = topk_scores(q, k, 6, backend=backend, **kwargs)
    assert_topk(got, topk_truth(q, k, 6, labels, q_ids, k_ids), backend)
    contiguous = topk_scores(
        q.contiguous(),
        k.contiguous(),
        6,
        backend=backend,
        q_ids=q_ids.clone(),
        k_ids=k_ids.clone(),
        labels=labels.clone(),
        exclude_labels=True,
    )
    assert torch.equal(got.indices, contiguous.indices) and torch.equal(got.scores, contiguous.scores)


def test_every_backend_and_thread_count_agree():
    """The same scores and indices from every backend, tile size and thread count (exact-score data)."""
    q, k = _exact_case(torch.bfloat16, seed=10, bq=300, bk=700, dim=19)
    want = topk_scores(q, k, 25, backend="torch")
    threads = torch.get_num_threads()
    try:
        for name in [b for b in BACKENDS if b not in ("torch-7x13", "triton")]:
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                got = topk_scores(q, k, 25, backend=name)
                assert torch.equal(got.indices, want.indices) and torch.equal(got.scores, want.scores), (name, count)
    finally:
        torch.set_num_threads(threads)
    assert_topk(want, topk_truth(q, k, 25), "torch")


def test_reference_and_chunked_are_not_backends_of_the_search():
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        topk_scores(torch.randn(4, 3), torch.randn(5, 3), 2, backend="reference")
    with pytest.raises(ValueError, match="topk_scores has no backend='chunked'"):
        topk_scores(torch.randn(4, 3), torch.randn(5, 3), 2, backend="chunked")


def test_auto_follows_the_ranks_rule(monkeypatch):
    """The resolver's "topk" row: the native kernel on CPU, the torch tiles on CUDA (the Triton kernel has not run
    on a GPU) unless named; INFCL_BACKEND=reference runs the torch tiles, which materialize nothing either, and
    INFCL_BACKEND=chunked the search's own "auto" choice."""
    from infcl.backends import resolve

    monkeypatch.setattr(resolve, "unavailable_reason", lambda name, device: None)
    monkeypatch.delenv("INFCL_BACKEND", raising=False)
    assert resolve.resolve_backend("auto", torch.device("cpu"), "topk") == "cpu"
    assert resolve.resolve_backend("auto", torch.device("cuda"), "topk") == "torch"
    assert resolve.resolve_backend("triton", torch.device("cuda"), "topk") == "triton"
    monkeypatch.setenv("INFCL_BACKEND", "reference")
    assert resolve.resolve_backend("auto", torch.device("cpu"), "topk") == "torch"
    monkeypatch.setenv("INFCL_BACKEND", "chunked")  # the softmax loss's route: the search runs its own "auto"
    assert resolve.resolve_backend("auto", torch.device("cuda"), "topk") == "torch"


@pytest.mark.parametrize(
    "case, error, match",
    (
        (dict(q=torch.randn(4)), ValueError, r"q must be 2-d"),
        (dict(k=torch.randn(5, 4)), ValueError, r"same feature dimension: q \[4, 3\], k \[5, 4\]"),
        (dict(k=torch.randn(5, 3, dtype=torch.float64)), TypeError, "same dtype"),
        (dict(q=torch.arange(12).view(4, 3)), TypeError, "q must be a floating-point tensor"),
        (dict(n=0), ValueError, "n must be >= 1, got 0"),
        (dict(n=2.0), TypeError, "n must be an int, got float"),
        (dict(n=True), TypeError, "n must be an int, got bool"),
        (dict(largest=1), TypeError, "largest must be a bool"),
        (dict(exclude_labels=True), ValueError, "exclude_labels=True needs labels"),
        (dict(labels=torch.zeros(4, dtype=torch.int64)), ValueError, "only read with exclude_labels=True"),
        (dict(labels=torch.zeros(3, dtype=torch.int64), exclude_labels=True), ValueError, r"labels must have shape"),
        (dict(labels=torch.zeros(4), exclude_labels=True), TypeError, "labels must be an integer tensor"),
        (dict(labels=torch.tensor([0, 1, 5, 0]), exclude_labels=True), ValueError, r"in \[0, 5\) or -1"),
        (dict(labels=torch.tensor([0, 1, -2, 0]), exclude_labels=True), ValueError, r"got values in \[-2, 1\]"),
        (dict(q_ids=torch.zeros(4, dtype=torch.int64)), ValueError, "q_ids was given without k_ids"),
        (dict(q_ids=torch.zeros(4, dtype=torch.int64), k_ids=torch.zeros(4, dtype=torch.int64)), ValueError, "k_ids"),
        (dict(backend="gpu"), ValueError, "backend must be one of"),
    ),
)
def test_bad_input_names_the_argument(case, error, match):
    args = dict(q=torch.randn(4, 3), k=torch.randn(5, 3), n=2)
    args.update(case)
    with pytest.raises(error, match=match):
        topk_scores(args.pop("q"), args.pop("k"), args.pop("n"), **args)


def test_triton_beyond_its_widest_list_runs_the_torch_tiles():
    """n above the kernel's list width (infcl.kernels.topk.max_top): the triton backend runs the torch tiles."""
    if "triton" not in BACKENDS:
        pytest.skip("the Triton backend does not run here")
    from infcl.kernels.topk import max_top

    q, k = _exact_case(torch.float32, seed=11, bq=9, bk=90, dim=6)
    n = max_top(torch.float32) + 1
    got = topk_scores(q, k, n, backend="triton")
    assert_topk(got, topk_truth(q, k, n), "triton n > max_top")
