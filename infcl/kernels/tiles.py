"""What the three Triton kernels share: strided tile loads, the S tile, its log-sum-exp stats, and dS.

**The S tile.** ``raw = q[rows] @ k[cols].T`` (unscaled) in the accumulation dtype, then
``s = raw * scale``. Every kernel's loop builds it with :func:`block_scores`: :func:`score_chunks` over
BLOCK_D feature chunks, or, when one chunk covers D, :func:`score_resident` on the tile the program
holds in registers. Always in this orientation (q rows on the MMA's M side, k rows on its N side),
over the same chunks in the same order, and with the scale never fused into a later subtraction
(:func:`scale_scores`). The backward relies on this: S recomputed in either backward kernel is
bit-identical to the forward's, so ``S - m`` is exact at a row's maximum (the forward took ``m`` from
the same values) and a confident row keeps ``1 - p`` to full relative precision. On tensor cores this
holds by construction, not by assumption: the three kernels' configs are built on one S tile
(:class:`infcl.kernels.configs.ScoreTile`: BLOCK_M, BLOCK_N and num_warps, which set the MMA instruction
and its layout), and every chunk's product is the one tl.dot in a loop (:func:`score_chunks`,
:func:`score_resident`), so Triton gives it the same layout in every kernel; each S entry is then
computed by the same instructions on the same operands in every kernel. ``python -m bench.static``
reads S's MMA ops and their layouts from the compiled kernels and tests/test_static_report.py asserts
they are the same in the forward, dq and dk. (FMA products, fp32 "ieee" and fp64, sum each entry in K
order whatever the tile.) Under the interpreter :func:`score_dot` makes the same guarantee.

**Stats in "rest" form.** Inside the kernels a running log-sum-exp is kept as (m, rest) with
``rest = sum(exp(S - m)) - 1``: the maximum's own term (exactly 1) is taken off by counting ties, not
by a subtraction, so a confident row's ``rest`` (~1e-10) is not lost under the 1. The host turns it
into the contract's ``r = log1p(rest)`` (:mod:`infcl.lse`); an empty set is (m, rest) = (-inf, -1).

**dS.** ``g * (exp((S - m) - r) - Y)`` in the accumulation dtype, in registers; at the positive the
entry is ``g * expm1(x)``, from Kahan's ``(u - 1) * x / log(u)`` (:func:`expm1`): Triton's interpreter
has no libdevice, and the trick only needs exp and an accurate log (tl.log is libdevice's logf on
NVIDIA GPUs; :func:`exp` is ex2.approx, whose error the trick absorbs). A tile that holds no positive
skips that work on a uniform branch (:func:`holds_positive`).

**Masks** (:mod:`infcl.masks`; the end of this module): each tile's positives and exclusions from the ids
of its rows and columns and, with a guide, the guide scores of one more product over D'; the masked
stats treat an all-excluded line as the empty set, and the masked dS keeps every positive's entry a
single expm1.

Offsets are int64 (rows * stride exceeds 2**31 for large batches). Where the EVEN_* flags (constexprs the
launchers compute, :func:`infcl.kernels.kernel_args.even_blocks` / ``feature_chunks``: a triton.heuristics
wrapper is not a kernel torch.library.wrap_triton accepts) say a block can be ragged, rows past the end are
clamped to the last one and masked out of every result, and features past D read 0 (see :func:`load_tile`).
"""

import triton
import triton.language as tl

