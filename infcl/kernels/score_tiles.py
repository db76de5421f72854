"""What the Triton kernels share: strided tile loads, the S tile and the dq / dk products.

**The S tile.** ``raw = q[rows] @ k[cols].T`` (unscaled) in the accumulation dtype, then ``s = raw * scale``.
Every kernel builds it with :func:`score_chunks` over BLOCK_D feature chunks (the softmax kernels through
:func:`block_scores`, which hands it the tile a program holds in registers when one chunk covers D; the guide
scores, sigmoid, ranks, top-k and distillation directly). Always in this orientation (q rows on the MMA's M
side, k rows on its N side), over the same chunks in the same order, and with the scale never fused into a later
subtraction (:func:`scale_scores`). The backward relies on this: S recomputed in either backward kernel is
bit-identical to the forward's, so ``S - m`` is exact at a row's maximum (the forward took ``m`` from the same
values) and a confident row keeps ``1 - p`` to full relative precision. On tensor cores this holds by
construction, not by assumption: the three kernels' configs are built on one S tile
(:class:`infcl.kernels.configs.ScoreTile`: BLOCK_M, BLOCK_N and num_warps, which set the MMA instruction and its
layout), and every chunk's product is the one tl.dot in a loop (:func:`score_chunks`), so Triton gives it the
same layout in every kernel; each S entry is then computed by the same instructions on the same operands in
every kernel. ``python -m bench.static`` reads S's MMA ops and their layouts from the compiled kernels and
tests/test_static_report.py asserts they are the same in the forward, dq and dk. (FMA products, fp32 "ieee" and
fp64, sum each entry in K order whatever the tile.) Under the interpreter :func:`score_dot` makes the same
guarantee.

Offsets are int64 (rows * stride exceeds 2**31 for large batches). Where the EVEN_* flags (constexprs the
launchers compute, :func:`infcl.kernels.kernel_args.even_blocks` / ``feature_chunks``: a triton.heuristics
wrapper is not a kernel torch.library.wrap_triton accepts) say a block can be ragged, rows past the end are
clamped to the last one and masked out of every result, and features past D read 0 (see :func:`load_tile`).

**Operands as named tuples.** Inside the kernels an operand travels as one :class:`Matrix` (pointer, sizes,
strides), an S tile's shape as one :class:`Tile` and the product's dtype and precision as one :class:`Dot`
(Triton's own tuple arguments, ``typing.NamedTuple``). Each kernel entry stays flat (torch.compile's
wrap_triton takes no tuple launch arguments) and packs them once, as the arguments of the call it makes:
Triton turns the constexprs of a tuple assigned to a local name into tensors (and 3.4 keeps a namedtuple's
fields as they are), so a tuple is built in a call's arguments and read through its fields, never assigned.
The compiled kernels are unchanged by the packing (``python -m bench.static``: the same registers,
instructions and S layouts); a stride the launch specializes (1, a multiple of 16) stays so in the tuple.

A tile's log-sum-exp stats and dS: :mod:`infcl.kernels.tile_stats`; the mask options formed inside a
tile: :mod:`infcl.kernels.softmax_mask_tiles`.
"""

from typing import Any, NamedTuple

import triton
import triton.language as tl

from .env import INTERPRETED

# tl.dot needs every side of both operands to be at least 16 (the MMA instruction shapes).
MIN_DOT = tl.constexpr(16)
# Whether the kernels compile to PTX (inline assembly allowed) or run in the interpreter (numpy).
PTX = tl.constexpr(not INTERPRETED)


class Matrix(NamedTuple):
    """A strided [n, d] matrix as a kernel reads it: the pointer, its row and column counts and their strides
    (q, k, a guide, a gradient). Each kernel entry packs its operands once; a stride the launch specializes
    (1, or a multiple of 16) stays a constexpr or keeps its divisibility inside the tuple."""

    ptr: Any
    n: Any
    d: Any
    stride_r: Any
    stride_c: Any


