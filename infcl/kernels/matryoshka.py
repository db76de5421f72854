"""The softmax loss over Matryoshka prefixes as Triton kernels (``cal_inf_loss(matryoshka=..., backend="triton")``;
the math: :mod:`infcl.matryoshka`; the ring steps: :mod:`infcl.losses.matryoshka`; the torch tiles' version:
:mod:`infcl.backends.torch_tiles.matryoshka`; the backend object: :mod:`infcl.backends.triton.matryoshka`).

The prefixes reach the kernels as ``bounds`` [K + 1] (0, m_1, ..., m_K, increasing) and each side's factors
[K, n] (1 / max(|x[:m_k]|, eps) where prefix k is renormalized, else 1; float32, or float64 for float64 inputs).
A tile's raw product grows segment by segment: raw^k = raw^(k-1) + q[rows, m_(k-1):m_k] @ k[cols, m_(k-1):m_k].T,
each segment's product by :func:`infcl.kernels.score_tiles.score_chunks` on the segment's columns (in the q-rows x
k-rows orientation, over the same chunks in every kernel), so D is walked once per tile for all K prefixes, and
S^k = scale * ((raw^k * a^k_i) * b^k_j) (one rounded multiply by the scale,
:func:`~infcl.kernels.score_tiles.masked_scores`): every kernel forms the same bits (one step per prefix,
:func:`_prefix_tile`, for the forward and the backward walks), and S - m is exact at a line's maximum.

- :func:`_matryoshka_forward_kernel`: a program owns BLOCK_M rows (``BY_COLUMN`` False) or BLOCK_N columns
  (True) and walks the other side's blocks; at each prefix's boundary the tile's stats (rest form,
  :func:`infcl.kernels.tile_stats.tile_rest_stats`) are merged into that prefix's running stats of the
  program's lines, which it alone reads and writes ([3, K, n]: max, rest and, by rows, the positive logit).
- :func:`_matryoshka_backward_kernel`: a program owns (BLOCK_M rows or BLOCK_N columns) x a BLOCK_OUT slice of
  D and recomputes each tile's prefixes; prefix k's dS^k = g^k (P^k - Y) (rows' and, symmetric, columns'
  term, :func:`infcl.kernels.tile_stats.softmax_grad`) weighted by a^k_i b^k_j feeds the features of the
  slice below m_k: grad += (dS^k a^k b^k) @ k[cols, slice ∩ [0, m_k)], so each segment's gradient is the sum
  over the prefixes that hold it; a one-wide renormalized first prefix (``SIGN_ONLY``: its logits
  scale * sign(q_0) * sign(k_0) do not move with the features) feeds none. The slice-0 programs also write,
  per line and prefix, the sums of dS^k_row * u^k and dS^k_col * u^k (u^k = S^k / scale): the scale's
  gradient and the renormalization's own term (c^k = scale * their sum; the host applies -a^2 c x[:m_k]).
  No atomics: each output has one program.

With the mask options (ids, ``multi_positive``, a guide; :mod:`infcl.masks`): :func:`_masked_matryoshka_forward_kernel`
and :func:`_masked_matryoshka_backward_kernel`, the same walks (:func:`_forward_lines`, :func:`_backward_lines`)
with the masked softmax kernels' per-tile helpers (:mod:`infcl.kernels.softmax_mask_tiles`). A tile's positives
and exclusions do not depend on the prefix (ids; the guide features are never truncated), so each tile forms them
once (:func:`_tile_masks`: ``block_masks``, with one guide product over D' at the masked kernels' guide precision
and chunks, so its exclusions are those the guide thresholds were read off) and applies them to every prefix's
S^k: forward, each prefix's masked partials (the ``[6, n]`` rows of :mod:`infcl.masks`, ``[6, K, n]``; a program
owns its lines whole, so the host merges nothing); backward, dS^k as the masked softmax backward forms it
(``masked_softmax_grad``, per prefix, from the prefix's stats and positives' count or stats), into the same
products, sums and SIGN_ONLY rule as the plain backward. The plain kernels pass no mask options: every masked
branch is a constexpr False and they compile to the code they had before. The masked kernels' tiling
(:func:`infcl.kernels.tiling.masked_matryoshka_tiling`) halves the backward slices (the masks beside the plain
128-wide slice spilled on sm_80 and sm_100), so a backward walk rebuilds S and the masks twice as often.

GEMM-equivalents per block (D, dims m_k, slices of BLOCK_OUT = 128 features on tensor cores): forward 1 per
direction (symmetric: 2; the plain kernel's symmetric forward takes its column stats from the row walk's
tiles, this one walks the columns too); backward, per walk, one S per slice (ceil(D / BLOCK_OUT)) plus the
products: in each slice, one BLOCK_OUT-wide product per prefix that reaches it. At D = 768, dims (768, 512,
256, 128, 64): 6 + 2.33 per walk, 18.7 in all, against 9 for one plain symmetric loss on sm_90 (256-wide
slices: 1 + 2 x (3 + 1)) and 16.6 for the five prefixes' plain losses one after another: the S recomputed per
slice dominates. The way down is a backward that builds S once per tile and adds each prefix's product into
the gradient in memory (as the sigmoid backward does per chunk; 2 + 2 x 3.25 = 8.5 at that shape), not built:
its read-modify-write traffic wants measuring on a GPU first.

16-bit inputs: the gradient products take float32 operands at "tf32" (10 mantissa bits; float32's exponent
range), the features exactly. In float16, dS^k a^k b^k can fall below the dtype's range (a mean over a large
batch times small probabilities and factors); in bfloat16, its 8 bits cost the gradient of a renormalized
prefix digits: the product's radial part, of the size of the gradient itself, cancels against the
normalization's term (-a^2 c x), and bfloat16 operands left dq 1.5x further from the truth than torch's own
bfloat16 formula in tests/test_matryoshka.py.
"""