from .env import INTERPRETED

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
def load_tile(
    ptr,
    rows,
    cols,
    n_rows,
    n_cols,
    stride_r,
    stride_c,
    RAGGED_ROWS: tl.constexpr,
    RAGGED_COLS: tl.constexpr,
    ZERO_COLS: tl.constexpr = True,
):
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
def dot_operand(x, dtype: tl.constexpr, PRECISION: tl.constexpr):
    """x (dS, in the accumulation dtype) as an operand of the dq / dk products in ``dtype``, the inputs'. At
    tf32 on a GPU, rounded to TF32 to nearest (``cvt.rna.tf32.f32``): the tensor cores would otherwise
    truncate it, a bias of ~2**-11 in every entry (q and k come rounded the same way,
    :func:`infcl.kernels.configs.tf32_operands`)."""
    if PTX and PRECISION == "tf32":
        y = tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def score_resident(
    q_tile,
    k_tile,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """raw = q_tile @ k_tile.T for one feature chunk: q_tile [BLOCK_M, BLOCK_D], k_tile [BLOCK_N, BLOCK_D],
    D <= BLOCK_D.

    The one chunk of :func:`score_chunks`, for kernels that hold q (or k) in registers across the loop. Its
    tl.dot sits in a loop of one trip (D <= BLOCK_D) for the reason score_chunks' does: so that its MMA
    layout is the forward's in the backward too (on sm_80 it is not otherwise).
    """
    raw = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for _ in range(0, D, BLOCK_D):
        raw = score_dot(q_tile, k_tile, raw, UPCAST, PRECISION)
    return raw


@triton.jit
def score_dot(q_tile, k_tile, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + q_tile @ k_tile.T: tl.dot on a GPU. Under the interpreter, an explicit sum of the products
    over the feature axis instead: numpy's matmul sums in an order that depends on the tile's M and N
    (float32 results differ in the last bit between a 64 x 16 and a 64 x 32 tile), which would break the
    bit-identical S between kernels with different block sizes; this sum's order depends on K alone.

    An if / else, not an early return: Triton traces the code after a constexpr-true ``return`` too, and the
    interpreter's [M, N, K] product exceeds Triton's 2**20-entry tensor limit on a GPU's bigger tiles
    (tests/test_triton_api_compile.py compiles such a tile)."""
    if PTX:
        out = tl.dot(q_tile, tl.trans(k_tile), acc, input_precision=PRECISION, out_dtype=acc.dtype)
    else:
        if UPCAST:
            q_tile = q_tile.to(tl.float32)
            k_tile = k_tile.to(tl.float32)
        out = acc + tl.sum(q_tile[:, None, :] * k_tile[None, :, :], axis=2)
    return out


@triton.jit
def chunk_dot(
    q_ptr,
    k_ptr,
    rows,
    cols,
    d0,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    BLOCK_D: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    acc,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc + q[rows, d0 : d0 + BLOCK_D] @ k[cols, d0 : d0 + BLOCK_D].T: one feature chunk of S (features past D
    read 0), the step of :func:`score_chunks` and :func:`score_tile`."""
    feats = d0 + tl.arange(0, BLOCK_D)
    q_tile = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1, MASK_M, MASK_D)
    k_tile = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, MASK_N, MASK_D)
    return score_dot(q_tile, k_tile, acc, UPCAST, PRECISION)


