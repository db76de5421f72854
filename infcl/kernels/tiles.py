"""What the three Triton kernels share: strided tile loads, the S tile, its log-sum-exp stats, and dS.

**The S tile.** ``raw = q[rows] @ k[cols].T`` (unscaled) in the accumulation dtype, then
``s = raw * scale``. Every kernel builds it with :func:`score_tile` (or, when one feature chunk covers
D, :func:`score_resident` on a q tile the caller loaded once), always in this orientation (q rows as
the MMA's M side, k rows as its N side), summing over the same BLOCK_D feature chunks in the same
order, and never fusing the scale into a later subtraction (:func:`scale_scores`). The backward relies on this: S recomputed in either backward kernel is
bit-identical to the forward's, so ``S - m`` is exact at a row's maximum (the forward took ``m`` from
the same values) and a confident row keeps ``1 - p`` to full relative precision. The assumption this
rests on: tl.dot's per-entry result depends only on the operand values, the K chunking and the MMA
instruction kind, not on where the entry sits in the tile or on the tile's M/N size. A tile shape that
changes the instruction kind (on sm_90 a dot whose M is below 64 rows per warp group falls back from
wgmma to mma.sync) could break it, so the default configs of all three kernels keep BLOCK_M >= 64 and
a multiple of 4 warps (the configs' comments say so where it constrains them).

**Stats in "rest" form.** Inside the kernels a running log-sum-exp is kept as (m, rest) with
``rest = sum(exp(S - m)) - 1``: the maximum's own term (exactly 1) is taken off by counting ties, not
by a subtraction, so a confident row's ``rest`` (~1e-10) is not lost under the 1. The host turns it
into the contract's ``r = log1p(rest)`` (:mod:`infcl.lse`); an empty set is (m, rest) = (-inf, -1).

**dS.** ``g * (exp((S - m) - r) - Y)`` in the accumulation dtype, in registers; at the positive the
entry is ``g * expm1(x)``, from Kahan's ``(u - 1) * x / log(u)`` (:func:`expm1`): Triton's interpreter
has no libdevice, and the trick only needs exp and an accurate log (tl.log is libdevice's logf on
NVIDIA GPUs; tl.exp is ex2.approx, whose error the trick absorbs).

Offsets are int64 (rows * stride exceeds 2**31 for large batches); loads are masked only where the
EVEN_* flags (set by ``triton.heuristics`` in the kernels) say a block can be ragged.
"""

import triton
import triton.language as tl

from .configs import INTERPRETED

# tl.dot needs every side of both operands to be at least 16 (the MMA instruction shapes).
MIN_DOT = tl.constexpr(16)
# Whether the kernels compile to PTX (inline assembly allowed) or run in the interpreter (numpy).
PTX = tl.constexpr(not INTERPRETED)


