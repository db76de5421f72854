"""Backward: recompute each S tile, form dS in registers, accumulate dq, dk and the scale gradient —
deterministic, without atomics.

With raw = q @ k.T, S = scale * raw, the global stats (m, r) of every row (and, symmetric, column),
the upstream gradients g_row [Bq] (g_col [Bk]) and Y the one-hot of the positives:

    dS     = g_row * (P_row - Y) [+ g_col * (P_col - Y)],   P = exp((S - m) - r), formed in ACC
    dq    += scale * dS @ k            dk += scale * dS.T @ q
    dscale = (sum(g_row * (P_row - Y) * raw), sum(g_col * (P_col - Y) * raw))

Two kernels, shaped like the fused-attention backward:
- ``_dq_kernel``: a program owns BLOCK_M rows of q and one slice of BLOCK_OUT feature columns, walks
  the k blocks of its split, and accumulates its dq slice in registers; it writes it once at the end.
  It also sums the two scale-gradient parts per program into a small buffer that the host adds up in
  a fixed order.
- ``_dk_kernel``: a program owns BLOCK_N rows of k (one slice), walks the q blocks, and accumulates
  dk the same way; it computes the S tile in the same q-rows-by-k-rows orientation as every other
  kernel (then transposes dS for the product), so its S is bit-identical too.
Nothing is accumulated across programs except through per-program buffers summed in a fixed order
(k splits of dq, q splits of dk, the scale gradient), so the same inputs give the same bits every run.

dS is formed in the accumulation dtype with the positive's entry as g * expm1(x), then rounded to the
inputs' dtype for the two products (tensor-core operands). For float16 each row (column) of dS is
first divided by the largest |g| that can reach it, max(|g_row[i]|, max|g_col|) (for dk:
max(|g_col[j]|, max|g_row|)), and the product multiplied back in float32, so that entries of order
g * p (1e-9 for a mean over 65536 rows) do not flush to zero in float16's range.

With mask options (as in the forward: HAS_IDS, HAS_GUIDE, POSITIVES) the kernels form each tile's positives
and exclusions the same way and dS with :func:`infcl.kernels.tiles.masked_softmax_grad`: P is 0 on the
exclusions and Y is the one-hot of ``pos``, 1/|P| on the positives ("mean") or their softmax ("sum").

GEMM count per call, for D up to one slice (BLOCK_OUT, 256 by default; D <= 128 is one chunk): 4 —
S in each kernel, dq, dk — whether the loss is one-directional or symmetric. A wider D runs
ceil(D / BLOCK_OUT) slices, each recomputing S: 2 * slices + 2. With the forward's 1: 5 for either
loss at D <= BLOCK_OUT (Inf-CL: 5 for one direction, 10 for the symmetric loss).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from .autotune import autotune_bucket, lazy_autotune, neighbours
from .backward_tiles import (
    _inverse,
    _load_positives,
    _load_stats,
    _masked_rows,
    _masked_tile_grads,
    _plain_tile_grads,
    _store_slice,
)
from .configs import TENSOR_CORE_CLASSES, TRITON_VERSION, TileConfig, Tiling
from .kernel_args import (
    COMPILE_OPTIONS,
    NO_MASKS,
    MaskInputs,
    branch_positives,
    even_blocks,
    feature_chunks,
    launch_options,
    tf32_operands,
)
from .split_plan import plan_backward_splits
from .target import ARCH_FAMILIES
from .tiles import (
    block_range,
    block_scores,
    check_blocks,
    dot_operand,
    load_tile,
    load_vector,
    masked_scores,
    positive_span,
    tile_dot,
)
from .tiling import dk_config, dq_config


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
            k_out = load_tile(k_ptr, cols, out_feats, n_k, D, stride_k0, stride_k1, not EVEN_N, not EVEN_OUT, False)
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
        else:
            q_out = load_tile(q_ptr, rows, out_feats, n_q, D, stride_q0, stride_q1, not EVEN_M, not EVEN_OUT, False)
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


# ---- configs ------------------------------------------------------------------------------------
# Each call's configs: infcl.kernels.tiling.dq_config / dk_config (one function each for every family, operand
# class, D and mask option). Below, the autotuner's search spaces, built around those defaults.

# The (architecture family, operand class) pairs with configs, in the order the autotuner lists them.
CONFIG_KEYS = (
    *((arch, "mma") for arch in (90, 100, 80, 86, 120)),
    *((arch, "tf32") for arch in (90, 100, 86, 120, 80)),
    *((arch, "ieee") for arch in ARCH_FAMILIES),
    *((arch, "fp64") for arch in ARCH_FAMILIES),
)
# The search space under INFCL_AUTOTUNE=1, per kernel (keyed by D, dtypes, precision, the loss
# direction and the size bucket; pruned at tuning time to the call's (arch, class, ragged D) list): each
# default and one more stage; never another S tile (configs.neighbours). The slice width is not searched:
# it fixes the grid and the GEMM count, so it stays the default config's.


def _keep(key, config: TileConfig, default: TileConfig) -> bool:
    """Search points that compile without spills (tests/test_triton_api_compile.py): under Triton 3.2 a
    second stage spills sm_90's dk (220 B, tf32 at D = 1000); the FMA classes (ieee, fp64) sit at their
    register limit already, so they keep their default alone."""
    if TRITON_VERSION < (3, 3) and key[0] in (90, 100) and config.num_stages > default.num_stages:
        return False
    return key[1] in TENSOR_CORE_CLASSES or config == default


def _space(config_of):
    """{(arch, class, ragged D): [configs]} around the defaults ``config_of(arch, class, ragged)``."""
    out = {}
    for key in CONFIG_KEYS:
        for is_ragged in (False, True):
            default = config_of(*key, is_ragged)
            out[(*key, is_ragged)] = [c for c in neighbours(default) if _keep((*key, is_ragged), c, default)]
    return out


DQ_AUTOTUNE_CONFIGS = _space(dq_config)
DK_AUTOTUNE_CONFIGS = _space(dk_config)
# The smallest BLOCK_M any config uses: the dq kernel's scale-gradient buffer has a slot per program.
_MIN_BLOCK_M = min(c.block_m for tiles in DQ_AUTOTUNE_CONFIGS.values() for c in tiles)
_KEY = ["D", "SYMMETRIC", "PRECISION", "BUCKET"]
# Every buffer a trial writes: the gradient (accumulated into, or a partial) is restored and the
# per-program scale-gradient slots are zeroed before each trial.
_dq_autotuned = lazy_autotune(
    _dq_kernel, DQ_AUTOTUNE_CONFIGS, _KEY, restore_value=["out_ptr"], reset_to_zero=["dscale_ptr"]
)
_dk_autotuned = lazy_autotune(_dk_kernel, DK_AUTOTUNE_CONFIGS, _KEY, restore_value=["out_ptr"])


# ---- launcher -----------------------------------------------------------------------------------


def _launch(kernel, autotuned, grid, args: dict, cfg: TileConfig, autotune: bool, wrap):
    """One backward kernel, by keyword: autotuned (the config and its EVEN_M / EVEN_N chosen per key) or
    with ``cfg``."""
    n_q, n_k = args["n_q"], args["n_k"]
    if autotune:
        wrap(autotuned())[grid](BUCKET=autotune_bucket(n_q, n_k), **args)
    else:
        blocks = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        wrap(kernel)[grid(blocks)](
            **blocks,
            **even_blocks(n_q, n_k, cfg.block_m, cfg.block_n),
            BUCKET=0,
            **cfg.launch_options(),
            **args,
        )


def _positive_args(ptr: str, stride_stat: str, stride_elem: str, positives: Optional[torch.Tensor]) -> dict:
    """The kernels' pointer and strides of a [n] count or [2, n] stats of the positives (None: absent)."""
    if positives is None:
        return {ptr: None, stride_stat: 0, stride_elem: 0}
    if positives.dim() == 1:
        return {ptr: positives, stride_stat: 0, stride_elem: positives.stride(0)}
    return {ptr: positives, stride_stat: positives.stride(0), stride_elem: positives.stride(1)}


