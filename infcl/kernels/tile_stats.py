"""A tile's softmax arithmetic, shared by the kernels: exp and expm1, the log-sum-exp stats in "rest" form
and their online merge, and dS.

**Stats in "rest" form.** Inside the kernels a running log-sum-exp is kept as (m, rest) with
``rest = sum(exp(S - m)) - 1``: the maximum's own term (exactly 1) is taken off by counting ties, not
by a subtraction, so a confident row's ``rest`` (~1e-10) is not lost under the 1. The host turns it
into the contract's ``r = log1p(rest)`` (:mod:`infcl.lse`); an empty set is (m, rest) = (-inf, -1).

**dS.** ``g * (exp((S - m) - r) - Y)`` in the accumulation dtype, in registers; at the positive the
entry is ``g * expm1(x)``, from Kahan's ``(u - 1) * x / log(u)`` (:func:`expm1`): Triton's interpreter
has no libdevice, and the trick only needs exp and an accurate log (tl.log is libdevice's logf on
NVIDIA GPUs; :func:`exp` is ex2.approx, whose error the trick absorbs). A tile that holds no positive
skips that work on a uniform branch (:func:`holds_positive`).

The S tile these act on: :mod:`infcl.kernels.score_tiles`.
"""

import triton
import triton.language as tl

from .score_tiles import PTX

# exp(x) = 2 ** (x * log2(e)); tl.exp multiplies by the same float32 constant.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def exp(x):
    """e ** x for the kernels' tiles. In float32 on a GPU, ``ex2.approx.ftz.f32`` of ``x * log2(e)``: tl.exp's
    ``ex2.approx.f32`` without ``ftz`` makes ptxas wrap every MUFU.EX2 in a range test and two scalings
    (4 more instructions per exponential) only to return subnormal results, below 2**-126, which the ftz
    form flushes to 0. Every exponential here is exp(v - max) of a term in a sum that holds its maximum's
    term, 1, or a probability of such a term: a term below 2**-126 of the largest changes the loss and the
    gradient by less than float32 keeps (relative to the row's, or the gradient's, norm). The same
    approximation (MUFU.EX2, ~2 ulp) otherwise. float64 and the interpreter: tl.exp."""
    if PTX and x.dtype == tl.float32:
        y = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * LOG2E], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        y = tl.exp(x)
    return y


@triton.jit
def tile_rest_stats(s, AXIS: tl.constexpr):
    """(t, rest) of a tile along AXIS (1: per row, 0: per column): t = max, rest = sum(exp(s - t)) - 1.

    The maximum's own exp(0) = 1 is left out by counting the entries equal to t (ties add 1 each
    beyond the first), so rest keeps its digits when every other entry is far below the maximum.
    """
    t = tl.max(s, axis=AXIS)
    if AXIS == 1:
        t_b = t[:, None]
    else:
        t_b = t[None, :]
    at_max = s == t_b
    others = tl.where(at_max, 0.0, exp(s - t_b))
    rest = tl.sum(others, axis=AXIS) + (tl.sum(at_max.to(s.dtype), axis=AXIS) - 1.0)
    return t, rest


@triton.jit
def pair_column_stats(s0, s1):
    """(t, rest) per column of two tiles stacked row-wise, as :func:`tile_rest_stats` (AXIS 0) of their
    concatenation: the elementwise max of the two first, so each kind of cross-row reduction (the max, the
    sum, the ties) runs once for both tiles."""
    t = tl.max(tl.maximum(s0, s1), axis=0)
    at_max0 = s0 == t[None, :]
    at_max1 = s1 == t[None, :]
    others = tl.where(at_max0, 0.0, exp(s0 - t[None, :])) + tl.where(at_max1, 0.0, exp(s1 - t[None, :]))
    ties = at_max0.to(s0.dtype) + at_max1.to(s0.dtype)
    rest = tl.sum(others, axis=0) + (tl.sum(ties, axis=0) - 1.0)
    return t, rest