@triton.jit
def check_blocks(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Every side of a tl.dot operand is at least MIN_DOT (one assertion each: Triton 3.2 rejects a
    chained ``and``)."""
    tl.static_assert(BLOCK_M >= MIN_DOT)
    tl.static_assert(BLOCK_N >= MIN_DOT)
    tl.static_assert(BLOCK_D >= MIN_DOT)


@triton.jit
def load_tile(ptr, rows, cols, n_rows, n_cols, stride_r, stride_c, RAGGED_ROWS: tl.constexpr,
              RAGGED_COLS: tl.constexpr, ZERO_COLS: tl.constexpr = True):
    """The [len(rows), len(cols)] tile ptr[rows, cols] of an (n_rows x n_cols) strided matrix.

    Past the last row the tile repeats row n_rows - 1 (finite data; callers mask those rows out of
    every result or multiply them by 0), so no row mask is needed. Past the last column it reads 0
    (ZERO_COLS: the columns are summed over, as S's features are) or repeats column n_cols - 1 (the
    columns land in outputs that are never stored). Clamped indices keep the loads unmasked, which
    saves the predicate registers a masked tile load holds.
    """
    if RAGGED_ROWS:
        rows = tl.minimum(rows, n_rows - 1)
    if RAGGED_COLS and not ZERO_COLS:
        cols = tl.minimum(cols, n_cols - 1)
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
    if RAGGED_COLS and ZERO_COLS:
        return tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    return tl.load(ptrs)


@triton.jit
def load_vector(ptr, idx, n, stride, other, MASK: tl.constexpr):
    """ptr[idx * stride], ``other`` where idx >= n (only when MASK). (The fill is a select after the load,
    not the load's ``other``: Triton 3.2 miscompiles an integer ``other`` in some layouts.)"""
    if MASK:
        return tl.where(idx < n, tl.load(ptr + idx.to(tl.int64) * stride, mask=idx < n), other)
    return tl.load(ptr + idx.to(tl.int64) * stride)


@triton.jit
def tile_dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b (the dq and dk products). Under the interpreter bfloat16/float16 operands are upcast to
    float32 first: Triton 3.9's interpreter multiplies bfloat16 storage as integers, and the upcast
    product is exactly what tensor cores compute (exact products, float32 sums). On a GPU UPCAST is
    False."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)


@triton.jit
def score_resident(q_tile, k_tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """raw = q_tile @ k_tile.T for one feature chunk: q_tile [BLOCK_M, BLOCK_D], k_tile [BLOCK_N, BLOCK_D].

    The one chunk of :func:`score_tile`, for kernels that hold q (or k) in registers across the loop.
    """
    return score_dot(q_tile, k_tile, tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC), UPCAST, PRECISION)


@triton.jit
def score_dot(q_tile, k_tile, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + q_tile @ k_tile.T: tl.dot on a GPU. Under the interpreter, an explicit sum of the products
    over the feature axis instead: numpy's matmul sums in an order that depends on the tile's M and N
    (float32 results differ in the last bit between a 64 x 16 and a 64 x 32 tile), which would break the
    bit-identical S between kernels with different block sizes; this sum's order depends on K alone."""
    if PTX:
        return tl.dot(q_tile, tl.trans(k_tile), acc, input_precision=PRECISION, out_dtype=acc.dtype)
    if UPCAST:
        q_tile = q_tile.to(tl.float32)
        k_tile = k_tile.to(tl.float32)
    return acc + tl.sum(q_tile[:, None, :] * k_tile[None, :, :], axis=2)


@triton.jit
def score_tile(
    q_ptr, k_ptr, rows, cols, n_q, n_k, D, stride_q0, stride_q1, stride_k0, stride_k1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK_M: tl.constexpr, MASK_N: tl.constexpr, MASK_D: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """raw[BLOCK_M, BLOCK_N] = q[rows] @ k[cols].T in ACC, summed over D in BLOCK_D chunks (1 GEMM).

    The first chunk is exactly :func:`score_resident`; later chunks accumulate onto it.
    """
    feats = tl.arange(0, BLOCK_D)
    q_tile = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1, MASK_M, MASK_D)
    k_tile = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, MASK_N, MASK_D)
    raw = score_resident(q_tile, k_tile, BLOCK_M, BLOCK_N, ACC, UPCAST, PRECISION)
    for d0 in range(BLOCK_D, D, BLOCK_D):
        feats = d0 + tl.arange(0, BLOCK_D)
        q_tile = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1, MASK_M, MASK_D)
        k_tile = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, MASK_N, MASK_D)
        raw = score_dot(q_tile, k_tile, raw, UPCAST, PRECISION)
    return raw


@triton.jit
def block_scores(
    q_ptr, k_ptr, resident, rows, cols, n_q, n_k, D, stride_q0, stride_q1, stride_k0, stride_k1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ONE_CHUNK: tl.constexpr,
    Q_RESIDENT: tl.constexpr, MASK_M: tl.constexpr, MASK_N: tl.constexpr, MASK_D: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """(raw, chunk) for the tile q[rows] x k[cols], the one call every kernel's loop makes.

    ONE_CHUNK: ``resident`` is the side the program holds in registers (the q tile if Q_RESIDENT, else
    the k tile), the other side's one chunk is loaded here and returned as ``chunk`` for the caller's
    product. Otherwise raw is :func:`score_tile` and ``chunk`` is a placeholder.
    """
    if ONE_CHUNK:
        feats = tl.arange(0, BLOCK_D)
        if Q_RESIDENT:
            chunk = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, MASK_N, MASK_D)
            raw = score_resident(resident, chunk, BLOCK_M, BLOCK_N, ACC, UPCAST, PRECISION)
        else:
            chunk = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1, MASK_M, MASK_D)
            raw = score_resident(chunk, resident, BLOCK_M, BLOCK_N, ACC, UPCAST, PRECISION)
    else:
        raw = score_tile(
            q_ptr, k_ptr, rows, cols, n_q, n_k, D, stride_q0, stride_q1, stride_k0, stride_k1,
            BLOCK_M, BLOCK_N, BLOCK_D, MASK_M, MASK_N, MASK_D, ACC, UPCAST, PRECISION,
        )
        chunk = raw  # unused
    return raw, chunk


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
    others = tl.where(at_max, 0.0, tl.exp(s - t_b))
    rest = tl.sum(others, axis=AXIS) + (tl.sum(at_max.to(s.dtype), axis=AXIS) - 1.0)
    return t, rest


