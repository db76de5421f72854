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
    Dot,
    Matrix,
    Tile,
    block_range,
    block_scores,
    dot_operand,
    load_tile,
    load_vector,
    masked_scores,
    tile_dot,
)
from .softmax_backward_tiles import (
    GradSlices,
    Upstream,
    _inverse,
    _load_positives,
    _load_stats,
    _load_uniform,
    _masked_tile_grads,
    _plain_tile_grads,
    _store_slice,
)
from .softmax_mask_tiles import ONE_POSITIVE, Masks, block_masks, load_optional
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
    row_uniform_ptr,
    col_uniform_ptr,
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
    # 16-bit operands (score_tiles.tile_dot). The operands, tiles and dots are packed here, once, as the
    # arguments of the program's body (a tuple assigned to a name would turn its constexprs into tensors).
    HAS_IDS: tl.constexpr = q_ids_ptr is not None
    HAS_GUIDE: tl.constexpr = gq_ptr is not None
    KEPT_SUMS: tl.constexpr = row_uniform_ptr is not None  # label smoothing's uniform weights (softmax_mask_tiles)
    NORMALIZE: tl.constexpr = q_ptr.dtype.element_ty == tl.float16  # float16: dS is normalized
    UPCAST: tl.constexpr = not PTX and q_ptr.dtype.element_ty.primitive_bitwidth == 16
    ACC: tl.constexpr = scale_ptr.dtype.element_ty
    GUIDE_ACC: tl.constexpr = gq_ptr.dtype.element_ty if HAS_GUIDE else tl.float32
    tl.static_assert(BLOCK_OUT == BLOCK_D or not ONE_CHUNK)  # one chunk: the other side's tile of S feeds the product
    _backward_program(
        Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
        Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
        Masks(
            pos_ptr,
            q_ids_ptr,
            k_ids_ptr,
            row_thr_ptr,
            col_thr_ptr,
            Matrix(gq_ptr, n_q, DG, stride_gq, 1),
            Matrix(gk_ptr, n_k, DG, stride_gk, 1),
            Tile(BLOCK_M, BLOCK_N, BLOCK_G, not EVEN_M, not EVEN_N, not EVEN_G),
            Dot(GUIDE_ACC, False, GUIDE_PRECISION),
            HAS_IDS,
            HAS_GUIDE,
            POSITIVES,
            BRANCH_POSITIVES,
            SYMMETRIC,
            KEPT_SUMS,
        ),
        Upstream(row_stats_ptr, stride_row_stats, g_row_ptr, row_pos_ptr, stride_row_pos, row_uniform_ptr),
        Upstream(col_stats_ptr, stride_col_stats, g_col_ptr, col_pos_ptr, stride_col_pos, col_uniform_ptr),
        GradSlices(
            out_ptr,
            stride_out_split,
            stride_out0,
            stride_out1,
            dscale_ptr,
            g_max_ptr,
            BLOCK_OUT,
            EVEN_OUT,
            ADD,
            NORMALIZE,
        ),
        scale_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, not EVEN_M, not EVEN_N, not EVEN_D, ONE_CHUNK),
        Dot(ACC, UPCAST, PRECISION),
        BY_COLUMN,
    )