from typing import Any, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..contract import MaskOptions, Tensor
from ..masks import MASKED_ROWS, POS_REL
from .kernel_args import mask_kernel_args, matrix_args
from .rank import launch_args, program_lines, tile_at
from .registration import register_op, wrap
from .score_tiles import (
    PTX,
    Dot,
    Matrix,
    Tile,
    dot_operand,
    load_tile,
    load_vector,
    masked_scores,
    score_chunks,
    tile_dot,
)
from .softmax_forward import _empty_partials
from .softmax_mask_tiles import (
    MEAN_POSITIVES,
    ONE_POSITIVE,
    SUM_POSITIVES,
    Masks,
    block_masks,
    load_optional,
    masked_softmax_grad,
    positive_partials,
)
from .softmax_ops import _mask_options as mask_options
from .tile_stats import kept_rest_stats, merge_kept_stats, merge_rest_stats, softmax_grad, tile_rest_stats

# Partials per line and prefix of the forward: the stats (max, rest) and, by rows, the positive logit.
FORWARD_ROWS = 3
# Partials per line and prefix of the backward's slice-0 programs: sum dS_row * u and sum dS_col * u.
SUM_ROWS = 2


class PrefixArgs(NamedTuple):
    """The prefixes as a kernel reads them: ``bounds_ptr`` [K + 1] int32 (0, m_1, ..., m_K), their count K and
    each side's factors [K, n] (rows ``stride_qf`` / ``stride_kf`` apart, each contiguous)."""

    bounds_ptr: Any
    count: Any
    q_factor_ptr: Any
    k_factor_ptr: Any
    stride_qf: Any
    stride_kf: Any


class Operands(NamedTuple):
    """A Matryoshka kernel's operands: q and k (:class:`Matrix` each), the prefixes (:class:`PrefixArgs`), the
    scale (a 0-d tensor, read in the kernel) and each row's positive column in the block (-1: none)."""

    q: Any
    k: Any
    prefixes: Any
    scale_ptr: Any
    pos_ptr: Any


@triton.jit
def _walk(ops, tile, BY_COLUMN: tl.constexpr):
    """A program's walk (:func:`~infcl.kernels.rank.program_lines` over q's and k's rows): (lines, n_lines,
    n_other, step, ok: the lines that exist)."""
    lines, n_lines, n_other, step = program_lines(ops.q.n, ops.k.n, BY_COLUMN, tile.BLOCK_M, tile.BLOCK_N)
    return lines, n_lines, n_other, step, lines < n_lines


@triton.jit
def _prefix_tile(ops, p, lo, raw, rows, cols, scale, tile, dot):
    """Prefix ``p`` on the tile, from prefix p - 1's raw product ``raw`` and end ``lo`` (0 and 0 for p = 0):
    (raw^p, m_p, u, s, a, b). raw^p = raw + q[rows, lo:m_p] @ k[cols, lo:m_p].T
    (:func:`~infcl.kernels.score_tiles.score_chunks` on the segment's columns, features past m_p read 0,
    continuing ``raw`` in the products' own accumulator); a (rows) and b (columns) its factors,
    u = (raw^p * a) * b and s = scale * u, -inf outside the block. Both walks, forward and backward, step
    through the prefixes here: every kernel forms the same S^p."""
    prefixes = ops.prefixes
    hi = tl.load(prefixes.bounds_ptr + p + 1)
    q, k = ops.q, ops.k
    raw = score_chunks(
        Matrix(q.ptr + lo.to(tl.int64) * q.stride_c, q.n, hi - lo, q.stride_r, q.stride_c),
        Matrix(k.ptr + lo.to(tl.int64) * k.stride_c, k.n, hi - lo, k.stride_r, k.stride_c),
        rows,
        cols,
        tile,
        dot,
        raw=raw,
    )
    a = load_vector(prefixes.q_factor_ptr + p * prefixes.stride_qf, rows, q.n, 1, 1.0, True)
    b = load_vector(prefixes.k_factor_ptr + p * prefixes.stride_kf, cols, k.n, 1, 1.0, True)
    u = raw * a[:, None] * b[None, :]
    return raw, hi, u, masked_scores(u, scale, rows, cols, q.n, k.n, True, True), a, b