@triton.jit
def merge_rest_stats(m, rest, t, rest_t):
    """Merge the stats (t, rest_t) of more columns into the running (m, rest): the online log-sum-exp.

    The side whose maximum is the new maximum keeps its rest unscaled (no exp(0) rounding), the other
    side's (rest + 1) is scaled down. NaN anywhere stays NaN; (-inf, -1) is the empty set.
    """
    new_m = tl.maximum(m, t)
    grow = t > m
    rest = tl.where(grow, (rest + 1.0) * tl.exp(m - new_m) + rest_t, rest + (rest_t + 1.0) * tl.exp(t - new_m))
    return new_m, rest


@triton.jit
def expm1(x):
    """exp(x) - 1 to full relative precision near 0 (Kahan's trick: (u - 1) * x / log(u), u = exp(x))."""
    u = tl.exp(x)
    um1 = u - 1.0
    special = (u == 1.0) | (um1 == -1.0)
    ratio = um1 * (x / tl.log(tl.where(special, 2.0, u)))
    return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, ratio))


@triton.jit
def softmax_grad(s, m, r, g, is_pos):
    """g * (exp((s - m) - r) - Y) for a tile; m, r, g come broadcast ([BLOCK_M, 1] row stats or
    [1, BLOCK_N] column stats), Y is the one-hot ``is_pos`` (at most one entry per row).

    At the positive the entry is g * expm1(x) instead of g * exp(x) - g, so a confident row's 1 - p
    keeps its digits; expm1 runs on one value per row, picked out of the tile.
    """
    x = (s - m) - r
    x_pos = tl.sum(tl.where(is_pos, x, 0.0), axis=1)  # each row's positive entry, 0 if none in this tile
    return g * tl.where(is_pos, expm1(x_pos)[:, None], tl.exp(x))


@triton.jit
def scale_scores(raw, scale):
    """s = raw * scale, rounded on its own: an explicit ``mul.rn``, which neither LLVM nor ptxas contracts
    into a later subtraction. (An fma(raw, scale, -m) in one kernel and a rounded product in another
    would make the backward's S - m differ from the forward's at the maximum.) numpy never contracts."""
    if PTX:
        if raw.dtype == tl.float64:
            s = tl.inline_asm_elementwise("mul.rn.f64 $0, $1, $2;", "=d,d,d", [raw, scale], dtype=tl.float64,
                                          is_pure=True, pack=1)
        else:
            s = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [raw, scale], dtype=tl.float32,
                                          is_pure=True, pack=1)
    else:
        s = raw * scale
    return s


@triton.jit
def masked_scores(raw, scale, rows, cols, n_q, n_k, MASK_M: tl.constexpr, MASK_N: tl.constexpr):
    """s = raw * scale (:func:`scale_scores`), -inf outside the (n_q x n_k) block where a ragged block
    can reach."""
    s = scale_scores(raw, scale)
    if MASK_M and MASK_N:
        s = tl.where((rows[:, None] < n_q) & (cols[None, :] < n_k), s, float("-inf"))
    elif MASK_M:
        s = tl.where(rows[:, None] < n_q, s, float("-inf"))
    elif MASK_N:
        s = tl.where(cols[None, :] < n_k, s, float("-inf"))
    return s


@triton.jit
def block_range(part, parts, n_blocks):
    """[lo, hi): the contiguous share of ``n_blocks`` blocks that part ``part`` of ``parts`` walks."""
    return part * n_blocks // parts, (part + 1) * n_blocks // parts