@triton.jit
def merge_rest_stats(m, rest, t, rest_t):
    """Merge the stats (t, rest_t) of more columns into the running (m, rest): the online log-sum-exp.

    The side whose maximum is the new maximum keeps its rest unscaled (no exp(0) rounding), the other
    side's (rest + 1) is scaled down by exp(smaller max - new max): one exponential, whichever side grows.
    NaN anywhere stays NaN; (-inf, -1) is the empty set.
    """
    new_m = tl.maximum(m, t)
    down = exp(tl.minimum(m, t) - new_m)
    rest = tl.where(t > m, (rest + 1.0) * down + rest_t, rest + (rest_t + 1.0) * down)
    return new_m, rest


@triton.jit
def expm1(x):
    """exp(x) - 1 to full relative precision near 0 (Kahan's trick: (u - 1) * x / log(u), u = exp(x))."""
    u = exp(x)
    um1 = u - 1.0
    special = (u == 1.0) | (um1 == -1.0)
    ratio = um1 * (x / tl.log(tl.where(special, 2.0, u)))
    return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, ratio))


@triton.jit
def positive_span(pos):
    """(lo, hi): the least and the greatest column among the rows' positives ``pos`` (-1: none here), or
    (2**30, -1) when no row has one. A column block [c0, c0 + BLOCK_N) holds a positive only if
    ``hi >= c0 and lo < c0 + BLOCK_N`` (:func:`holds_positive`), so the tiles that hold none (all but one or
    two per row block, for positives on the diagonal) skip the positives' work on a uniform branch."""
    return tl.min(tl.where(pos >= 0, pos, 1 << 30), axis=0), tl.max(pos, axis=0)


@triton.jit
def holds_positive(lo, hi, c0, BLOCK_N: tl.constexpr, BRANCH: tl.constexpr):
    """Whether the column block [c0, c0 + BLOCK_N) may hold a positive of rows whose span is (lo, hi); always
    (a constexpr True) where the positives' work is not branched on (``BRANCH``:
    :func:`infcl.kernels.configs.branch_positives`)."""
    if BRANCH:
        holds = (hi >= c0) & (lo < c0 + BLOCK_N)
    else:
        holds = True
    return holds


@triton.jit
def softmax_grad(s, m, r, g, is_pos, has_pos):
    """g * (exp((s - m) - r) - Y) for a tile; m, r, g come broadcast ([BLOCK_M, 1] row stats or
    [1, BLOCK_N] column stats), Y is the one-hot ``is_pos`` (at most one entry per row).

    At the positive the entry is g * expm1(x) instead of g * exp(x) - g, so a confident row's 1 - p
    keeps its digits; expm1 runs on one value per row, picked out of the tile, only in a tile that may
    hold a positive (``has_pos``, a scalar: a uniform branch).
    """
    x = (s - m) - r
    ds = g * exp(x)
    if has_pos:
        x_pos = tl.sum(tl.where(is_pos, x, 0.0), axis=1)  # each row's positive entry, 0 if none in this tile
        ds = tl.where(is_pos, g * expm1(x_pos)[:, None], ds)
    return ds


@triton.jit
def kept_rest_stats(s, AXIS: tl.constexpr):
    """:func:`tile_rest_stats` of a tile whose lines may be empty (every entry -inf: all excluded, or no
    positive in the tile); an empty line's stats are the empty set's (-inf, -1)."""
    t, rest = tile_rest_stats(s, AXIS)
    return t, tl.where(t == float("-inf"), -1.0, rest)


@triton.jit
def merge_kept_stats(m, rest, t, rest_t):
    """:func:`merge_rest_stats` where either side may be the empty set (-inf, -1), which is the identity
    (the plain merge would form exp(-inf - -inf) when both are)."""
    new_m, new_rest = merge_rest_stats(m, rest, t, rest_t)
    empty = t == float("-inf")
    return tl.where(empty, m, new_m), tl.where(empty, rest, new_rest)
