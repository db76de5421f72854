"""Exactly rounded float64 scores for every test truth that decides a tie or an order, and the guard that holds
each such truth to "the same inputs give the same bits wherever a column sits".

A BLAS GEMM (float32 or float64) sums a dot product in an order that depends on where the entry sits in its
blocking, so ``q.double() @ k.double().T`` need not tie two equal columns: a truth built on it decides a tie
by the CPU it runs on. :func:`exact_scores` gives each entry as the exactly rounded sum of the exact products,
which no order can change, and :func:`assert_order_free` checks any score function for that property.

- :func:`exact_scores` ``(a [n, D], b [m, D]) -> [n, m]`` float64: entry (i, j) is
  ``sum_f a[i, f] * b[j, f]`` rounded once, to nearest even. Each row of a and of b is cut into slices of
  ``bits`` bits below that row's top bit (Rump, Ogita and Oishi's error-free extraction, "Accurate
  floating-point summation", 2008; as in Ozaki's scheme for matrix products): a product of two slices is a sum
  of D integers below 2^53 units, which float64 adds without error in any order. The few slice products of an
  entry are then summed exactly by the same extraction, and rounded once: one IEEE addition where two parts
  remain, ``math.fsum`` where more do. A row or column holding NaN / inf gives what IEEE addition gives in any
  order (NaN, or the infinity); NaN comes back as one canonical NaN.
- :func:`assert_order_free` ``(scores, a, b)``: computes ``scores`` again with the feature axis reversed, with
  the feature axis rotated by one, and on a copy whose rows and columns are permuted, puts the results back in
  place and raises ``AssertionError`` (naming how many entries moved) if any differs from the first in any bit
  (on the first 64 rows: a large truth costs a little more than once, not four times).
  Reversal and one rotation together put any feature at three different positions: on data where only which
  two products meet first decides the sum (tests/test_truths.py), a float64 summation whose order is fixed by
  positions (any BLAS) cannot give the three the same bits.
- :func:`truth_scores`: :func:`exact_scores` through the guard. Every truth that decides a tie or an order
  takes its scores from here (tests/test_truths.py enumerates them and checks that each one does).
"""

from __future__ import annotations

import math

import numpy as np
import torch

FEATURE_RANGE = (2.0**-400, 2.0**400)  # finite nonzero features: no product of their slices can underflow
CHUNK_ELEMENTS = 1 << 22  # slice products held at once (32 MiB of float64)
GUARD_ROWS = 64  # the guard recomputes at most this many rows (the first ones, in place) per order
PERMUTATION_SEED = 20  # the guard's fixed row and column permutation


def _as_float64(x) -> np.ndarray:
    if torch.is_tensor(x):
        if not x.is_floating_point():
            raise TypeError(f"exact_scores takes floating-point features, got {x.dtype}")
        x = x.detach().cpu().to(torch.float64).numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"exact_scores takes 2-d features, got shape {list(x.shape)}")
    finite = np.abs(x[np.isfinite(x) & (x != 0)])
    if finite.size and (finite.min() < FEATURE_RANGE[0] or finite.max() > FEATURE_RANGE[1]):
        raise ValueError(
            f"exact_scores: finite nonzero features must lie in [2^-400, 2^400] in magnitude, "
            f"got [{finite.min():g}, {finite.max():g}]"
        )
    return x


def _slices(x: np.ndarray, bits: int) -> list:
    """Slices [n, D] summing exactly to the finite x: in each, row i holds integers of magnitude <= 2^bits + 1
    times one power of two of that row (x's bits from the row's top down, ``bits`` at a time)."""
    out = []
    rest = x
    while True:
        top = np.abs(rest).max(axis=1, keepdims=True)
        if not (top > 0).any():
            return out
        _, exponent = np.frexp(top)  # top < 2^exponent
        sigma = np.ldexp(1.0, exponent + 53 - bits)  # ulp of sigma's binade: 2^(exponent - bits) and up
        high = (sigma + rest) - sigma  # rest rounded to a multiple of 2^(exponent - bits)
        out.append(high)
        rest = rest - high  # exact (Rump, Ogita, Oishi 2008): |rest| <= 2^(exponent - bits)


def _exact_sums(p: np.ndarray) -> np.ndarray:
    """[r, m] exactly rounded sums of the finite float64 values p [K, r, m] over the first axis."""
    n = p.shape[0]
    headroom = math.ceil(math.log2(n + 2))  # 2^M >= n + 2: n extracted parts sum without error
    terms = []
    while True:
        top = np.abs(p).max(axis=0)
        if not (top > 0).any():
            break
        _, exponent = np.frexp(top)  # top < 2^exponent
        sigma = np.ldexp(1.0, exponent + headroom)
        high = (sigma + p) - sigma  # p's bits above eps * sigma: a multiple of eps * sigma, |sum| < sigma
        terms.append(high.sum(axis=0))  # exact in any order
        p = p - high  # exact; |p| <= eps * sigma, so each pass takes ~53 - M more bits
    if not terms:
        return np.zeros(p.shape[1:])
    return _rounded_sum(terms) + 0.0  # -0.0 -> 0.0


def _two_sum(x: np.ndarray, y: np.ndarray):
    """(s, e) with s = fl(x + y) and s + e == x + y exactly (Knuth)."""
    s = x + y
    v = s - x
    return s, (x - (s - v)) + (y - v)