@triton.jit
def _matryoshka_forward_kernel(
    q_ptr,
    k_ptr,
    scale_ptr,
    pos_ptr,
    bounds_ptr,
    q_factor_ptr,
    k_factor_ptr,
    out_ptr,
    n_q,
    n_k,
    D,
    K,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_qf,
    stride_kf,
    BY_COLUMN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    _forward_lines(
        Operands(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            PrefixArgs(bounds_ptr, K, q_factor_ptr, k_factor_ptr, stride_qf, stride_kf),
            scale_ptr,
            pos_ptr,
        ),
        out_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
        Dot(ACC, UPCAST, PRECISION),
        # No mask options: every masked branch below is a constexpr False, so this kernel compiles as it did
        # before they existed.
        Masks(pos_ptr, None, None, None, None, None, None, None, None, False, False, ONE_POSITIVE, False, False, False),
        BY_COLUMN,
    )


@triton.jit
def _masked_matryoshka_forward_kernel(
    q_ptr,
    k_ptr,
    scale_ptr,
    pos_ptr,
    bounds_ptr,
    q_factor_ptr,
    k_factor_ptr,
    out_ptr,
    n_q,
    n_k,
    D,
    K,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_qf,
    stride_kf,
    q_ids_ptr,
    k_ids_ptr,
    gq_ptr,
    gk_ptr,
    row_thr_ptr,
    col_thr_ptr,
    DG,
    stride_gq,
    stride_gk,
    BY_COLUMN: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    POSITIVES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
):
    # The mask options given (absent inputs come as None; :func:`infcl.kernels.kernel_args.mask_kernel_args`).
    HAS_IDS: tl.constexpr = q_ids_ptr is not None
    HAS_GUIDE: tl.constexpr = gq_ptr is not None
    GUIDE_ACC: tl.constexpr = gq_ptr.dtype.element_ty if HAS_GUIDE else tl.float32
    _forward_lines(
        Operands(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            PrefixArgs(bounds_ptr, K, q_factor_ptr, k_factor_ptr, stride_qf, stride_kf),
            scale_ptr,
            pos_ptr,
        ),
        out_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
        Dot(ACC, UPCAST, PRECISION),
        Masks(
            pos_ptr,
            q_ids_ptr,
            k_ids_ptr,
            row_thr_ptr,
            col_thr_ptr,
            Matrix(gq_ptr, n_q, DG, stride_gq, 1),
            Matrix(gk_ptr, n_k, DG, stride_gk, 1),
            Tile(BLOCK_M, BLOCK_N, BLOCK_G, True, True, not EVEN_G),
            Dot(GUIDE_ACC, False, GUIDE_PRECISION),
            HAS_IDS,
            HAS_GUIDE,
            POSITIVES,
            False,
            SYMMETRIC,
            False,
        ),
        BY_COLUMN,
    )


@triton.jit
def _tile_masks(masks, rows, cols):
    """(positive, excluded_rows, excluded_cols) of one tile (:func:`infcl.kernels.softmax_mask_tiles.block_masks`:
    the ids and, with a guide, one guide product over D'), formed once for every prefix from its rows' positive
    column, ids and thresholds."""
    n_q = masks.gq.n
    pos = load_vector(masks.pos_ptr, rows, n_q, 1, -1, True)
    q_ids = load_optional(masks.q_ids_ptr, rows, n_q, masks.HAS_IDS, True)
    row_thr = load_optional(masks.row_thr_ptr, rows, n_q, masks.HAS_GUIDE, True)
    return block_masks(masks, rows, cols, pos, q_ids, row_thr)


@triton.jit
def _forward_lines(ops, out_ptr, tile, dot, masks, BY_COLUMN: tl.constexpr):
    """The forward program's lines (rows, or BY_COLUMN columns): every prefix's stats (and, by rows, positive
    logit), merged tile by tile into ``out_ptr`` [3, K, n] (max, rest, positive; from the empty set's
    (-inf, -1, 0)), which this program alone reads and writes. With mask options (``masks``: HAS_IDS or
    HAS_GUIDE) the tile's positives and exclusions are formed once and every prefix's masked partials are
    merged into ``out_ptr`` [6, K, n] (:func:`_merge_masked_prefix`)."""
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    AXIS: tl.constexpr = 0 if BY_COLUMN else 1  # the tile's axis along a line
    MASKED: tl.constexpr = masks.HAS_IDS or masks.HAS_GUIDE
    count = ops.prefixes.count
    lines, n_lines, n_other, step, ok = _walk(ops, tile, BY_COLUMN)
    scale = tl.load(ops.scale_ptr)  # a device tensor, not a launch argument: no host sync, no fp32 rounding
    if BY_COLUMN or MASKED:
        pos = lines  # unused: the columns' positives are the rows' (the host scatters them); masked: the tile's
    else:
        pos = load_vector(ops.pos_ptr, lines, ops.q.n, 1, -1, True)
    for o0 in range(0, n_other, step):
        rows, cols = tile_at(lines, o0, BY_COLUMN, BLOCK_M, BLOCK_N)
        if MASKED:
            tile_masks = _tile_masks(masks, rows, cols)
        raw = tl.zeros([BLOCK_M, BLOCK_N], dtype=dot.ACC)
        hi = tl.load(ops.prefixes.bounds_ptr)
        for p in range(count):
            raw, hi, _, s, _, _ = _prefix_tile(ops, p, hi, raw, rows, cols, scale, tile, dot)
            at = out_ptr + p * n_lines.to(tl.int64) + lines  # [R, K, n]: stat rows K * n apart
            if MASKED:
                _merge_masked_prefix(at, count * n_lines, ok, s, tile_masks, masks, BY_COLUMN)
            else:
                tile_max, tile_rest = tile_rest_stats(s, AXIS)
                run_max = tl.load(at, mask=ok, other=float("-inf"))
                run_rest = tl.load(at + count * n_lines, mask=ok, other=-1.0)
                run_max, run_rest = merge_rest_stats(run_max, run_rest, tile_max, tile_rest)
                tl.store(at, run_max, mask=ok)
                tl.store(at + count * n_lines, run_rest, mask=ok)
                if not BY_COLUMN:
                    hit = tl.sum(tl.where(cols[None, :] == pos[:, None], s, 0.0), axis=1)
                    at_pos = at + 2 * count * n_lines
                    tl.store(at_pos, tl.load(at_pos, mask=ok, other=0.0) + hit, mask=ok)


@triton.jit
def _merge_masked_prefix(at, stride, ok, s, tile_masks, masks, BY_COLUMN: tl.constexpr):
    """Merge one prefix's tile ``s`` into its lines' masked partials at ``at`` (rows ``stride`` apart, the rows
    of :mod:`infcl.masks`, rest in place of rel; read, merged, written back: the program owns them): the stats
    over the entries its lines keep (rows: excluded_rows, columns: excluded_cols), the positives' max (and,
    "sum", rest), the sum of their logits and their count
    (:func:`infcl.kernels.softmax_mask_tiles.positive_partials`)."""
    AXIS: tl.constexpr = 0 if BY_COLUMN else 1
    POSITIVES: tl.constexpr = masks.POSITIVES
    EXCLUDES: tl.constexpr = masks.HAS_GUIDE or (masks.HAS_IDS and POSITIVES == ONE_POSITIVE)
    positive, excluded_rows, excluded_cols = tile_masks
    kept = s
    if EXCLUDES:
        if BY_COLUMN:
            kept = tl.where(excluded_cols, float("-inf"), s)
        else:
            kept = tl.where(excluded_rows, float("-inf"), s)
    tile_max, tile_rest = kept_rest_stats(kept, AXIS)
    run_max = tl.load(at, mask=ok, other=float("-inf"))
    run_rest = tl.load(at + stride, mask=ok, other=-1.0)
    run_max, run_rest = merge_kept_stats(run_max, run_rest, tile_max, tile_rest)
    tl.store(at, run_max, mask=ok)
    tl.store(at + stride, run_rest, mask=ok)
    pos_max = tl.load(at + 2 * stride, mask=ok, other=float("-inf"))
    pos_rest = tl.load(at + 3 * stride, mask=ok, other=-1.0)
    pos_sum = tl.load(at + 4 * stride, mask=ok, other=0.0)
    pos_count = tl.load(at + 5 * stride, mask=ok, other=0.0)
    pos_max, pos_rest, pos_sum, pos_count = positive_partials(
        s, positive, pos_max, pos_rest, pos_sum, pos_count, AXIS, POSITIVES
    )
    tl.store(at + 2 * stride, pos_max, mask=ok)
    tl.store(at + 3 * stride, pos_rest, mask=ok)
    tl.store(at + 4 * stride, pos_sum, mask=ok)
    tl.store(at + 5 * stride, pos_count, mask=ok)


@triton.jit
def _prefix_grad(s, stats_ptr, g_ptr, idx, n, p, count, is_pos, ROWS: tl.constexpr):
    """g^p (P^p - Y) over the tile along rows (ROWS: each row's stats) or columns, from the lines' global
    (m, r) of prefix ``p`` at stats_ptr [2, K, n] and their upstream gradients g_ptr [K, n]; 0 past n."""
    at = p * n.to(tl.int64)
    m = load_vector(stats_ptr + at, idx, n, 1, 0.0, True)
    r = load_vector(stats_ptr + count * n + at, idx, n, 1, 0.0, True)
    g = load_vector(g_ptr + at, idx, n, 1, 0.0, True)
    if ROWS:
        ds = softmax_grad(s, m[:, None], r[:, None], g[:, None], is_pos, True)
    else:
        ds = softmax_grad(s, m[None, :], r[None, :], g[None, :], is_pos, True)
    return ds


@triton.jit
def _matryoshka_backward_kernel(
    q_ptr,
    k_ptr,
    scale_ptr,
    pos_ptr,
    bounds_ptr,
    q_factor_ptr,
    k_factor_ptr,
    row_stats_ptr,
    g_row_ptr,
    col_stats_ptr,
    g_col_ptr,
    grad_ptr,
    sums_ptr,
    n_q,
    n_k,
    D,
    K,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_qf,
    stride_kf,
    stride_grad0,
    stride_grad1,
    BY_COLUMN: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    SIGN_ONLY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # 16-bit inputs: the gradient products take float32 operands at tf32 (module docstring); under the interpreter
    # at "ieee", which it computes in float32 anyway.
    GRAD_F32: tl.constexpr = q_ptr.dtype.element_ty.primitive_bitwidth == 16
    GRAD_PRECISION: tl.constexpr = ("tf32" if PTX else "ieee") if GRAD_F32 else PRECISION
    _backward_lines(
        Operands(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            PrefixArgs(bounds_ptr, K, q_factor_ptr, k_factor_ptr, stride_qf, stride_kf),
            scale_ptr,
            pos_ptr,
        ),
        (row_stats_ptr, g_row_ptr, col_stats_ptr, g_col_ptr, None, None),
        Matrix(grad_ptr, n_q if not BY_COLUMN else n_k, D, stride_grad0, stride_grad1),
        sums_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
        Dot(ACC, UPCAST, PRECISION),
        Dot(ACC, UPCAST, GRAD_PRECISION),  # float32 for 16-bit inputs (GRAD_F32), else the inputs' own dtype
        # No mask options: the masked branches are constexpr False (the kernel compiles as before them).
        Masks(pos_ptr, None, None, None, None, None, None, None, None, False, False, ONE_POSITIVE, False, False, False),
        BY_COLUMN,
        SYMMETRIC,
        SIGN_ONLY,
        BLOCK_OUT,
    )


@triton.jit
def _masked_matryoshka_backward_kernel(
    q_ptr,
    k_ptr,
    scale_ptr,
    pos_ptr,
    bounds_ptr,
    q_factor_ptr,
    k_factor_ptr,
    row_stats_ptr,
    g_row_ptr,
    col_stats_ptr,
    g_col_ptr,
    row_pos_ptr,
    col_pos_ptr,
    grad_ptr,
    sums_ptr,
    n_q,
    n_k,
    D,
    K,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_qf,
    stride_kf,
    stride_grad0,
    stride_grad1,
    q_ids_ptr,
    k_ids_ptr,
    gq_ptr,
    gk_ptr,
    row_thr_ptr,
    col_thr_ptr,
    DG,
    stride_gq,
    stride_gk,
    BY_COLUMN: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    SIGN_ONLY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    POSITIVES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
):
    # As _matryoshka_backward_kernel, with the mask options (absent inputs come as None) and each prefix's
    # positives' count [K, n] ("mean") or global stats [2, K, n] ("sum") (row_pos_ptr, col_pos_ptr; None with one
    # positive per row).
    GRAD_F32: tl.constexpr = q_ptr.dtype.element_ty.primitive_bitwidth == 16
    GRAD_PRECISION: tl.constexpr = ("tf32" if PTX else "ieee") if GRAD_F32 else PRECISION
    HAS_IDS: tl.constexpr = q_ids_ptr is not None
    HAS_GUIDE: tl.constexpr = gq_ptr is not None
    GUIDE_ACC: tl.constexpr = gq_ptr.dtype.element_ty if HAS_GUIDE else tl.float32
    _backward_lines(
        Operands(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            PrefixArgs(bounds_ptr, K, q_factor_ptr, k_factor_ptr, stride_qf, stride_kf),
            scale_ptr,
            pos_ptr,
        ),
        (row_stats_ptr, g_row_ptr, col_stats_ptr, g_col_ptr, row_pos_ptr, col_pos_ptr),
        Matrix(grad_ptr, n_q if not BY_COLUMN else n_k, D, stride_grad0, stride_grad1),
        sums_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
        Dot(ACC, UPCAST, PRECISION),
        Dot(ACC, UPCAST, GRAD_PRECISION),
        Masks(
            pos_ptr,
            q_ids_ptr,
            k_ids_ptr,
            row_thr_ptr,
            col_thr_ptr,
            Matrix(gq_ptr, n_q, DG, stride_gq, 1),
            Matrix(gk_ptr, n_k, DG, stride_gk, 1),
            Tile(BLOCK_M, BLOCK_N, BLOCK_G, True, True, not EVEN_G),
            Dot(GUIDE_ACC, False, GUIDE_PRECISION),
            HAS_IDS,
            HAS_GUIDE,
            POSITIVES,
            False,
            SYMMETRIC,
            False,
        ),
        BY_COLUMN,
        SYMMETRIC,
        SIGN_ONLY,
        BLOCK_OUT,
    )


@triton.jit
def _masked_prefix_grad(s, up, idx, n, p, count, positive, excluded, masks, ROWS: tl.constexpr):
    """The masked g^p (P^p - Y) over the tile along rows (ROWS) or columns
    (:func:`infcl.kernels.softmax_mask_tiles.masked_softmax_grad`), from the lines' global (m, r) of prefix ``p``,
    their upstream gradients and, with several positives, their count ("mean") or global stats ("sum"):
    ``up`` = (stats [2, K, n], g [K, n], positives [K, n] or [2, K, n]); 0 past n."""
    POSITIVES: tl.constexpr = masks.POSITIVES
    EXCLUDES: tl.constexpr = masks.HAS_GUIDE or (masks.HAS_IDS and POSITIVES == ONE_POSITIVE)
    at = p * n.to(tl.int64)
    m = load_vector(up[0] + at, idx, n, 1, 0.0, True)
    r = load_vector(up[0] + count * n + at, idx, n, 1, 0.0, True)
    g = load_vector(up[1] + at, idx, n, 1, 0.0, True)
    if POSITIVES == MEAN_POSITIVES:
        pos_count = load_vector(up[2] + at, idx, n, 1, 1.0, True)
        pos_max = pos_count  # unused
        pos_rel = pos_count
    elif POSITIVES == SUM_POSITIVES:
        pos_max = load_vector(up[2] + at, idx, n, 1, 0.0, True)
        pos_rel = load_vector(up[2] + count * n + at, idx, n, 1, 0.0, True)
        pos_count = pos_max  # unused
    else:
        pos_count = m  # unused: one positive per row
        pos_max = m
        pos_rel = m
    if ROWS:
        ds = masked_softmax_grad(
            s,
            (m[:, None], r[:, None], g[:, None]),
            (pos_count[:, None], pos_max[:, None], pos_rel[:, None]),
            positive,
            excluded,
            POSITIVES,
            EXCLUDES,
        )
    else:
        ds = masked_softmax_grad(
            s,
            (m[None, :], r[None, :], g[None, :]),
            (pos_count[None, :], pos_max[None, :], pos_rel[None, :]),
            positive,
            excluded,
            POSITIVES,
            EXCLUDES,
        )
    return ds


@triton.jit
def _backward_lines(
    ops,
    upstream,
    grad_out,
    sums_ptr,
    tile,
    dot,
    grad_dot,
    masks,
    BY_COLUMN: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    SIGN_ONLY: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    """The backward program's lines (rows, or BY_COLUMN columns) and feature slice: their gradient slice (added
    to ``grad_out``) and, from the slice-0 programs, the sums per prefix and line of dS_row * u and dS_col * u
    (``sums_ptr`` [2, K, n], from 0). ``upstream``: (row_stats [2, K, Bq], g_row [K, Bq], col_stats, g_col);
    ``grad_dot``: the gradient products' operand dtype (its ACC: float32 for float16 inputs) and precision.
    SIGN_ONLY: prefix 0 is one wide and renormalized (:meth:`infcl.matryoshka.Prefixes.sign_only`): its
    features' gradient is exactly 0, so it joins no product (its sums, the scale's gradient, stay).
    With mask options (``masks``: HAS_IDS or HAS_GUIDE; ``upstream`` then also holds the rows' and columns'
    positives' inputs) the tile's positives and exclusions are formed once for every prefix and each dS^k is
    the masked softmax's (:func:`_masked_prefix_grad`)."""
    GRAD_F32: tl.constexpr = grad_dot.ACC != ops.q.ptr.dtype.element_ty
    MASKED: tl.constexpr = masks.HAS_IDS or masks.HAS_GUIDE
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    AXIS: tl.constexpr = 0 if BY_COLUMN else 1  # the tile's axis along a line
    n_q = ops.q.n
    n_k = ops.k.n
    count = ops.prefixes.count
    lines, n_lines, n_other, step, ok = _walk(ops, tile, BY_COLUMN)
    f0 = tl.program_id(1) * BLOCK_OUT
    feats = f0 + tl.arange(0, BLOCK_OUT)
    # Every slice recomputes the same dS: the first writes the sums of its lines.
    write_sums = ok & (tl.zeros(lines.shape, tl.int32) + tl.program_id(1) == 0)
    scale = tl.load(ops.scale_ptr)
    grad = tl.zeros([lines.shape[0], BLOCK_OUT], dot.ACC)
    if BY_COLUMN or MASKED:
        pos = lines  # unused: the tile's rows' positives are loaded per tile (masked: with its masks)
    else:
        pos = load_vector(ops.pos_ptr, lines, n_q, 1, -1, True)
    for o0 in range(0, n_other, step):
        rows, cols = tile_at(lines, o0, BY_COLUMN, BLOCK_M, BLOCK_N)
        if MASKED:
            positive, excluded_rows, excluded_cols = _tile_masks(masks, rows, cols)
            is_pos = positive  # unused
        elif BY_COLUMN:
            is_pos = cols[None, :] == load_vector(ops.pos_ptr, rows, n_q, 1, -1, True)[:, None]
        else:
            is_pos = cols[None, :] == pos[:, None]
        raw = tl.zeros([BLOCK_M, BLOCK_N], dtype=dot.ACC)
        hi = tl.load(ops.prefixes.bounds_ptr)
        for p in range(count):
            raw, hi, u, s, a, b = _prefix_tile(ops, p, hi, raw, rows, cols, scale, tile, dot)
            if MASKED:
                row_up = (upstream[0], upstream[1], upstream[4])
                ds = _masked_prefix_grad(s, row_up, rows, n_q, p, count, positive, excluded_rows, masks, True)
            else:
                ds = _prefix_grad(s, upstream[0], upstream[1], rows, n_q, p, count, is_pos, True)
            at = sums_ptr + p * n_lines.to(tl.int64) + lines  # [2, K, n]: rows K * n apart
            part = tl.sum(ds * u, axis=AXIS)
            tl.store(at, tl.load(at, mask=write_sums, other=0.0) + part, mask=write_sums)
            if SYMMETRIC:
                if MASKED:
                    col_up = (upstream[2], upstream[3], upstream[5])
                    ds_col = _masked_prefix_grad(s, col_up, cols, n_k, p, count, positive, excluded_cols, masks, False)
                else:
                    ds_col = _prefix_grad(s, upstream[2], upstream[3], cols, n_k, p, count, is_pos, False)
                at = at + count * n_lines
                part = tl.sum(ds_col * u, axis=AXIS)
                tl.store(at, tl.load(at, mask=write_sums, other=0.0) + part, mask=write_sums)
                ds = ds + ds_col
            holds = hi > f0  # prefix p holds features of this slice: those below hi
            if SIGN_ONLY:
                holds = holds & (p > 0)
            if holds:
                operand = dot_operand(ds * a[:, None] * b[None, :], grad_dot.ACC, grad_dot.PRECISION)
                if BY_COLUMN:
                    other = load_tile(
                        Matrix(ops.q.ptr, n_q, hi, ops.q.stride_r, ops.q.stride_c), rows, feats, True, True
                    )
                    operand = tl.trans(operand)
                else:
                    other = load_tile(
                        Matrix(ops.k.ptr, n_k, hi, ops.k.stride_r, ops.k.stride_c), cols, feats, True, True
                    )
                if GRAD_F32:
                    other = other.to(tl.float32)
                grad = tile_dot(operand, other, grad, grad_dot.UPCAST, grad_dot.PRECISION)
    D = ops.q.d
    mask = ok[:, None] & (feats[None, :] < D)
    ptrs = grad_out.ptr + lines[:, None] * grad_out.stride_r + feats[None, :].to(tl.int64) * grad_out.stride_c
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + scale * grad, mask=mask)


# ---- launchers ----------------------------------------------------------------------------------


def _launch_args(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    bounds: Tensor,
    q_factors: Tensor,
    k_factors: Tensor,
    precision,
    masked: bool = False,
):
    """The rank kernels' arguments (:func:`infcl.kernels.rank.launch_args`: q, k, the S tile of
    :func:`infcl.kernels.tiling.matryoshka_tiling`, or ``masked`` of ``masked_matryoshka_tiling``, tl.dot's
    precision) plus the scale, the prefixes and their factors; the tiling and the accumulation dtype."""
    args, tiling = launch_args(q, k, precision, "masked_matryoshka" if masked else "matryoshka")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_factors, k_factors = (f.to(acc).contiguous() for f in (q_factors, k_factors))
    args.update(
        scale_ptr=scale.to(acc),
        bounds_ptr=bounds.to(torch.int32),
        q_factor_ptr=q_factors,
        k_factor_ptr=k_factors,
        K=bounds.shape[0] - 1,
        stride_qf=q_factors.stride(0),
        stride_kf=k_factors.stride(0),
    )
    return args, tiling, acc


def _masked_args(masks: Optional[MaskOptions], q: Tensor, precision) -> dict:
    """The masked kernels' extra arguments (:func:`infcl.kernels.kernel_args.mask_kernel_args`: the ids, the
    guide and its thresholds at the masked softmax kernels' guide precision, so the guide scores, and the
    exclusions, are theirs); {} for the plain kernels (``masks`` None)."""
    return {} if masks is None else mask_kernel_args(masks, q.dtype, precision)


def _forward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    bounds: Tensor,
    q_factors: Tensor,
    k_factors: Tensor,
    symmetric: bool,
    precision: str,
) -> Tuple[Tensor, Tensor]:
    return _run_forward(q, k, scale, pos, bounds, q_factors, k_factors, symmetric, precision)


def _run_forward(q, k, scale, pos, bounds, q_factors, k_factors, symmetric, precision, masks=None):
    """The forward ops' one body: the plain kernels' (rows [3, K, Bq], cols [3, K, Bk] or [3, K, 0]) or, with
    ``masks``, the masked kernels' [6, K, n] partials (the rows of :mod:`infcl.masks`): each program owns its
    lines whole (no splits), so they need no merge on the host, only rest -> r."""
    args, tiling, acc = _launch_args(q, k, scale, bounds, q_factors, k_factors, precision or None, masks is not None)
    if masks is not None:
        args.update(_masked_args(masks, q, precision or None), SYMMETRIC=symmetric)
    kernel = _matryoshka_forward_kernel if masks is None else _masked_matryoshka_forward_kernel
    n_rows = FORWARD_ROWS if masks is None else MASKED_ROWS
    count = args["K"]
    out = []
    for by_column, n, block_size in (
        (False, args["n_q"], tiling.forward.block_m),
        (True, args["n_k"], tiling.forward.block_n),
    )[: 2 if symmetric else 1]:
        if masks is None:
            parts = torch.zeros(FORWARD_ROWS, count, n, dtype=acc, device=q.device)
            parts[0].fill_(float("-inf"))
            parts[1].fill_(-1.0)  # rest = -1: the empty set
        else:
            parts = _empty_partials(MASKED_ROWS, count, n, acc, q.device)  # the empty sets, positives' too
        wrap(kernel)[(triton.cdiv(n, block_size),)](pos_ptr=pos, out_ptr=parts, BY_COLUMN=by_column, **args)
        parts[1].log1p_()  # rest -> r = log1p(rest), the contract's form
        if masks is not None:
            parts[POS_REL].log1p_()
        out.append(parts)
    if not symmetric:
        out.append(torch.empty(n_rows, count, 0, dtype=acc, device=q.device))
    return out[0], out[1]


def _forward_fake(q, k, scale, pos, bounds, q_factors, k_factors, symmetric, precision, *masks, rows=FORWARD_ROWS):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    count = bounds.shape[0] - 1
    return (
        q.new_empty(rows, count, q.shape[0], dtype=acc),
        q.new_empty(rows, count, k.shape[0] if symmetric else 0, dtype=acc),
    )


def _backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    bounds: Tensor,
    q_factors: Tensor,
    k_factors: Tensor,
    row_stats: Tensor,
    g_row: Tensor,
    col_stats: Optional[Tensor],
    g_col: Optional[Tensor],
    dq: Tensor,
    dk: Tensor,
    sign_only: bool,
    precision: str,
) -> Tuple[Tensor, Tensor]:
    upstream = (row_stats, g_row, col_stats, g_col)
    return _run_backward(q, k, scale, pos, bounds, q_factors, k_factors, upstream, dq, dk, sign_only, precision)


