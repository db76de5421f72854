"""What the Triton kernels share: strided tile loads, the S tile and the dq / dk products.

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

Offsets are int64 (rows * stride exceeds 2**31 for large batches). Where the EVEN_* flags (constexprs the
launchers compute, :func:`infcl.kernels.kernel_args.even_blocks` / ``feature_chunks``: a triton.heuristics
wrapper is not a kernel torch.library.wrap_triton accepts) say a block can be ragged, rows past the end are
clamped to the last one and masked out of every result, and features past D read 0 (see :func:`load_tile`).

A tile's log-sum-exp stats and dS: :mod:`infcl.kernels.tile_stats`; the mask options formed inside a
tile: :mod:`infcl.kernels.softmax_mask_tiles`.
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
    """Every side of a tl.dot operand is at least MIN_DOT."""
    tl.static_assert(BLOCK_M >= MIN_DOT and BLOCK_N >= MIN_DOT and BLOCK_D >= MIN_DOT)


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
    """ptr[idx * stride], ``other`` where idx >= n (only when MASK). (The fill is a select after the load, not the
    load's ``other``: the code every config was sized with; the load's ``other`` compiles to other register counts.)"""
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