@triton.jit
def score_chunks(
    q_ptr,
    k_ptr,
    rows,
    cols,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """raw[BLOCK_M, BLOCK_N] = q[rows] @ k[cols].T in ACC, summed over D in BLOCK_D chunks (1 GEMM): the
    softmax kernels' S.

    The sums of :func:`score_tile` in the same order (a zero accumulator plus the first chunk's product,
    then each later chunk's), but every chunk's product is the one tl.dot inside the loop, none peeled
    before it: Triton lays out a dot whose result reaches another dot (dS @ k in the backward, not in the
    forward) like that dot's operand, which a peeled first chunk's result does and the loop's does not, so
    a peeled chunk takes another MMA layout in the backward than in the forward (sm_80; sm_90 with 64 rows
    on 8 warps).
    """
    raw = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        raw = chunk_dot(
            q_ptr,
            k_ptr,
            rows,
            cols,
            d0,
            n_q,
            n_k,
            D,
            stride_q0,
            stride_q1,
            stride_k0,
            stride_k1,
            BLOCK_D,
            MASK_M,
            MASK_N,
            MASK_D,
            raw,
            UPCAST,
            PRECISION,
        )
    return raw


@triton.jit
def score_tile(
    q_ptr,
    k_ptr,
    rows,
    cols,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """raw[BLOCK_M, BLOCK_N] = q[rows] @ k[cols].T in ACC, summed over D in BLOCK_D chunks (1 GEMM), with
    the first chunk's product peeled before the loop: the sigmoid kernels' S (their configs are sized on
    this form; the softmax kernels use :func:`score_chunks`)."""
    raw = chunk_dot(
        q_ptr,
        k_ptr,
        rows,
        cols,
        0,
        n_q,
        n_k,
        D,
        stride_q0,
        stride_q1,
        stride_k0,
        stride_k1,
        BLOCK_D,
        MASK_M,
        MASK_N,
        MASK_D,
        tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC),
        UPCAST,
        PRECISION,
    )
    for d0 in range(BLOCK_D, D, BLOCK_D):
        raw = chunk_dot(
            q_ptr,
            k_ptr,
            rows,
            cols,
            d0,
            n_q,
            n_k,
            D,
            stride_q0,
            stride_q1,
            stride_k0,
            stride_k1,
            BLOCK_D,
            MASK_M,
            MASK_N,
            MASK_D,
            raw,
            UPCAST,
            PRECISION,
        )
    return raw


@triton.jit
def score_pair(
    q_ptr,
    k_ptr,
    q_res0,
    q_res1,
    rows0,
    rows1,
    cols,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    MASK_M0: tl.constexpr,
    MASK_M1: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(raw0, raw1): the S tiles of two row blocks, q[rows0] @ k[cols].T and q[rows1] @ k[cols].T, for the
    symmetric forward's pairs of row blocks; each k chunk is loaded once for both.

    Each tile is :func:`block_scores`' S: with ONE_CHUNK, :func:`score_resident` on the resident q tiles
    ``q_res0`` / ``q_res1``; otherwise the sums of :func:`score_chunks`, every chunk's product the tl.dot of
    :func:`score_dot` in the chunk loop, so the same MMA instruction and layout as the single tile's.
    """
    if ONE_CHUNK:
        feats = tl.arange(0, BLOCK_D)
        k_tile = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, MASK_N, MASK_D)
        raw0 = score_resident(q_res0, k_tile, D, BLOCK_M, BLOCK_N, BLOCK_D, ACC, UPCAST, PRECISION)
        raw1 = score_resident(q_res1, k_tile, D, BLOCK_M, BLOCK_N, BLOCK_D, ACC, UPCAST, PRECISION)
    else:
        raw0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        raw1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for d0 in range(0, D, BLOCK_D):
            feats = d0 + tl.arange(0, BLOCK_D)
            k_tile = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, MASK_N, MASK_D)
            q_tile0 = load_tile(q_ptr, rows0, feats, n_q, D, stride_q0, stride_q1, MASK_M0, MASK_D)
            q_tile1 = load_tile(q_ptr, rows1, feats, n_q, D, stride_q0, stride_q1, MASK_M1, MASK_D)
            raw0 = score_dot(q_tile0, k_tile, raw0, UPCAST, PRECISION)
            raw1 = score_dot(q_tile1, k_tile, raw1, UPCAST, PRECISION)
    return raw0, raw1


@triton.jit
def block_scores(
    q_ptr,
    k_ptr,
    resident,
    rows,
    cols,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    Q_RESIDENT: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(raw, chunk) for the tile q[rows] x k[cols], the one call every kernel's loop makes.

    ONE_CHUNK: ``resident`` is the side the program holds in registers (the q tile if Q_RESIDENT, else
    the k tile), the other side's one chunk is loaded here and returned as ``chunk`` for the caller's
    product. Otherwise raw is :func:`score_chunks` and ``chunk`` is a placeholder.
    """
    if ONE_CHUNK:
        feats = tl.arange(0, BLOCK_D)
        if Q_RESIDENT:
            chunk = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, MASK_N, MASK_D)
            raw = score_resident(resident, chunk, D, BLOCK_M, BLOCK_N, BLOCK_D, ACC, UPCAST, PRECISION)
        else:
            chunk = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1, MASK_M, MASK_D)
            raw = score_resident(chunk, resident, D, BLOCK_M, BLOCK_N, BLOCK_D, ACC, UPCAST, PRECISION)
    else:
        raw = score_chunks(
            q_ptr,
            k_ptr,
            rows,
            cols,
            n_q,
            n_k,
            D,
            stride_q0,
            stride_q1,
            stride_k0,
            stride_k1,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            MASK_M,
            MASK_N,
            MASK_D,
            ACC,
            UPCAST,
            PRECISION,
        )
        chunk = raw  # unused
    return raw, chunk


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
def scale_scores(raw, scale):
    """s = raw * scale, rounded on its own: an explicit ``mul.rn``, which neither LLVM nor ptxas contracts
    into a later subtraction. (An fma(raw, scale, -m) in one kernel and a rounded product in another
    would make the backward's S - m differ from the forward's at the maximum.) numpy never contracts."""
    if PTX:
        if raw.dtype == tl.float64:
            s = tl.inline_asm_elementwise(
                "mul.rn.f64 $0, $1, $2;", "=d,d,d", [raw, scale], dtype=tl.float64, is_pure=True, pack=1
            )
        else:
            s = tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=r,r,r", [raw, scale], dtype=tl.float32, is_pure=True, pack=1
            )
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