class Tile(NamedTuple):
    """An S tile's shape, constexprs all: BLOCK_M q rows by BLOCK_N k rows, summed over BLOCK_D feature chunks
    (ONE_CHUNK: one chunk covers D), and which sides may be ragged (MASK_M, MASK_N, MASK_D)."""

    BLOCK_M: Any
    BLOCK_N: Any
    BLOCK_D: Any
    MASK_M: Any
    MASK_N: Any
    MASK_D: Any
    ONE_CHUNK: Any = tl.constexpr(False)  # a constexpr: Triton 3.4 takes a namedtuple's fields as they are


class Dot(NamedTuple):
    """How a kernel multiplies, constexprs all: the accumulation dtype ACC, whether the interpreter upcasts
    16-bit operands (UPCAST, :func:`tile_dot`) and tl.dot's input precision."""

    ACC: Any
    UPCAST: Any
    PRECISION: Any


@triton.jit
def check_blocks(tile):
    """Every side of a tl.dot operand is at least MIN_DOT."""
    tl.static_assert(tile.BLOCK_M >= MIN_DOT and tile.BLOCK_N >= MIN_DOT and tile.BLOCK_D >= MIN_DOT)


@triton.jit
def load_tile(x, rows, cols, RAGGED_ROWS: tl.constexpr, RAGGED_COLS: tl.constexpr, ZERO_COLS: tl.constexpr = True):
    """The [len(rows), len(cols)] tile x[rows, cols] of the :class:`Matrix` ``x``.

    Past the last row the tile repeats row x.n - 1 (finite data; callers mask those rows out of every result
    or multiply them by 0), so no row mask is needed. Past the last column it reads 0 (ZERO_COLS: the columns
    are summed over, as S's features are) or repeats column x.d - 1 (the columns land in outputs that are
    never stored). Clamped indices keep the loads unmasked, which saves the predicate registers a masked
    tile load holds.
    """
    if RAGGED_ROWS:
        rows = tl.minimum(rows, x.n - 1)
    if RAGGED_COLS and not ZERO_COLS:
        cols = tl.minimum(cols, x.d - 1)
    ptrs = x.ptr + rows[:, None].to(tl.int64) * x.stride_r + cols[None, :].to(tl.int64) * x.stride_c
    if RAGGED_COLS and ZERO_COLS:
        return tl.load(ptrs, mask=cols[None, :] < x.d, other=0.0)
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
def score_dot(q_tile, k_tile, acc, dot):
    """acc + q_tile @ k_tile.T: tl.dot on a GPU. Under the interpreter, an explicit sum of the products
    over the feature axis instead: numpy's matmul sums in an order that depends on the tile's M and N
    (float32 results differ in the last bit between a 64 x 16 and a 64 x 32 tile), which would break the
    bit-identical S between kernels with different block sizes; this sum's order depends on K alone.

    An if / else, not an early return: Triton traces the code after a constexpr-true ``return`` too, and the
    interpreter's [M, N, K] product exceeds Triton's 2**20-entry tensor limit on a GPU's bigger tiles
    (tests/test_triton_api_compile.py compiles such a tile)."""
    if PTX:
        out = tl.dot(q_tile, tl.trans(k_tile), acc, input_precision=dot.PRECISION, out_dtype=acc.dtype)
    else:
        if dot.UPCAST:
            q_tile = q_tile.to(tl.float32)
            k_tile = k_tile.to(tl.float32)
        out = acc + tl.sum(q_tile[:, None, :] * k_tile[None, :, :], axis=2)
    return out


