"""The truths that decide a tie or an order give the same bits wherever a column sits, on any CPU.

tests/helpers/exact_scores.py computes every such truth's scores exactly rounded and checks each call with its
guard (the same sums with the feature axis reversed, rotated by one, and with rows and columns permuted). Here:
the scores are the exactly rounded ones (against rational arithmetic), the guard rejects any summation in a
fixed float64 order (a BLAS product, numpy's pairwise sum) on data where such an order cannot tie with itself,
and every truth of the suite takes its scores through the guard.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from helpers import exact_scores as exact
from helpers import mining_truth, support, topk_truth, truth

EPS = 2.0**-53  # half an ulp of 1


def _rational_scores(a, b) -> torch.Tensor:
    """Each entry's sum of products in rational arithmetic, rounded once (Fraction -> float rounds to nearest)."""
    rows, cols = a.double().tolist(), b.double().tolist()
    return torch.tensor(
        [[float(sum((Fraction(x) * Fraction(y) for x, y in zip(r, c)), Fraction(0))) for c in cols] for r in rows],
        dtype=torch.float64,
    )


def _cases():
    gen = torch.Generator().manual_seed(0)
    wide_a = torch.randn(6, 40, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(
        -60, 60, (6, 40), generator=gen
    )
    wide_b = torch.randn(8, 40, generator=gen, dtype=torch.float64) * 2.0 ** torch.randint(
        -60, 60, (8, 40), generator=gen
    )
    wide_b[0], wide_b[1] = wide_a[0], -wide_a[0].flip(0)  # a . b that cancels to nothing, or to a few low bits
    spread = torch.randn(5, 24, generator=gen) * 2.0 ** torch.randint(-100, 100, (5, 24), generator=gen).float()
    half = torch.tensor([[1.0, EPS, 2.0**-80], [1.0, EPS, -(2.0**-80)], [1.0 + 2 * EPS, EPS, 0.0], [1.0, EPS, 0.0]])
    return {
        "float32": (torch.randn(7, 33, generator=gen), torch.randn(9, 33, generator=gen)),
        "bfloat16": (torch.randn(5, 64, generator=gen).bfloat16(), torch.randn(6, 64, generator=gen).bfloat16()),
        "float16": (torch.randn(5, 16, generator=gen).half(), torch.randn(6, 16, generator=gen).half()),
        "float64": (torch.randn(7, 33, generator=gen, dtype=torch.float64), torch.randn(9, 33, generator=gen).double()),
        "float64 wide exponents, cancelling": (wide_a, wide_b),
        "float32 wide exponents, cancelling": (spread, torch.cat((spread, -spread.flip(1)))),
        "halfway cases": (half.double(), torch.ones(2, 3, dtype=torch.float64)),
        "one feature": (
            torch.randn(4, 1, generator=gen, dtype=torch.float64),
            torch.randn(3, 1, generator=gen).double(),
        ),
        "600 features": (torch.randn(3, 600, generator=gen), torch.randn(4, 600, generator=gen)),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_exact_scores_are_exactly_rounded(case):
    a, b = _cases()[case]
    got = exact.exact_scores(a, b)
    want = _rational_scores(a, b)
    assert got.dtype == torch.float64 and got.shape == (a.shape[0], b.shape[0])
    assert torch.equal(got.view(torch.int64), want.view(torch.int64)), (got - want).abs().max()


def test_rounded_sum_is_fsum():
    """The vectorized final rounding of a few exact parts is math.fsum's, half-way cases included."""
    rng = np.random.default_rng(1)
    for trial in range(40):
        count = int(rng.integers(1, 7))
        mantissas = rng.integers(-(2**20), 2**20, size=(count, 500)).astype(np.float64)
        exponents = rng.integers(-80, 5, size=(count, 500))
        if trial % 2:  # half an ulp and less, above and below: the round-half-to-even corners
            mantissas = rng.choice([-1.0, 1.0, 0.5, -0.5, 0.0, 3.0], size=(count, 500))
            mantissas *= 1 + rng.choice([0.0, 2 * EPS, -EPS], size=(count, 500))
            exponents = rng.choice([0, -53, -54, -106, -1, 1], size=(count, 500))
        terms = list(np.ldexp(mantissas, exponents))
        got = exact._rounded_sum(terms)
        want = np.array([math.fsum(column) for column in np.stack(terms).T.tolist()])
        assert np.array_equal(got, want), trial


def test_not_numbers_as_ieee_addition_gives_them():
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([[1.0, inf], [nan, 1.0], [inf, 1.0], [1.0, 2.0]])
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0], [0.0, 1.0], [-inf, 1.0]])
    got = exact.exact_scores(a, b)
    want = a.double() @ b.double().T  # one or two products per entry: no order to differ in
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="feature dimension"):
        exact.exact_scores(torch.randn(2, 3), torch.randn(2, 4))
    with pytest.raises(ValueError, match="2-d"):
        exact.exact_scores(torch.randn(3), torch.randn(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        exact.exact_scores(torch.ones(2, 3, dtype=torch.int64), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"2\^-400, 2\^400"):
        exact.exact_scores(torch.tensor([[1e-300]], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64))


# --- the guard -------------------------------------------------------------------------------------------------


def one_and_two_halves(n=5, m=7):
    """[n, 3], [m, 3] whose entry (i, j) sums the products (1, eps, eps) * 2^(i - j), eps half an ulp of 1:
    exactly 1 + 2 eps when the two small products meet first, 1 when either meets the large one first (a tie,
    to even). Any float64 summation of three numbers adds two of them first, in an order fixed by their
    positions, not their values: the original, reversed (large one last) and rotated (large one in the middle)
    orders put the large product at all three positions, so at most one of them meets first the pair the
    order pairs first, and the guard sees different bits at every entry."""
    rows = torch.tensor([1.0, 2.0**-27, 2.0**-26]) * 2.0 ** torch.arange(n, dtype=torch.float32)[:, None]
    cols = torch.tensor([1.0, 2.0**-26, 2.0**-27]) * 2.0 ** -torch.arange(m, dtype=torch.float32)[:, None]
    return rows, cols


def blas_product(a, b):
    """The old truth: a float64 GEMM."""
    return torch.as_tensor(a).double() @ torch.as_tensor(b).double().T


def numpy_pairwise(a, b):
    """The old mining truth: numpy's (pairwise) sum of the exact float64 products."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return torch.from_numpy((a[:, None, :] * b[None, :, :]).sum(-1))


def left_to_right(a, b):
    """A dot product in the order a textbook writes it."""
    rows, cols = torch.as_tensor(a).double().tolist(), torch.as_tensor(b).double().tolist()
    return torch.tensor([[sum(x * y for x, y in zip(r, c)) for c in cols] for r in rows], dtype=torch.float64)


@pytest.mark.parametrize("scores", (blas_product, numpy_pairwise, left_to_right), ids=lambda f: f.__name__)
def test_guard_rejects_every_fixed_order_sum(scores):
    a, b = one_and_two_halves()
    with pytest.raises(AssertionError, match="depend on the summation order"):
        exact.assert_order_free(scores, a, b)
    variants = exact.order_variants(scores, a, b)
    orders = torch.stack([scores(a, b), variants["feature axis reversed"], variants["feature axis rotated by one"]])
    assert bool((orders != orders[:1]).any(dim=0).all()), "every entry: one of the three orders must round apart"


def test_guard_passes_the_exact_scores():
    a, b = one_and_two_halves()
    got = exact.truth_scores(a, b)  # raises if any order moved a bit
    assert torch.equal(got, 2.0 ** (torch.arange(5.0)[:, None] - torch.arange(7.0)).double() * (1 + 2 * EPS))
    gen = torch.Generator().manual_seed(3)
    for a, b in ((torch.randn(70, 19, generator=gen), torch.randn(33, 19, generator=gen)), _cases()["float64"]):
        assert all(count == 0 for count in exact.order_differences(exact.exact_scores, a, b).values())


# --- every truth takes its scores through the guard ------------------------------------------------------------


def _features(n, d=2, seed=0):
    return torch.nn.functional.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=1)


def _mining_truth(a, b):
    table = {f"q{i}": row for i, row in enumerate(a.numpy())} | {f"d{j}": row for j, row in enumerate(b.numpy())}
    embed = lambda texts: np.stack([table[t] for t in texts])  # noqa: E731
    queries, answers = ["q0", "q1"], ["d0", "d1"]
    return mining_truth.truth_negatives(
        queries, answers, [f"d{j}" for j in range(len(b))], embed, embed, num_negatives=2
    )


def _test_module(name):
    """A test module's truth (imported here: its own tests run in their file)."""
    return __import__(name)


TRUTHS = {
    "topk_truth": lambda a, b: topk_truth.topk_truth(a, b, 3),
    "test_retrieval.truth": lambda a, b: _test_module("test_retrieval").truth(a, b[: len(a)]),
    "truth.truth_directions (guide)": lambda a, b: truth.truth_directions(
        _features(len(a)), _features(len(a), seed=1), None, 1.0, guide=(a, b[: len(a)])
    ),
    "support.masked_truth_directions (guide)": lambda a, b: support.masked_truth_directions(
        _features(len(a)), _features(len(a), seed=1), None, 1.0, guide=(a, b[: len(a)])
    ),
    "mining_truth.truth_negatives": _mining_truth,
    "test_masks._masked_in_dtype (guide)": lambda a, b: _test_module("test_masks")._masked_in_dtype(
        _features(len(a)), _features(len(a), seed=1), torch.arange(len(a)), torch.tensor(1.0), guide=(a, b[: len(a)])
    ),
    "test_masks._masked_stats_truth": lambda a, b: _test_module("test_masks")._masked_stats_truth(
        a,
        b[: len(a)],
        torch.arange(len(a)),
        1.0,
        torch.arange(len(a)),
        torch.arange(len(a)),
        None,
        (a, b[: len(a)]),
        0.0,
    ),
}


@pytest.mark.parametrize("name", list(TRUTHS))
def test_every_truth_takes_its_scores_through_the_guard(name, monkeypatch):
    """Each truth runs on the guard's data; with the exact scores swapped for a BLAS product, its own call
    of the guard rejects them."""
    a, b = one_and_two_halves()
    TRUTHS[name](a, b)
    monkeypatch.setattr(exact, "exact_scores", blas_product)
    with pytest.raises(AssertionError, match="depend on the summation order"):
        TRUTHS[name](a, b)


def test_the_guard_rows_are_the_first_ones():
    """Past GUARD_ROWS rows the guard recomputes the first ones in place: a large truth costs about one call."""
    a, b = torch.randn(exact.GUARD_ROWS + 9, 5), torch.randn(11, 5)
    calls = []

    def counted(x, y):
        calls.append(x.shape[0])
        return exact.exact_scores(x, y)

    exact.assert_order_free(counted, a, b)
    assert calls == [a.shape[0]] + [exact.GUARD_ROWS] * 3
