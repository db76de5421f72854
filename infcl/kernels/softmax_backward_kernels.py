"""The softmax backward's two kernels, launched by :func:`infcl.kernels.softmax_backward.softmax_backward`
(whose module says what they compute): ``_dq_kernel`` (a program owns BLOCK_M rows of q and one slice of
dq's feature columns) and ``_dk_kernel`` (BLOCK_N rows of k, one slice of dk); each walks its split of the
other side's blocks and calls one per-tile helper of :mod:`infcl.kernels.softmax_backward_tiles`, plain or masked."""

import triton
import triton.language as tl

from .score_tiles import (
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
    _masked_rows,
    _masked_tile_grads,
    _plain_tile_grads,
    _store_slice,
)
from .tile_stats import positive_span


@triton.jit
def _dq_kernel(
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
    stride_rs0,
    stride_rs1,
    stride_gr,
    stride_cs0,
    stride_cs1,
    stride_gc,
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
    DG,
    stride_gq0,
    stride_gq1,
    stride_gk0,
    stride_gk1,
    stride_rp0,
    stride_rp1,
    stride_cp0,
    stride_cp1,
    SYMMETRIC: tl.constexpr,
    NORMALIZE: tl.constexpr,
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
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_GUIDE: tl.constexpr,
    POSITIVES: tl.constexpr,
    BRANCH_POSITIVES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_ACC: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
    BUCKET: tl.constexpr,  # the autotuner's size key only (0 when not autotuning)
):
    check_blocks(BLOCK_M, BLOCK_N, BLOCK_D)
    tl.static_assert(BLOCK_OUT == BLOCK_D or not ONE_CHUNK)  # one chunk: the k tile of S feeds dq too
    rb = tl.program_id(0)
    out_slice = tl.program_id(1)
    split = tl.program_id(2)
    cb_lo, cb_hi = block_range(split, tl.num_programs(2), tl.cdiv(n_k, BLOCK_N))
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    scale = tl.load(scale_ptr)
    m_r, r_r, g_r = _load_stats(row_stats_ptr, g_row_ptr, rows, n_q, stride_rs0, stride_rs1, stride_gr, not EVEN_M)
    pos = load_vector(pos_ptr, rows, n_q, 1, -1, not EVEN_M).to(tl.int32)
    pos_lo, pos_hi = positive_span(pos)
    if HAS_IDS or HAS_GUIDE:
        q_ids, row_thr, pos_count_r, pos_max_r, pos_rel_r = _masked_rows(
            q_ids_ptr,
            row_thr_ptr,
            row_pos_ptr,
            rows,
            n_q,
            stride_rp0,
            stride_rp1,
            HAS_IDS,
            HAS_GUIDE,
            POSITIVES,
            not EVEN_M,
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
        q_res = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1, not EVEN_M, not EVEN_D)
    else:
        q_res = q_ptr  # unused
    acc = tl.zeros([BLOCK_M, BLOCK_OUT], dtype=ACC)
    dscale_row = tl.zeros([BLOCK_M], dtype=ACC)
    dscale_col = tl.zeros([BLOCK_M], dtype=ACC)
    for cb in range(cb_lo, cb_hi):
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        raw, k_tile = block_scores(
            q_ptr,
            k_ptr,
            q_res,
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
            True,
            not EVEN_M,
            not EVEN_N,
            not EVEN_D,
            ACC,
            UPCAST,
            PRECISION,
        )
        s = masked_scores(raw, scale, rows, cols, n_q, n_k, not EVEN_M, not EVEN_N)
        if SYMMETRIC:
            m_c, r_c, g_c = _load_stats(
                col_stats_ptr, g_col_ptr, cols, n_k, stride_cs0, stride_cs1, stride_gc, not EVEN_N
            )
        else:
            m_c, r_c, g_c = m_r, r_r, g_r  # unused
        if HAS_IDS or HAS_GUIDE:
            if SYMMETRIC:
                pos_count_c, pos_max_c, pos_rel_c = _load_positives(
                    col_pos_ptr, cols, n_k, stride_cp0, stride_cp1, POSITIVES, not EVEN_N
                )
            else:
                pos_count_c, pos_max_c, pos_rel_c = pos_count_r, pos_max_r, pos_rel_r  # unused
            ds_row, ds_col = _masked_tile_grads(
                s,
                rows,
                cols,
                pos,
                q_ids,
                row_thr,
                k_ids_ptr,
                col_thr_ptr,
                gq_ptr,
                gk_ptr,
                n_q,
                n_k,
                DG,
                stride_gq0,
                stride_gq1,
                stride_gk0,
                stride_gk1,
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
                HAS_IDS,
                HAS_GUIDE,
                POSITIVES,
                BLOCK_M,
                BLOCK_N,
                BLOCK_G,
                EVEN_M,
                EVEN_N,
                EVEN_G,
                GUIDE_ACC,
                GUIDE_PRECISION,
            )
        else:
            ds_row, ds_col = _plain_tile_grads(
                s,
                cols,
                cb * BLOCK_N,
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
        dscale_row += tl.sum(ds_row * raw, axis=1)
        ds = ds_row
        if SYMMETRIC:
            dscale_col += tl.sum(ds_col * raw, axis=1)
            ds = ds + ds_col
        if NORMALIZE:
            ds = ds * _inverse(factor)[:, None]
        if ONE_CHUNK:
            k_out = k_tile
        else:
            # A ragged last slice (EVEN_OUT False) reads zeros past D where D is whole chunks (a multiple of 16,
            # which Triton specializes on, so the masked load stays vectorized); at ragged D it repeats the last
            # column (:func:`load_tile`). Either way those columns are never stored. Clamped columns at D = 384
            # spilled sm_90's dk 12-64 B.
            k_out = load_tile(k_ptr, cols, out_feats, n_k, D, stride_k0, stride_k1, not EVEN_N, not EVEN_OUT, EVEN_D)
        acc = tile_dot(dot_operand(ds, q_ptr.dtype.element_ty, PRECISION), k_out, acc, UPCAST, PRECISION)
    _store_slice(
        out_ptr + split.to(tl.int64) * stride_out_split,
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
        slot = dscale_ptr + 2 * (rb.to(tl.int64) * tl.num_programs(2) + split)
        tl.store(slot, tl.sum(dscale_row, axis=0))
        tl.store(slot + 1, tl.sum(dscale_col, axis=0))


@triton.jit
def _dk_kernel(
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
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_rs0,
    stride_rs1,
    stride_gr,
    stride_cs0,
    stride_cs1,
    stride_gc,
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
    DG,
    stride_gq0,
    stride_gq1,
    stride_gk0,
    stride_gk1,
    stride_rp0,
    stride_rp1,
    stride_cp0,
    stride_cp1,
    SYMMETRIC: tl.constexpr,
    NORMALIZE: tl.constexpr,
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
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_GUIDE: tl.constexpr,
    POSITIVES: tl.constexpr,
    BRANCH_POSITIVES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_ACC: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
    BUCKET: tl.constexpr,
):
    check_blocks(BLOCK_M, BLOCK_N, BLOCK_D)
    tl.static_assert(BLOCK_OUT == BLOCK_D or not ONE_CHUNK)  # one chunk: the q tile of S feeds dk too
    cb = tl.program_id(0)
    out_slice = tl.program_id(1)
    split = tl.program_id(2)
    rb_lo, rb_hi = block_range(split, tl.num_programs(2), tl.cdiv(n_q, BLOCK_M))
    cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    scale = tl.load(scale_ptr)
    if SYMMETRIC:
        m_c, r_c, g_c = _load_stats(col_stats_ptr, g_col_ptr, cols, n_k, stride_cs0, stride_cs1, stride_gc, not EVEN_N)
    if HAS_IDS or HAS_GUIDE:
        if SYMMETRIC:
            pos_count_c, pos_max_c, pos_rel_c = _load_positives(
                col_pos_ptr, cols, n_k, stride_cp0, stride_cp1, POSITIVES, not EVEN_N
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
        k_res = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1, not EVEN_N, not EVEN_D)
    else:
        k_res = k_ptr  # unused
    acc = tl.zeros([BLOCK_N, BLOCK_OUT], dtype=ACC)
    for rb in range(rb_lo, rb_hi):
        rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_r, r_r, g_r = _load_stats(row_stats_ptr, g_row_ptr, rows, n_q, stride_rs0, stride_rs1, stride_gr, not EVEN_M)
        pos = load_vector(pos_ptr, rows, n_q, 1, -1, not EVEN_M).to(tl.int32)
        raw, q_tile = block_scores(
            q_ptr,
            k_ptr,
            k_res,
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
            False,
            not EVEN_M,
            not EVEN_N,
            not EVEN_D,
            ACC,
            UPCAST,
            PRECISION,
        )
        s = masked_scores(raw, scale, rows, cols, n_q, n_k, not EVEN_M, not EVEN_N)
        if not SYMMETRIC:
            m_c, r_c, g_c = m_r, r_r, g_r  # unused
        if HAS_IDS or HAS_GUIDE:
            q_ids, row_thr, pos_count_r, pos_max_r, pos_rel_r = _masked_rows(
                q_ids_ptr,
                row_thr_ptr,
                row_pos_ptr,
                rows,
                n_q,
                stride_rp0,
                stride_rp1,
                HAS_IDS,
                HAS_GUIDE,
                POSITIVES,
                not EVEN_M,
            )
            if not SYMMETRIC:
                pos_count_c, pos_max_c, pos_rel_c = pos_count_r, pos_max_r, pos_rel_r  # unused
            ds_row, ds_col = _masked_tile_grads(
                s,
                rows,
                cols,
                pos,
                q_ids,
                row_thr,
                k_ids_ptr,
                col_thr_ptr,
                gq_ptr,
                gk_ptr,
                n_q,
                n_k,
                DG,
                stride_gq0,
                stride_gq1,
                stride_gk0,
                stride_gk1,
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
                HAS_IDS,
                HAS_GUIDE,
                POSITIVES,
                BLOCK_M,
                BLOCK_N,
                BLOCK_G,
                EVEN_M,
                EVEN_N,
                EVEN_G,
                GUIDE_ACC,
                GUIDE_PRECISION,
            )
        else:
            pos_lo, pos_hi = positive_span(pos)
            ds_row, ds_col = _plain_tile_grads(
                s,
                cols,
                cb * BLOCK_N,
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
        ds = ds_row + ds_col
        if NORMALIZE:
            ds = ds * _inverse(factor)[None, :]
        if ONE_CHUNK:
            q_out = q_tile
        else:  # a ragged last slice as in _dq_kernel
            q_out = load_tile(q_ptr, rows, out_feats, n_q, D, stride_q0, stride_q1, not EVEN_M, not EVEN_OUT, EVEN_D)
        acc = tile_dot(tl.trans(dot_operand(ds, q_ptr.dtype.element_ty, PRECISION)), q_out, acc, UPCAST, PRECISION)
    _store_slice(
        out_ptr + split.to(tl.int64) * stride_out_split,
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