def _run_backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    bounds: Tensor,
    q_factors: Tensor,
    k_factors: Tensor,
    upstream: Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]],
    dq: Tensor,
    dk: Tensor,
    sign_only: bool,
    precision: str,
    masks: Optional[MaskOptions] = None,
    positives: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
) -> Tuple[Tensor, Tensor]:
    """The backward ops' one body: dq, dk accumulated; (row sums [2, K, Bq], column sums [2, K, Bk]). With
    ``masks``, ``positives``: the rows' and columns' positives' count [K, n] ("mean") or global stats [2, K, n]
    ("sum"), None with one positive per row (columns: None for the one-directional loss)."""
    row_stats, g_row, col_stats, g_col = upstream  # [2, K, n] stats and [K, n] gradients; columns None: one way
    args, tiling, acc = _launch_args(q, k, scale, bounds, q_factors, k_factors, precision or None, masks is not None)
    cfg, dim, count = tiling.dq, args["D"], args["K"]
    block_out = tiling.block_out(cfg, dim)
    symmetric = col_stats is not None
    row_stats = row_stats.to(acc).contiguous()
    g_row = g_row.to(acc).contiguous()
    col_stats = col_stats.to(acc).contiguous() if symmetric else row_stats
    g_col = g_col.to(acc).contiguous() if symmetric else g_row
    if masks is None:
        kernel, extra = _matryoshka_backward_kernel, {}
    else:
        row_pos, col_pos = (None if t is None else t.to(acc).contiguous() for t in positives)
        kernel = _masked_matryoshka_backward_kernel
        extra = dict(
            row_pos_ptr=row_pos,
            col_pos_ptr=col_pos if symmetric else row_pos,
            **_masked_args(masks, q, precision or None),
        )
    sums = []
    # dq from the row walk, dk from the column walk (one direction: of the rows' term alone)
    for by_column, grad, n, block_size in (
        (False, dq, args["n_q"], cfg.block_m),
        (True, dk, args["n_k"], cfg.block_n),
    ):
        part = torch.zeros(SUM_ROWS, count, n, dtype=acc, device=q.device)
        wrap(kernel)[(triton.cdiv(n, block_size), triton.cdiv(dim, block_out))](
            pos_ptr=pos,
            row_stats_ptr=row_stats,
            g_row_ptr=g_row,
            col_stats_ptr=col_stats,
            g_col_ptr=g_col,
            sums_ptr=part,
            **matrix_args("grad", grad),
            BY_COLUMN=by_column,
            SYMMETRIC=symmetric,
            SIGN_ONLY=sign_only,
            BLOCK_OUT=block_out,
            **args,
            **extra,
        )
        sums.append(part)
    return sums[0], sums[1]


