"""The softmax backward's one kernel, launched by :func:`infcl.kernels.softmax_backward.softmax_backward` (whose
module says what it computes) once per direction: ``BY_COLUMN`` False, dq (a program owns BLOCK_M rows of q
and one slice of dq's feature columns), True, dk (BLOCK_N rows of k, one slice of dk). A program walks its
split of the other side's blocks and calls one per-tile helper of :mod:`infcl.kernels.softmax_backward_tiles`,
plain or masked; a masked tile's positives and exclusions are formed here, where they are used.

Every S tile is built in the one orientation (q rows by k rows, :func:`infcl.kernels.score_tiles.block_scores`),
whichever side the program owns, so S is bit-identical to the forward's in both directions; dk transposes dS
for its product."""

import triton
import triton.language as tl

from .score_tiles import (
    PTX,
    block_range,
    block_scores,
    check_blocks,
    dot_operand,
    load_tile,
    load_vector,
    masked_scores,
    tile_dot,
)
from .softmax_backward_tiles import (
    _inverse,
    _load_positives,
    _load_stats,
    _masked_tile_grads,
    _plain_tile_grads,
    _store_slice,
)
from .softmax_mask_tiles import ONE_POSITIVE, block_masks, load_optional
from .tile_stats import positive_span


@triton.jit
def _backward_kernel(
    q_ptr,
    k_ptr,
    scale_ptr,
    pos_ptr,
    row_stats_ptr,
    g_row_ptr,
    col_stats_ptr,
    g_col_ptr,
    g_max_ptr,
    out_ptr,
    dscale_ptr,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_row_stats,
    stride_col_stats,
    stride_out_split,
    stride_out0,
    stride_out1,
    q_ids_ptr,
    k_ids_ptr,
    gq_ptr,
    gk_ptr,
    row_thr_ptr,
    col_thr_ptr,
    row_pos_ptr,
    col_pos_ptr,
    stride_row_pos,
    stride_col_pos,
    DG,
    stride_gq,
    stride_gk,
    BY_COLUMN: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    ADD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_OUT: tl.constexpr,
    PRECISION: tl.constexpr,
    POSITIVES: tl.constexpr,
    BRANCH_POSITIVES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
    BUCKET: tl.constexpr,  # the autotuner's size key only (0 when not autotuning)
):
    # What the launch's inputs say: the mask options given (absent inputs come as None), the accumulation
    # dtype (scale's: float32, float64 for float64 inputs), the guide's, and whether the interpreter upcasts
    # 16-bit operands (score_tiles.tile_dot).
    HAS_IDS: tl.constexpr = q_ids_ptr is not None
    HAS_GUIDE: tl.constexpr = gq_ptr is not None
    ACC: tl.constexpr = scale_ptr.dtype.element_ty
    GUIDE_ACC: tl.constexpr = gq_ptr.dtype.element_ty if HAS_GUIDE else tl.float32
    UPCAST: tl.constexpr = not PTX and q_ptr.dtype.element_ty.primitive_bitwidth == 16
    NORMALIZE: tl.constexpr = q_ptr.dtype.element_ty == tl.float16  # float16: dS is normalized
    check_blocks(BLOCK_M, BLOCK_N, BLOCK_D)
    tl.static_assert(BLOCK_OUT == BLOCK_D or not ONE_CHUNK)  # one chunk: the other side's tile of S feeds the product
    owned = tl.program_id(0)
    out_slice = tl.program_id(1)
    split = tl.program_id(2)
    if BY_COLUMN:  # the program's columns and their stats; it walks the row blocks of its split
        lo, hi = block_range(split, tl.num_programs(2), tl.cdiv(n_q, BLOCK_M))
        cols = owned * BLOCK_N + tl.arange(0, BLOCK_N)
        scale = tl.load(scale_ptr)
        if SYMMETRIC:
            m_c, r_c, g_c = _load_stats(col_stats_ptr, g_col_ptr, cols, n_k, stride_col_stats, not EVEN_N)
            if HAS_IDS or HAS_GUIDE:
                pos_count_c, pos_max_c, pos_rel_c = _load_positives(
                    col_pos_ptr, cols, n_k, stride_col_pos, POSITIVES, not EVEN_N
                )
        if NORMALIZE:  # float16: each dS column is divided by the largest |g| that reaches it
            factor = tl.zeros([BLOCK_N], dtype=ACC) + tl.load(g_max_ptr)
            if SYMMETRIC:
                factor = tl.maximum(factor, tl.abs(g_c))
        else:
            factor = scale  # unused
        feats = tl.arange(0, BLOCK_D)
        out_feats = out_slice * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        if ONE_CHUNK:
            resident = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, not EVEN_N, not EVEN_D)
        else:
            resident = k_ptr  # unused
        acc = tl.zeros([BLOCK_N, BLOCK_OUT], dtype=ACC)
    else:  # the program's rows and their stats; it walks the column blocks of its split
        lo, hi = block_range(split, tl.num_programs(2), tl.cdiv(n_k, BLOCK_N))
        rows = owned * BLOCK_M + tl.arange(0, BLOCK_M)
        scale = tl.load(scale_ptr)
        m_r, r_r, g_r = _load_stats(row_stats_ptr, g_row_ptr, rows, n_q, stride_row_stats, not EVEN_M)
        pos = load_vector(pos_ptr, rows, n_q, 1, -1, not EVEN_M).to(tl.int32)
        pos_lo, pos_hi = positive_span(pos)
        if HAS_IDS or HAS_GUIDE:
            q_ids = load_optional(q_ids_ptr, rows, n_q, HAS_IDS, not EVEN_M)
            row_thr = load_optional(row_thr_ptr, rows, n_q, HAS_GUIDE, not EVEN_M)
            pos_count_r, pos_max_r, pos_rel_r = _load_positives(
                row_pos_ptr, rows, n_q, stride_row_pos, POSITIVES, not EVEN_M
            )
        if NORMALIZE:  # float16: each dS row is divided by the largest |g| that reaches it
            factor = tl.abs(g_r)
            if SYMMETRIC:
                factor = tl.maximum(factor, tl.load(g_max_ptr + 1))
        else:
            factor = g_r  # unused
        feats = tl.arange(0, BLOCK_D)
        out_feats = out_slice * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        if ONE_CHUNK:
            resident = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1, not EVEN_M, not EVEN_D)
        else:
            resident = q_ptr  # unused
        acc = tl.zeros([BLOCK_M, BLOCK_OUT], dtype=ACC)
        dscale_row = tl.zeros([BLOCK_M], dtype=ACC)
        dscale_col = tl.zeros([BLOCK_M], dtype=ACC)
    for other in range(lo, hi):
        if BY_COLUMN:
            rows = other * BLOCK_M + tl.arange(0, BLOCK_M)
            m_r, r_r, g_r = _load_stats(row_stats_ptr, g_row_ptr, rows, n_q, stride_row_stats, not EVEN_M)
            pos = load_vector(pos_ptr, rows, n_q, 1, -1, not EVEN_M).to(tl.int32)
        else:
            col0 = other * BLOCK_N
            cols = col0 + tl.arange(0, BLOCK_N)
        raw, chunk = block_scores(
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
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            ONE_CHUNK,
            not BY_COLUMN,
            not EVEN_M,
            not EVEN_N,
            not EVEN_D,
            ACC,
            UPCAST,
            PRECISION,
        )
        s = masked_scores(raw, scale, rows, cols, n_q, n_k, not EVEN_M, not EVEN_N)
        if SYMMETRIC and not BY_COLUMN:
            m_c, r_c, g_c = _load_stats(col_stats_ptr, g_col_ptr, cols, n_k, stride_col_stats, not EVEN_N)
        if HAS_IDS or HAS_GUIDE:
            if BY_COLUMN:
                q_ids = load_optional(q_ids_ptr, rows, n_q, HAS_IDS, not EVEN_M)
                row_thr = load_optional(row_thr_ptr, rows, n_q, HAS_GUIDE, not EVEN_M)
                pos_count_r, pos_max_r, pos_rel_r = _load_positives(
                    row_pos_ptr, rows, n_q, stride_row_pos, POSITIVES, not EVEN_M
                )
            elif SYMMETRIC:
                pos_count_c, pos_max_c, pos_rel_c = _load_positives(
                    col_pos_ptr, cols, n_k, stride_col_pos, POSITIVES, not EVEN_N
                )
            positive, excluded_rows, excluded_cols = block_masks(
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
                stride_gq,
                stride_gk,
                HAS_IDS,
                HAS_GUIDE,
                POSITIVES,
                SYMMETRIC,
                BLOCK_M,
                BLOCK_N,
                BLOCK_G,
                EVEN_M,
                EVEN_N,
                EVEN_G,
                GUIDE_ACC,
                GUIDE_PRECISION,
            )
            if not SYMMETRIC:
                m_c, r_c, g_c, pos_count_c, pos_max_c, pos_rel_c = m_r, r_r, g_r, pos_count_r, pos_max_r, pos_rel_r
            ds_row, ds_col = _masked_tile_grads(
                s,
                positive,
                excluded_rows,
                excluded_cols,
                m_r,
                r_r,
                g_r,
                pos_count_r,
                pos_max_r,
                pos_rel_r,
                m_c,
                r_c,
                g_c,
                pos_count_c,
                pos_max_c,
                pos_rel_c,
                SYMMETRIC,
                POSITIVES,
                HAS_GUIDE or (HAS_IDS and POSITIVES == ONE_POSITIVE),
            )
        else:
            if BY_COLUMN:
                col0 = owned * BLOCK_N
                pos_lo, pos_hi = positive_span(pos)
            if not SYMMETRIC:
                m_c, r_c, g_c = m_r, r_r, g_r  # unused
            ds_row, ds_col = _plain_tile_grads(
                s,
                cols,
                col0,
                pos,
                pos_lo,
                pos_hi,
                m_r,
                r_r,
                g_r,
                m_c,
                r_c,
                g_c,
                SYMMETRIC,
                BLOCK_N,
                BRANCH_POSITIVES,
            )
        if BY_COLUMN:
            ds = ds_row + ds_col
            if NORMALIZE:
                ds = ds * _inverse(factor)[None, :]
            if ONE_CHUNK:
                q_out = chunk
            else:  # a ragged last slice as below
                q_out = load_tile(
                    q_ptr, rows, out_feats, n_q, D, stride_q0, stride_q1, not EVEN_M, not EVEN_OUT, EVEN_D
                )
            acc = tile_dot(tl.trans(dot_operand(ds, q_ptr.dtype.element_ty, PRECISION)), q_out, acc, UPCAST, PRECISION)
        else:
            dscale_row += tl.sum(ds_row * raw, axis=1)
            ds = ds_row
            if SYMMETRIC:
                dscale_col += tl.sum(ds_col * raw, axis=1)
                ds = ds + ds_col
            if NORMALIZE:
                ds = ds * _inverse(factor)[:, None]
            if ONE_CHUNK:
                k_out = chunk
            else:
                # A ragged last slice (EVEN_OUT False) reads zeros past D where D is whole chunks (a multiple of
                # 16, which Triton specializes on, so the masked load stays vectorized); at ragged D it repeats
                # the last column (:func:`load_tile`). Either way those columns are never stored. Clamped columns
                # at D = 384 spilled sm_90's dk 12-64 B.
                k_out = load_tile(
                    k_ptr, cols, out_feats, n_k, D, stride_k0, stride_k1, not EVEN_N, not EVEN_OUT, EVEN_D
                )
            acc = tile_dot(dot_operand(ds, q_ptr.dtype.element_ty, PRECISION), k_out, acc, UPCAST, PRECISION)
    # A split's partial follows the one before it: [splits, n, D] (one split: the caller's gradient itself).
    if BY_COLUMN:
        part = out_ptr + split.to(tl.int64) * stride_out_split
        _store_slice(
            part,
            cols,
            out_feats,
            n_k,
            D,
            stride_out0,
            stride_out1,
            acc,
            scale,
            factor,
            NORMALIZE,
            ADD,
            not EVEN_N,
            not EVEN_OUT,
        )
    else:
        part = out_ptr + split.to(tl.int64) * stride_out_split
        _store_slice(
            part,
            rows,
            out_feats,
            n_q,
            D,
            stride_out0,
            stride_out1,
            acc,
            scale,
            factor,
            NORMALIZE,
            ADD,
            not EVEN_M,
            not EVEN_OUT,
        )
        if out_slice == 0:
            slot = dscale_ptr + 2 * (owned.to(tl.int64) * tl.num_programs(2) + split)
            tl.store(slot, tl.sum(dscale_row, axis=0))
            tl.store(slot + 1, tl.sum(dscale_col, axis=0))
