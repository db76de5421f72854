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
The shared steps (:func:`_prefix_tile`, :func:`_forward_lines`, :func:`_backward_lines`, :func:`_tile_masks`) are
in :mod:`infcl.kernels.matryoshka_tiles`; the launchers and the custom ops in :mod:`infcl.kernels.matryoshka_ops`.

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

import triton
import triton.language as tl

from .matryoshka_tiles import Operands, Outputs, PrefixArgs, _backward_lines, _forward_lines
from .score_tiles import (
    PTX,
    Dot,
    Matrix,
    Tile,
)
from .softmax_mask_tiles import (
    ONE_POSITIVE,
    Masks,
)

# Partials per line and prefix of the forward: the stats (max, rest) and, by rows, the positive logit.
FORWARD_ROWS = 3


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
        Outputs(
            Matrix(grad_ptr, n_q if not BY_COLUMN else n_k, D, stride_grad0, stride_grad1),
            Dot(ACC, UPCAST, GRAD_PRECISION),  # float32 for 16-bit inputs (GRAD_F32), else the inputs' own dtype
            sums_ptr,
        ),
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
        Dot(ACC, UPCAST, PRECISION),
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
        Outputs(
            Matrix(grad_ptr, n_q if not BY_COLUMN else n_k, D, stride_grad0, stride_grad1),
            Dot(ACC, UPCAST, GRAD_PRECISION),
            sums_ptr,
        ),
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
        SYMMETRIC,
        SIGN_ONLY,
        BLOCK_OUT,
    )