# ---- the mask options (infcl.masks): positives and exclusions formed inside the tile ---------------
# Compiled only where a launch sets HAS_IDS or HAS_GUIDE; the plain loss's kernels never reach them.

# The POSITIVES constexpr (configs.POSITIVES): one positive per row at ``pos`` (multi_positive None),
# or every column with the row's id, the loss taking their mean ("mean") or their log-sum-exp ("sum").
ONE_POSITIVE = tl.constexpr(0)
MEAN_POSITIVES = tl.constexpr(1)
SUM_POSITIVES = tl.constexpr(2)


@triton.jit
def tile_masks(
    rows,
    cols,
    pos,
    q_ids,
    k_ids,
    scores,
    row_thr,
    col_thr,
    n_q,
    n_k,
    HAS_IDS: tl.constexpr,
    HAS_GUIDE: tl.constexpr,
    POSITIVES: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
):
    """(positive, excluded_rows, excluded_cols) [BLOCK_M, BLOCK_N] bool of one tile (see infcl.masks).

    positive: the one-hot of ``pos`` (ONE_POSITIVE) or q_ids[i] == k_ids[j] on the block's real rows and
    columns. excluded_rows: (same id, with one positive per row) or guide score ``scores`` above the row's
    threshold, and not a positive; excluded_cols the same with the columns' thresholds (SYMMETRIC; else
    it is excluded_rows). Where nothing can be excluded (no guide; ids with several positives) both are
    ``positive``, unused.
    """
    tl.static_assert(HAS_IDS or POSITIVES == ONE_POSITIVE)  # several positives are named by ids
    if POSITIVES == ONE_POSITIVE:
        positive = cols[None, :] == pos[:, None]  # pos is -1 past n_q and where it lies in another block
    else:
        positive = q_ids[:, None] == k_ids[None, :]
        if MASK_M:
            positive = positive & (rows[:, None] < n_q)
        if MASK_N:
            positive = positive & (cols[None, :] < n_k)
    if HAS_GUIDE:
        excluded_rows = scores > row_thr[:, None]
        if SYMMETRIC:
            excluded_cols = scores > col_thr[None, :]
        else:
            excluded_cols = excluded_rows
        if HAS_IDS and POSITIVES == ONE_POSITIVE:
            same = q_ids[:, None] == k_ids[None, :]
            excluded_rows = excluded_rows | same
            excluded_cols = excluded_cols | same
        excluded_rows = excluded_rows & ~positive
        excluded_cols = excluded_cols & ~positive
    elif HAS_IDS and POSITIVES == ONE_POSITIVE:
        excluded_rows = (q_ids[:, None] == k_ids[None, :]) & ~positive
        excluded_cols = excluded_rows
    else:
        excluded_rows = positive  # unused: nothing is excluded
        excluded_cols = positive
    return positive, excluded_rows, excluded_cols


@triton.jit
def load_optional(ptr, idx, n, PRESENT: tl.constexpr, MASK: tl.constexpr):
    """An optional per-row (per-column) vector at ``idx``: the ids or the guide thresholds, 0 past n (the
    positives are masked to the real ones), or ``idx`` as a placeholder, never read, when absent."""
    if PRESENT:
        values = load_vector(ptr, idx, n, 1, 0, MASK)
    else:
        values = idx  # unused
    return values