def _backward_fake(q, k, scale, pos, bounds, q_factors, k_factors, *rest):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    count = bounds.shape[0] - 1
    return q.new_empty(SUM_ROWS, count, q.shape[0], dtype=acc), q.new_empty(SUM_ROWS, count, k.shape[0], dtype=acc)


def _masked_forward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    bounds: Tensor,
    q_factors: Tensor,
    k_factors: Tensor,
    symmetric: bool,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    guide_q: Optional[Tensor],
    guide_k: Optional[Tensor],
    row_threshold: Optional[Tensor],
    col_threshold: Optional[Tensor],
    multi_positive: str,
    precision: str,
) -> Tuple[Tensor, Tensor]:
    masks = mask_options(q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold, multi_positive)
    return _run_forward(q, k, scale, pos, bounds, q_factors, k_factors, symmetric, precision, masks)


def _masked_forward_fake(q, k, scale, pos, bounds, q_factors, k_factors, symmetric, *rest):
    return _forward_fake(q, k, scale, pos, bounds, q_factors, k_factors, symmetric, "", rows=MASKED_ROWS)


def _masked_backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    bounds: Tensor,
    q_factors: Tensor,
    k_factors: Tensor,
    row_stats: Tensor,
    g_row: Tensor,
    col_stats: Optional[Tensor],
    g_col: Optional[Tensor],
    row_positives: Optional[Tensor],
    col_positives: Optional[Tensor],
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    guide_q: Optional[Tensor],
    guide_k: Optional[Tensor],
    row_threshold: Optional[Tensor],
    col_threshold: Optional[Tensor],
    multi_positive: str,
    dq: Tensor,
    dk: Tensor,
    sign_only: bool,
    precision: str,
) -> Tuple[Tensor, Tensor]:
    masks = mask_options(q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold, multi_positive)
    upstream = (row_stats, g_row, col_stats, g_col)
    positives = (row_positives, col_positives)
    args = (q, k, scale, pos, bounds, q_factors, k_factors, upstream, dq, dk, sign_only, precision)
    return _run_backward(*args, masks, positives)