@triton.jit
def _backward_program(q, k, masks, row_up, col_up, out, scale_ptr, tile, dot, BY_COLUMN: tl.constexpr):
    """Program (owned block, output slice, split)'s walk: dq (BY_COLUMN False) or dk of its block, over the
    other side's blocks of its split; ``row_up`` / ``col_up``: the rows' and columns' stats, upstream
    gradients and positives (:class:`Upstream`); ``out``: the gradient's slices (:class:`GradSlices`)."""
    HAS_IDS: tl.constexpr = masks.HAS_IDS
    HAS_GUIDE: tl.constexpr = masks.HAS_GUIDE
    POSITIVES: tl.constexpr = masks.POSITIVES
    SYMMETRIC: tl.constexpr = masks.SYMMETRIC
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    BLOCK_OUT: tl.constexpr = out.BLOCK_OUT
    MASK_M: tl.constexpr = tile.MASK_M
    MASK_N: tl.constexpr = tile.MASK_N
    ACC: tl.constexpr = dot.ACC
    NORMALIZE: tl.constexpr = out.NORMALIZE
    n_q = q.n
    n_k = k.n
    owned = tl.program_id(0)
    out_slice = tl.program_id(1)
    split = tl.program_id(2)
    if BY_COLUMN:  # the program's columns and their stats; it walks the row blocks of its split
        lo, hi = block_range(split, tl.num_programs(2), tl.cdiv(n_q, BLOCK_M))
        cols = owned * BLOCK_N + tl.arange(0, BLOCK_N)
        scale = tl.load(scale_ptr)
        if SYMMETRIC:
            col = _load_stats(col_up, cols, n_k, MASK_N)
            if HAS_IDS or HAS_GUIDE:
                col_pos = _load_positives(col_up, cols, n_k, POSITIVES, MASK_N)
                col_u = _load_uniform(col_up, cols, n_k, masks.KEPT_SUMS, MASK_N)
        if NORMALIZE:  # float16: each dS column is divided by the largest |g| that reaches it
            factor = tl.zeros([BLOCK_N], dtype=ACC) + tl.load(out.g_max_ptr)
            if SYMMETRIC:
                factor = tl.maximum(factor, tl.abs(col[2]))
        else:
            factor = scale  # unused
        feats = tl.arange(0, tile.BLOCK_D)
        out_feats = out_slice * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        if tile.ONE_CHUNK:
            resident = load_tile(k, cols, feats, MASK_N, tile.MASK_D)
        else:
            resident = k.ptr  # unused
        acc = tl.zeros([BLOCK_N, BLOCK_OUT], dtype=ACC)
    else:  # the program's rows and their stats; it walks the column blocks of its split
        lo, hi = block_range(split, tl.num_programs(2), tl.cdiv(n_k, BLOCK_N))
        rows = owned * BLOCK_M + tl.arange(0, BLOCK_M)
        scale = tl.load(scale_ptr)
        row = _load_stats(row_up, rows, n_q, MASK_M)
        pos = load_vector(masks.pos_ptr, rows, n_q, 1, -1, MASK_M).to(tl.int32)
        pos_span = positive_span(pos)
        if HAS_IDS or HAS_GUIDE:
            q_ids = load_optional(masks.q_ids_ptr, rows, n_q, HAS_IDS, MASK_M)
            row_thr = load_optional(masks.row_thr_ptr, rows, n_q, HAS_GUIDE, MASK_M)
            row_pos = _load_positives(row_up, rows, n_q, POSITIVES, MASK_M)
            row_u = _load_uniform(row_up, rows, n_q, masks.KEPT_SUMS, MASK_M)
        if NORMALIZE:  # float16: each dS row is divided by the largest |g| that reaches it
            factor = tl.abs(row[2])
            if SYMMETRIC:
                factor = tl.maximum(factor, tl.load(out.g_max_ptr + 1))
        else:
            factor = row[2]  # unused
        feats = tl.arange(0, tile.BLOCK_D)
        out_feats = out_slice * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        if tile.ONE_CHUNK:
            resident = load_tile(q, rows, feats, MASK_M, tile.MASK_D)
        else:
            resident = q.ptr  # unused
        acc = tl.zeros([BLOCK_M, BLOCK_OUT], dtype=ACC)
        dscale_row = tl.zeros([BLOCK_M], dtype=ACC)
        dscale_col = tl.zeros([BLOCK_M], dtype=ACC)
    for other in range(lo, hi):
        if BY_COLUMN:
            rows = other * BLOCK_M + tl.arange(0, BLOCK_M)
            row = _load_stats(row_up, rows, n_q, MASK_M)
            pos = load_vector(masks.pos_ptr, rows, n_q, 1, -1, MASK_M).to(tl.int32)
        else:
            col0 = other * BLOCK_N
            cols = col0 + tl.arange(0, BLOCK_N)
        raw, chunk = block_scores(q, k, resident, rows, cols, tile, dot, not BY_COLUMN)
        s = masked_scores(raw, scale, rows, cols, n_q, n_k, MASK_M, MASK_N)
        if SYMMETRIC and not BY_COLUMN:
            col = _load_stats(col_up, cols, n_k, MASK_N)
        if HAS_IDS or HAS_GUIDE:
            if BY_COLUMN:
                q_ids = load_optional(masks.q_ids_ptr, rows, n_q, HAS_IDS, MASK_M)
                row_thr = load_optional(masks.row_thr_ptr, rows, n_q, HAS_GUIDE, MASK_M)
                row_pos = _load_positives(row_up, rows, n_q, POSITIVES, MASK_M)
                row_u = _load_uniform(row_up, rows, n_q, masks.KEPT_SUMS, MASK_M)
            elif SYMMETRIC:
                col_pos = _load_positives(col_up, cols, n_k, POSITIVES, MASK_N)
                col_u = _load_uniform(col_up, cols, n_k, masks.KEPT_SUMS, MASK_N)
            if not SYMMETRIC:
                col, col_pos, col_u = row, row_pos, row_u  # unused
            EXCLUDES: tl.constexpr = HAS_GUIDE or (HAS_IDS and POSITIVES == ONE_POSITIVE)
            tile_masks = block_masks(masks, rows, cols, pos, q_ids, row_thr)
            ds_row, ds_col = _masked_tile_grads(
                s,
                tile_masks,
                (row, row_pos, row_u),
                (col, col_pos, col_u),
                SYMMETRIC,
                POSITIVES,
                EXCLUDES,
                masks.KEPT_SUMS,
            )
        else:
            if BY_COLUMN:
                col0 = owned * BLOCK_N
                pos_span = positive_span(pos)
            if not SYMMETRIC:
                col = row  # unused
            ds_row, ds_col = _plain_tile_grads(
                s, cols, col0, pos, pos_span, row, col, SYMMETRIC, BLOCK_N, masks.BRANCH_POSITIVES
            )
        if BY_COLUMN:
            ds = ds_row + ds_col
            if NORMALIZE:
                ds = ds * _inverse(factor)[None, :]
            if tile.ONE_CHUNK:
                q_out = chunk
            else:  # a ragged last slice as below
                q_out = load_tile(q, rows, out_feats, MASK_M, not out.EVEN_OUT, not tile.MASK_D)
            ds_op = dot_operand(ds, q.ptr.dtype.element_ty, dot.PRECISION)
            acc = tile_dot(tl.trans(ds_op), q_out, acc, dot.UPCAST, dot.PRECISION)
        else:
            dscale_row += tl.sum(ds_row * raw, axis=1)
            ds = ds_row
            if SYMMETRIC:
                dscale_col += tl.sum(ds_col * raw, axis=1)
                ds = ds + ds_col
            if NORMALIZE:
                ds = ds * _inverse(factor)[:, None]
            if tile.ONE_CHUNK:
                k_out = chunk
            else:
                # A ragged last slice (EVEN_OUT False) reads zeros past D where D is whole chunks (a multiple of
                # 16, which Triton specializes on, so the masked load stays vectorized); at ragged D it repeats
                # the last column (:func:`load_tile`). Either way those columns are never stored. Clamped columns
                # at D = 384 spilled sm_90's dk 12-64 B.
                k_out = load_tile(k, cols, out_feats, MASK_N, not out.EVEN_OUT, not tile.MASK_D)
            ds_op = dot_operand(ds, q.ptr.dtype.element_ty, dot.PRECISION)
            acc = tile_dot(ds_op, k_out, acc, dot.UPCAST, dot.PRECISION)
    # A split's partial follows the one before it: [splits, n, D] (one split: the caller's gradient itself).
    if BY_COLUMN:
        _store_slice(out, split, cols, n_k, out_feats, q.d, acc, scale, factor, MASK_N)
    else:
        _store_slice(out, split, rows, n_q, out_feats, q.d, acc, scale, factor, MASK_M)
        if out_slice == 0:
            slot = out.dscale_ptr + 2 * (owned.to(tl.int64) * tl.num_programs(2) + split)
            tl.store(slot, tl.sum(dscale_row, axis=0))
            tl.store(slot + 1, tl.sum(dscale_col, axis=0))