def softmax_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: torch.Tensor,
    pos: torch.Tensor,
    row_stats: torch.Tensor,
    g_row: torch.Tensor,
    col_stats: Optional[torch.Tensor],
    g_col: Optional[torch.Tensor],
    dq: torch.Tensor,
    dk: torch.Tensor,
    tiling: Tiling,
    precision: Optional[str] = None,
    autotune: bool = False,
    sms: int = 1,
    wrap=lambda kernel: kernel,
    masks: MaskInputs = NO_MASKS,
    row_positives: Optional[torch.Tensor] = None,
    col_positives: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Accumulate dq [Bq, D] and dk [Bk, D] in place (any strides); return dscale [2] (row part, column part).

    q, k, scale, pos as in :func:`infcl.kernels.softmax_forward.softmax_forward`; row_stats [2, Bq] and
    g_row [Bq], and for the symmetric loss col_stats [2, Bk] and g_col [Bk] (else None), all in the
    accumulation dtype, any strides. ``tiling``, ``autotune``, ``sms`` and ``wrap`` as in the forward.
    ``masks`` as in the forward, with each row's (column's, symmetric) positives: with ``multi_positive``
    "mean" their global count ``row_positives`` [Bq] (``col_positives`` [Bk]), with "sum" their global
    stats [2, Bq] ([2, Bk]); None with one positive per row.
    """
    opts = launch_options(q.dtype, precision)
    q, k = tf32_operands(opts["PRECISION"], q, k)
    acc = dq.dtype
    n_q, dim = q.shape
    n_k = k.shape[0]
    symmetric = col_stats is not None
    normalize = q.dtype == torch.float16
    # float16: max|g_row| (and max|g_col|, read only when symmetric), the dS normalizers; else absent.
    g_max = torch.stack([g.abs().amax() for g in (g_row, g_col) if g is not None]) if normalize else None
    block_d = tiling.block_d(dim)
    common = dict(
        q_ptr=q,
        k_ptr=k,
        scale_ptr=scale,
        pos_ptr=pos,
        row_stats_ptr=row_stats,
        g_row_ptr=g_row,
        col_stats_ptr=col_stats,
        g_col_ptr=g_col,
        g_max_ptr=g_max,
        n_q=n_q,
        n_k=n_k,
        D=dim,
        stride_q0=q.stride(0),
        stride_q1=q.stride(1),
        stride_k0=k.stride(0),
        stride_k1=k.stride(1),
        stride_rs0=row_stats.stride(0),
        stride_rs1=row_stats.stride(1),
        stride_gr=g_row.stride(0),
        stride_cs0=col_stats.stride(0) if symmetric else 0,
        stride_cs1=col_stats.stride(1) if symmetric else 0,
        stride_gc=g_col.stride(0) if symmetric else 0,
        SYMMETRIC=symmetric,
        NORMALIZE=normalize,
        BLOCK_D=block_d,
        **feature_chunks(dim, block_d),
        **opts,
        **masks.kernel_args(q.dtype, precision),
        BRANCH_POSITIVES=branch_positives(q.dtype, precision),
        **_positive_args("row_pos_ptr", "stride_rp0", "stride_rp1", row_positives),
        **_positive_args("col_pos_ptr", "stride_cp0", "stride_cp1", col_positives),
        **COMPILE_OPTIONS,
    )
    dscale_parts = None
    for which, grad, cfg, n_owned, n_other in (
        ("dq", dq, tiling.dq, triton.cdiv(n_q, tiling.dq.block_m), triton.cdiv(n_k, tiling.dq.block_n)),
        ("dk", dk, tiling.dk, triton.cdiv(n_k, tiling.dk.block_n), triton.cdiv(n_q, tiling.dk.block_m)),
    ):
        block_out = tiling.block_out(cfg, dim)
        slices = triton.cdiv(dim, block_out)
        splits = plan_backward_splits(n_owned, n_other, slices, tiling, sms)
        # One split accumulates straight into the caller's gradient; several write fresh partials.
        out = grad if splits == 1 else torch.empty(splits, *grad.shape, dtype=acc, device=grad.device)
        out_strides = (0, *grad.stride()) if splits == 1 else out.stride()
        args = dict(
            common,
            out_ptr=out,
            stride_out_split=out_strides[0],
            stride_out0=out_strides[1],
            stride_out1=out_strides[2],
            ADD=splits == 1,
            BLOCK_OUT=block_out,
            EVEN_OUT=dim % block_out == 0,
        )
        if which == "dq":
            n_rows_max = triton.cdiv(n_q, min(_MIN_BLOCK_M, cfg.block_m) if autotune else cfg.block_m)
            dscale_parts = torch.zeros(n_rows_max * splits, 2, dtype=acc, device=q.device)
            grid = lambda meta, slices=slices, splits=splits: (triton.cdiv(n_q, meta["BLOCK_M"]), slices, splits)  # noqa: E731
            _launch(_dq_kernel, _dq_autotuned, grid, dict(args, dscale_ptr=dscale_parts), cfg, autotune, wrap)
        else:
            grid = lambda meta, slices=slices, splits=splits: (triton.cdiv(n_k, meta["BLOCK_N"]), slices, splits)  # noqa: E731
            _launch(_dk_kernel, _dk_autotuned, grid, args, cfg, autotune, wrap)
        if splits > 1:
            grad += out.sum(dim=0)
    return dscale_parts.sum(dim=0)