# The block steps as custom ops (:func:`.registration.register_op`), the scale a 0-d tensor (no host sync) and
# ``precision`` a string ("" for None): torch.ops.infcl.triton_matryoshka_forward_block(q, k, scale, pos, bounds
# [K + 1], q_factors [K, Bq], k_factors [K, Bk], symmetric, precision) -> (rows [3, K, Bq] (m, r, positive
# logit), cols [3, K, Bk] (m, r, 0) or [3, K, 0]); torch.ops.infcl.triton_matryoshka_backward_block(..., row_stats
# [2, K, Bq], g_row [K, Bq], col_stats, g_col (None: one direction), dq!, dk!, sign_only (prefix 0 one wide and
# renormalized: no features' gradient), precision) -> (row sums [2, K, Bq], column sums [2, K, Bk]) of dS_row * u
# and dS_col * u (the scale's gradient and the renormalization's term).
forward_op = register_op("triton_matryoshka_forward_block", _forward, _forward_fake)
backward_op = register_op("triton_matryoshka_backward_block", _backward, _backward_fake, ("dq", "dk"))
# With the mask options (:mod:`infcl.masks`), flat as the masked softmax ops take them
# (:func:`infcl.backends.triton.softmax.op_masks`): torch.ops.infcl.triton_masked_matryoshka_forward_block(q, k,
# scale, pos, bounds, q_factors, k_factors, symmetric, q_ids, k_ids, guide_q, guide_k, row_threshold,
# col_threshold, multi_positive, precision) -> (rows [6, K, Bq], cols [6, K, Bk] or [6, K, 0]), the rows of
# infcl.masks per prefix; torch.ops.infcl.triton_masked_matryoshka_backward_block(q, k, scale, pos, bounds,
# q_factors, k_factors, row_stats, g_row, col_stats, g_col, row_positives, col_positives (count [K, n] for "mean",
# stats [2, K, n] for "sum", else None), the mask options, dq!, dk!, sign_only, precision) -> the sums as above.
masked_forward_op = register_op("triton_masked_matryoshka_forward_block", _masked_forward, _masked_forward_fake)
masked_backward_op = register_op(
    "triton_masked_matryoshka_backward_block", _masked_backward, _backward_fake, ("dq", "dk")
)