@triton.jit
def block_masks(
    gq_ptr,
    gk_ptr,
    rows,
    cols,
    pos,
    q_ids,
    k_ids_ptr,
    row_thr,
    col_thr_ptr,
    n_q,
    n_k,
    DG,
    stride_gq0,
    stride_gq1,
    stride_gk0,
    stride_gk1,
    HAS_IDS: tl.constexpr,
    HAS_GUIDE: tl.constexpr,
    POSITIVES: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_ACC: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
):
    """One tile's (positive, excluded_rows, excluded_cols) (:func:`infcl.kernels.tiles.tile_masks`): the
    columns' ids and, with a guide, the guide scores (one GEMM over D') and the columns' thresholds."""
    k_ids = load_optional(k_ids_ptr, cols, n_k, HAS_IDS, not EVEN_N)
    if HAS_GUIDE:
        scores = score_tile(
            gq_ptr,
            gk_ptr,
            rows,
            cols,
            n_q,
            n_k,
            DG,
            stride_gq0,
            stride_gq1,
            stride_gk0,
            stride_gk1,
            BLOCK_M,
            BLOCK_N,
            BLOCK_G,
            not EVEN_M,
            not EVEN_N,
            not EVEN_G,
            GUIDE_ACC,
            False,
            GUIDE_PRECISION,
        )
    else:
        scores = rows  # unused
    col_thr = load_optional(col_thr_ptr, cols, n_k, HAS_GUIDE and SYMMETRIC, not EVEN_N)
    return tile_masks(
        rows,
        cols,
        pos,
        q_ids,
        k_ids,
        scores,
        row_thr,
        col_thr,
        n_q,
        n_k,
        HAS_IDS,
        HAS_GUIDE,
        POSITIVES,
        SYMMETRIC,
        not EVEN_M,
        not EVEN_N,
    )


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


@triton.jit
def positive_partials(s, positive, pos_max, pos_rest, pos_sum, pos_count, AXIS: tl.constexpr, POSITIVES: tl.constexpr):
    """Fold one tile's positives into the running (max, rest, sum, count) of each row (AXIS 1) or column
    (AXIS 0): their max (with "sum", their stats, rest as in :func:`tile_rest_stats`; else rest stays the
    empty set's -1), the sum of their logits and their number."""
    at_pos = tl.where(positive, s, float("-inf"))
    if POSITIVES == SUM_POSITIVES:
        t, rest = kept_rest_stats(at_pos, AXIS)
        pos_max, pos_rest = merge_kept_stats(pos_max, pos_rest, t, rest)
    else:
        pos_max = tl.maximum(pos_max, tl.max(at_pos, axis=AXIS))
    pos_sum += tl.sum(tl.where(positive, s, 0.0), axis=AXIS)
    pos_count += tl.sum(positive.to(s.dtype), axis=AXIS)
    return pos_max, pos_rest, pos_sum, pos_count


@triton.jit
def masked_softmax_grad(
    s, m, r, g, pos_count, pos_max, pos_rel, positive, excluded, POSITIVES: tl.constexpr, EXCLUDES: tl.constexpr
):
    """g * (P - Y) for a tile with masks: P = exp((s - m) - r) off the exclusions and 0 on them; m, r, g and
    the positives' count or stats come broadcast like :func:`softmax_grad`'s stats (each only where its
    POSITIVES reads it). Y, and a positive's entry:

    - ONE_POSITIVE: the one-hot of ``positive``; g * expm1(x) there, picked out per row (as softmax_grad);
    - MEAN_POSITIVES (``pos_count`` c = |P|): 1 / c on the positives; (p - 1/c) = expm1(x + log c) / c;
    - SUM_POSITIVES (``pos_max``, ``pos_rel``: the positives' global max and log-sum relative to it): the
      softmax over P; p - y = y * expm1(d) with y = exp((s - pos_max) - pos_rel) and
      d = (pos_max - m) + (pos_rel - r) <= 0, the log of the positives' share.

    Never a difference of two rounded probabilities, so a confident row keeps its digits.
    """
    x = (s - m) - r
    p = exp(x)
    if EXCLUDES:
        p = tl.where(excluded, 0.0, p)
    if POSITIVES == ONE_POSITIVE:
        x_pos = tl.sum(tl.where(positive, x, 0.0), axis=1)
        at_pos = expm1(x_pos)[:, None]
    elif POSITIVES == MEAN_POSITIVES:
        at_pos = expm1(x + tl.log(pos_count)) / pos_count
    else:
        at_pos = exp((s - pos_max) - pos_rel) * expm1((pos_max - m) + (pos_rel - r))
    return g * tl.where(positive, at_pos, p)