@triton.jit
def score_chunks(q, k, rows, cols, tile, dot, q_res=None, k_res=None, raw=None):
    """raw[BLOCK_M, BLOCK_N] = q[rows] @ k[cols].T in dot.ACC (unscaled), summed over D in BLOCK_D chunks
    (1 GEMM): the S tile of every kernel. ``q_res`` / ``k_res``: that side's tile held in registers (with
    tile.ONE_CHUNK), read in place of a load. ``raw``: a product to continue (the Matryoshka kernels grow one
    tile over the prefixes' segments, :mod:`infcl.kernels.matryoshka`); None starts from 0.

    Every chunk's product is the one tl.dot (:func:`score_dot`) inside the loop, none peeled before it:
    Triton lays out a dot whose result reaches another dot (dS @ k in the backward, not in the forward) like
    that dot's operand, which a peeled first chunk's result does and the loop's does not, so a peeled chunk
    would take another MMA layout in the backward than in the forward (sm_80; sm_90 with 64 rows on 8
    warps). With one chunk the loop has one trip, for the same reason.
    """
    check_blocks(tile)
    if raw is None:
        raw = tl.zeros([tile.BLOCK_M, tile.BLOCK_N], dtype=dot.ACC)
    for d0 in range(0, q.d, tile.BLOCK_D):
        feats = d0 + tl.arange(0, tile.BLOCK_D)
        if q_res is None:
            q_tile = load_tile(q, rows, feats, tile.MASK_M, tile.MASK_D)
        else:
            q_tile = q_res
        if k_res is None:
            k_tile = load_tile(k, cols, feats, tile.MASK_N, tile.MASK_D)
        else:
            k_tile = k_res
        raw = score_dot(q_tile, k_tile, raw, dot)
    return raw


@triton.jit
def score_pair(q, k, q_res, rows, cols, tile, MASK_M1: tl.constexpr, dot):
    """(raw0, raw1): the S tiles of two row blocks, q[rows[0]] @ k[cols].T and q[rows[1]] @ k[cols].T, for the
    symmetric forward's pairs of row blocks (tile.MASK_M: the first block's raggedness, MASK_M1 the second's);
    each k chunk is loaded once for both.

    Each tile is :func:`score_chunks`' S: with tile.ONE_CHUNK on the resident q tiles ``q_res``, otherwise
    every chunk's product the tl.dot of :func:`score_dot` in the chunk loop, so the same MMA instruction and
    layout as the single tile's.
    """
    check_blocks(tile)
    if tile.ONE_CHUNK:
        k_tile = load_tile(k, cols, tl.arange(0, tile.BLOCK_D), tile.MASK_N, tile.MASK_D)
        raw0 = score_chunks(q, k, rows[0], cols, tile, dot, q_res[0], k_tile)
        raw1 = score_chunks(q, k, rows[1], cols, tile, dot, q_res[1], k_tile)
    else:
        raw0 = tl.zeros([tile.BLOCK_M, tile.BLOCK_N], dtype=dot.ACC)
        raw1 = tl.zeros([tile.BLOCK_M, tile.BLOCK_N], dtype=dot.ACC)
        for d0 in range(0, q.d, tile.BLOCK_D):
            feats = d0 + tl.arange(0, tile.BLOCK_D)
            k_tile = load_tile(k, cols, feats, tile.MASK_N, tile.MASK_D)
            q_tile0 = load_tile(q, rows[0], feats, tile.MASK_M, tile.MASK_D)
            q_tile1 = load_tile(q, rows[1], feats, MASK_M1, tile.MASK_D)
            raw0 = score_dot(q_tile0, k_tile, raw0, dot)
            raw1 = score_dot(q_tile1, k_tile, raw1, dot)
    return raw0, raw1


@triton.jit
def block_scores(q, k, resident, rows, cols, tile, dot, Q_RESIDENT: tl.constexpr):
    """(raw, chunk) for the tile q[rows] x k[cols], the one call every softmax kernel's loop makes.

    tile.ONE_CHUNK: ``resident`` is the side the program holds in registers (the q tile if Q_RESIDENT, else
    the k tile), the other side's one chunk is loaded here and returned as ``chunk`` for the caller's
    product. Otherwise raw is :func:`score_chunks` and ``chunk`` is a placeholder.
    """
    if tile.ONE_CHUNK:
        feats = tl.arange(0, tile.BLOCK_D)
        if Q_RESIDENT:
            chunk = load_tile(k, cols, feats, tile.MASK_N, tile.MASK_D)
            raw = score_chunks(q, k, rows, cols, tile, dot, resident, chunk)
        else:
            chunk = load_tile(q, rows, feats, tile.MASK_M, tile.MASK_D)
            raw = score_chunks(q, k, rows, cols, tile, dot, chunk, resident)
    else:
        raw = score_chunks(q, k, rows, cols, tile, dot)
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