def _rounded_sum(terms: list) -> np.ndarray:
    """The exactly rounded sum of a few float64 arrays, elementwise: math.fsum's algorithm, vectorized.
    Shewchuk's Grow-Expansion keeps the exact sum as nonoverlapping partials (zeros left in place); the
    partials are then added from the largest down until one addition rounds, and a remainder of exactly
    half an ulp is settled by the sign of the next nonzero partial below it (round half to even)."""
    partials = []  # increasing magnitude, nonoverlapping
    for term in terms:
        carry, grown = term, []
        for h in partials:
            carry, error = _two_sum(carry, h)
            grown.append(error)
        partials = grown + [carry]
    partials = partials[::-1]  # largest first
    hi = partials[0]
    lo = np.zeros_like(hi)
    rounded = np.zeros(hi.shape, dtype=bool)  # an addition rounded: lo is its remainder
    below = np.zeros_like(hi)  # the first nonzero partial after that addition
    for y in partials[1:]:
        take = ~rounded & (y != 0)
        s, error = _two_sum(hi, y)
        hi = np.where(take, s, hi)
        lo = np.where(take, error, lo)
        below = np.where(rounded & (below == 0), y, below)
        rounded |= take & (error != 0)
    half = rounded & (lo != 0) & (((lo < 0) & (below < 0)) | ((lo > 0) & (below > 0)))
    twice = lo * 2
    moved = hi + twice
    return np.where(half & (moved - hi == twice), moved, hi)


def _ieee_scores(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Plain float64 sums of the products: for rows or columns holding NaN / inf, whose result (NaN, or the
    infinity) no order changes."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = (a[:, None, :] * b[None, :, :]).sum(axis=-1)
    return np.where(np.isnan(s), np.nan, s)


def exact_scores(a, b) -> torch.Tensor:
    """``[n, m]`` float64: each entry the exactly rounded sum of the exact products ``a[i, f] * b[j, f]``
    (torch tensors of any float dtype or numpy arrays; computed on the CPU)."""
    a, b = _as_float64(a), _as_float64(b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"exact_scores: a {list(a.shape)} and b {list(b.shape)} differ in the feature dimension")
    n, m, d = a.shape[0], b.shape[0], a.shape[1]
    out = np.zeros((n, m))
    if d == 0 or n == 0 or m == 0:
        return torch.from_numpy(out)
    bad_a, bad_b = ~np.isfinite(a).all(axis=1), ~np.isfinite(b).all(axis=1)
    # D products of (2^bits + 1)-bounded integers sum below 2^53 units: each slice GEMM is exact in any order
    bits = math.floor((53 - math.log2(d)) / 2) - 1
    a_slices = _slices(np.where(bad_a[:, None], 0.0, a), bits)
    b_slices = _slices(np.where(bad_b[:, None], 0.0, b), bits)
    if a_slices and b_slices:
        step = max(1, CHUNK_ELEMENTS // (m * len(a_slices) * len(b_slices)))
        for start in range(0, n, step):
            rows = [x[start : start + step] for x in a_slices]
            # einsum's own loops, not a BLAS thread pool that waits on a loaded machine (any order is exact here)
            products = np.stack([np.einsum("if,jf->ij", x, y) for x in rows for y in b_slices])
            out[start : start + step] = _exact_sums(products)
    if bad_a.any():
        out[bad_a] = _ieee_scores(a[bad_a], b)
    if bad_b.any():
        out[:, bad_b] = _ieee_scores(a, b[bad_b])
    return torch.from_numpy(out)


def _bits(scores) -> torch.Tensor:
    s = torch.as_tensor(scores).detach().cpu().to(torch.float64)
    return torch.where(torch.isnan(s), float("nan"), s).view(torch.int64)  # one NaN: payloads are not scores


def _permutation(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


def order_variants(scores, a, b) -> dict:
    """``{what: scores put back in place}`` of ``scores(a, b)``'s first :data:`GUARD_ROWS` rows (at their own
    positions), recomputed with the feature axis reversed, rotated by one, and with those rows and every column
    permuted."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    first = a[:GUARD_ROWS]
    d = a.shape[1]
    reverse = torch.arange(d - 1, -1, -1)
    rotate = torch.roll(torch.arange(d), 1)
    rows, cols = _permutation(first.shape[0], PERMUTATION_SEED), _permutation(b.shape[0], PERMUTATION_SEED + 1)
    permuted = torch.as_tensor(scores(first[rows], b[cols]))
    back = torch.empty_like(permuted)
    back[rows[:, None], cols[None, :]] = permuted
    return {
        "feature axis reversed": scores(first[:, reverse], b[:, reverse]),
        "feature axis rotated by one": scores(first[:, rotate], b[:, rotate]),
        "rows and columns permuted": back,
    }


def order_differences(scores, a, b, want=None) -> dict:
    """``{what: number of entries whose bits differ from scores(a, b)}`` for each of :func:`order_variants`."""
    want = _bits(scores(a, b) if want is None else want)[:GUARD_ROWS]
    return {what: int((_bits(got) != want).sum()) for what, got in order_variants(scores, a, b).items()}


def assert_order_free(scores, a, b, what: str = "truth scores") -> torch.Tensor:
    """``scores(a, b)`` ([n, m]), after checking that the same sums in other orders (feature axis reversed,
    rotated by one, rows and columns permuted) give the same bits in place; raises AssertionError if not."""
    want = torch.as_tensor(scores(a, b))
    moved = {k: v for k, v in order_differences(scores, a, b, want).items() if v}
    if moved:
        raise AssertionError(
            f"{what} depend on the summation order: of {want.numel()} entries, "
            + ", ".join(f"{count} differ with the {how}" for how, count in moved.items())
            + " (a BLAS product? take them from tests/helpers/exact_scores.truth_scores)"
        )
    return want


def truth_scores(a, b) -> torch.Tensor:
    """``[n, m]`` float64 exactly rounded scores of ``a @ b.T``, checked by :func:`assert_order_free`: the one
    source of the scores of every test truth that decides a tie or an order."""
    return assert_order_free(exact_scores, a, b)
