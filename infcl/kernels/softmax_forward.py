"""Forward: the log-sum-exp stats of S = scale * q @ k.T per row (and per column), and each row's positive
logit, from one pass over the tiles; S never leaves registers.

Grid (groups, splits). Program (g, c) walks the row blocks of row group g (one row block per group
for the one-directional loss) and, for each, the k blocks of split c, building each S tile once
(:func:`infcl.kernels.score_tiles.block_scores`) and folding it into
- the row's running stats (m, rest) and positive logit (the tile entry at ``pos``), kept in
  registers and stored per split: ``[3, splits, Bq]``;
- for the symmetric loss, the column stats over the group's rows: each tile's column stats are merged
  into the group's own ``[2, groups, Bk]`` partials (read, merged, written back: one program owns each
  (group, column) pair, so no atomics and no race). On tensor cores the plain symmetric loss walks the
  row blocks in pairs (``TileConfig.row_tiles``): each k block's two S tiles (each the one S tile of every
  kernel) share the k chunks' loads, and their column stats are reduced, merged and written back once
  per pair (:func:`_symmetric_pair`).
The host merges the splits and the groups with :func:`infcl.lse.lse_merge` in a fixed order. Splits
exist to fill the GPU when there are few row blocks; groups are at most MAX_GROUPS, so the extra
memory is O(MAX_SPLITS * Bq + MAX_GROUPS * Bk), never O(Bq * Bk).

GEMM count: 1 GEMM-equivalent (2*Bq*Bk*D flops) per call, symmetric or not: the column stats come
from the same tiles as the row stats (the tile's column max and a second exp per entry).

With mask options (:mod:`infcl.masks`; HAS_IDS and HAS_GUIDE, constexprs the kernel reads off which inputs are
given (absent ones come as None), and POSITIVES; all False for the plain loss, which then compiles to exactly
the code above),
each tile also forms its positives and exclusions (:func:`infcl.kernels.softmax_mask_tiles.block_masks`: the ids,
and one guide GEMM over D' when a guide is given) and the partials are the ``[6, n]`` rows of :mod:`infcl.masks`,
for rows and (symmetric) columns alike: the stats over the columns not excluded, the positives' max (and,
"sum", their rest), the sum of their logits and their count. With KEPT_SUMS (label smoothing's uniform part over
the kept entries, :mod:`infcl.losses.smoothing`) two more rows, ``[8, n]``: the sum of each line's kept logits
and their number, folded from the very tile the stats see (:func:`infcl.kernels.softmax_mask_tiles.kept_sums`);
without it the masked kernel compiles to the code it had before the flag.

Inputs: q [Bq, D], k [Bk, D] of one dtype among float32/bfloat16/float16/float64, any strides; scale a
0-d tensor in the accumulation dtype (float32, float64 for float64), read in the kernel (no host
sync); pos [Bq] int64, the column of each row's positive in this block or -1. NaN in a row gives NaN
stats for that row and every column it meets, as F.cross_entropy does.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..contract import MaskOptions
from ..lse import MAX, REL, lse_merge
from ..masks import KEPT_ROWS, MASKED_ROWS, POS_MAX, POS_REL, merge_masked
from .autotune import autotune_bucket, lazy_autotune, neighbours
from .configs import TENSOR_CORE_CLASSES, TileConfig, Tiling
from .kernel_args import (
    COMPILE_OPTIONS,
    branch_positives,
    even_blocks,
    feature_chunks,
    launch_options,
    mask_kernel_args,
    qk_args,
    tf32_operands,
)
from .score_tiles import (
    PTX,
    Dot,
    Matrix,
    Tile,
    block_range,
    block_scores,
    load_tile,
    load_vector,
    masked_scores,
)
from .softmax_forward_tiles import (
    KEPT_ROW,
    _fold_rows,
    _merge_columns,
    _merge_masked_columns,
    _store_rows,
    _symmetric_pair,
)
from .softmax_mask_tiles import ONE_POSITIVE, Masks, block_masks, kept_sums, load_optional, positive_partials
from .split_plan import plan_forward
from .target import ARCH_FAMILIES
from .tile_stats import holds_positive, kept_rest_stats, merge_kept_stats, positive_span, tile_rest_stats
from .tiling import forward_config


@triton.jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    scale_ptr,
    pos_ptr,
    rows_ptr,
    cols_ptr,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_rows_stat,
    stride_rows_split,
    stride_cols_stat,
    stride_cols_group,
    q_ids_ptr,
    k_ids_ptr,
    gq_ptr,
    gk_ptr,
    row_thr_ptr,
    col_thr_ptr,
    DG,
    stride_gq,
    stride_gk,
    SYMMETRIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    POSITIVES: tl.constexpr,
    BRANCH_POSITIVES: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
    ROW_TILES: tl.constexpr,
    EVEN_PAIRS: tl.constexpr,
    KEPT_SUMS: tl.constexpr,
    BUCKET: tl.constexpr,  # the autotuner's size key only (0 when not autotuning)
):
    # What the launch's inputs say: the mask options given (absent inputs come as None), the accumulation
    # dtype (scale's: float32, float64 for float64 inputs), the guide's, and whether the interpreter upcasts
    # 16-bit operands (score_tiles.tile_dot). The operands, tiles and dots are packed here, once, as the
    # arguments of the program's body (a tuple assigned to a name would turn its constexprs into tensors).
    HAS_IDS: tl.constexpr = q_ids_ptr is not None
    HAS_GUIDE: tl.constexpr = gq_ptr is not None
    UPCAST: tl.constexpr = not PTX and q_ptr.dtype.element_ty.primitive_bitwidth == 16
    ACC: tl.constexpr = scale_ptr.dtype.element_ty
    GUIDE_ACC: tl.constexpr = gq_ptr.dtype.element_ty if HAS_GUIDE else tl.float32
    # The program's own partials, offset once: its split's rows [R, n_q], and (symmetric) its group's columns
    # [R, n_k] (R stats, each row contiguous).
    row_out = rows_ptr + tl.program_id(1).to(tl.int64) * stride_rows_split
    col_part = cols_ptr + tl.program_id(0).to(tl.int64) * stride_cols_group
    MASK_M1: tl.constexpr = not (EVEN_M and EVEN_PAIRS)  # a pair's second block may reach past n_q
    _forward_program(
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
        (Matrix(row_out, 0, n_q, stride_rows_stat, 1), Matrix(col_part, 0, n_k, stride_cols_stat, 1)),
        scale_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, not EVEN_M, not EVEN_N, not EVEN_D, ONE_CHUNK),
        Dot(ACC, UPCAST, PRECISION),
        ROW_TILES,
        MASK_M1,
    )


@triton.jit
def _forward_program(q, k, masks, out, scale_ptr, tile, dot, ROW_TILES: tl.constexpr, MASK_M1: tl.constexpr):
    """Program (group, split)'s walk: the row blocks of its group, in units of ROW_TILES blocks (pairs:
    :func:`_symmetric_pair`, the plain symmetric loss; MASK_M1: a pair's second block may reach past n_q), over
    the k blocks of its split; ``out``: the program's (row, column) partials."""
    tl.static_assert(ROW_TILES == 1 or (masks.SYMMETRIC and not (masks.HAS_IDS or masks.HAS_GUIDE)))
    tl.static_assert(not masks.KEPT_SUMS or masks.HAS_IDS or masks.HAS_GUIDE)  # kept sums: masked partials only
    # The program walks units of ROW_TILES row blocks (the last unit's second block may lie past n_q).
    n_units = tl.cdiv(tl.cdiv(q.n, tile.BLOCK_M), ROW_TILES)
    rb_lo, rb_hi = block_range(tl.program_id(0), tl.num_programs(0), n_units)
    col_blocks = block_range(tl.program_id(1), tl.num_programs(1), tl.cdiv(k.n, tile.BLOCK_N))
    scale = tl.load(scale_ptr)  # a device tensor, not a launch argument: no host sync, no fp32 rounding
    for rb in range(rb_lo, rb_hi):
        rows = rb * (ROW_TILES * tile.BLOCK_M) + tl.arange(0, tile.BLOCK_M)
        if ROW_TILES == 2:
            _symmetric_pair(q, k, masks, out, scale, rows, col_blocks, tile, MASK_M1, dot)
        else:
            _forward_rows(q, k, masks, out, scale, rows, col_blocks, tile, dot)


@triton.jit
def _forward_rows(q, k, masks, out, scale, rows, col_blocks, tile, dot):
    """One row block's pass over the k blocks [col_blocks[0], col_blocks[1]): its rows' stats (stored to
    ``out[0]``) and, symmetric, the group's column partials (merged into ``out[1]``); with mask options the
    masked rows of :mod:`infcl.masks`."""
    HAS_IDS: tl.constexpr = masks.HAS_IDS
    HAS_GUIDE: tl.constexpr = masks.HAS_GUIDE
    POSITIVES: tl.constexpr = masks.POSITIVES
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    ACC: tl.constexpr = dot.ACC
    n_q = q.n
    n_k = k.n
    if tile.ONE_CHUNK:  # the q tile is loaded once and held in registers for the whole k loop
        q_res = load_tile(q, rows, tl.arange(0, tile.BLOCK_D), tile.MASK_M, tile.MASK_D)
    else:
        q_res = q.ptr  # unused
    pos = load_vector(masks.pos_ptr, rows, n_q, 1, -1, tile.MASK_M).to(tl.int32)
    pos_lo, pos_hi = positive_span(pos)
    run_max = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    run_rest = tl.full([BLOCK_M], -1.0, dtype=ACC)
    pos_logit = tl.zeros([BLOCK_M], dtype=ACC)
    if HAS_IDS or HAS_GUIDE:  # the positives' max, rest ("sum") and count, the ids and thresholds of the rows
        pos_max = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
        pos_rest = tl.full([BLOCK_M], -1.0, dtype=ACC)
        pos_count = tl.zeros([BLOCK_M], dtype=ACC)
        q_ids = load_optional(masks.q_ids_ptr, rows, n_q, HAS_IDS, tile.MASK_M)
        row_thr = load_optional(masks.row_thr_ptr, rows, n_q, HAS_GUIDE, tile.MASK_M)
        if masks.KEPT_SUMS:  # label smoothing: the sum and number of the rows' kept logits
            kept_sum = tl.zeros([BLOCK_M], dtype=ACC)
            kept_count = tl.zeros([BLOCK_M], dtype=ACC)
    for cb in range(col_blocks[0], col_blocks[1]):
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        raw, _ = block_scores(q, k, q_res, rows, cols, tile, dot, True)
        # Row stats see only real columns; padded rows are finite (zero features) and never stored.
        s_rows = masked_scores(raw, scale, rows, cols, n_q, n_k, False, tile.MASK_N)
        if HAS_IDS or HAS_GUIDE:
            positive, excluded_rows, excluded_cols = block_masks(masks, rows, cols, pos, q_ids, row_thr)
            kept = s_rows
            if HAS_GUIDE or (HAS_IDS and POSITIVES == ONE_POSITIVE):
                kept = tl.where(excluded_rows, float("-inf"), s_rows)
            tile_max, tile_rest = kept_rest_stats(kept, 1)
            run_max, run_rest = merge_kept_stats(run_max, run_rest, tile_max, tile_rest)
            if masks.KEPT_SUMS:
                kept_sum, kept_count = kept_sums(kept, kept_sum, kept_count, 1)
            pos_max, pos_rest, pos_logit, pos_count = positive_partials(
                s_rows, positive, pos_max, pos_rest, pos_logit, pos_count, 1, POSITIVES
            )
        else:
            has_pos = holds_positive(pos_lo, pos_hi, cb * BLOCK_N, BLOCK_N, masks.BRANCH_POSITIVES)
            run_max, run_rest, pos_logit = _fold_rows(s_rows, cols, pos, has_pos, run_max, run_rest, pos_logit)
        if masks.SYMMETRIC:  # col_part is an empty placeholder otherwise
            s_cols = masked_scores(raw, scale, rows, cols, n_q, n_k, tile.MASK_M, False)
            if HAS_IDS or HAS_GUIDE:
                kept = s_cols
                if HAS_GUIDE or (HAS_IDS and POSITIVES == ONE_POSITIVE):
                    kept = tl.where(excluded_cols, float("-inf"), s_cols)
                _merge_masked_columns(out[1], cols, s_cols, kept, positive, POSITIVES, masks.KEPT_SUMS, tile.MASK_N)
            else:
                col_max, col_rest = tile_rest_stats(s_cols, 0)
                _merge_columns(out[1], cols, col_max, col_rest, tile.MASK_N)
    if HAS_IDS or HAS_GUIDE:  # the rows of infcl.masks, rest in place of rel
        _store_rows(out[0], rows, (run_max, run_rest, pos_max, pos_rest, pos_logit, pos_count), tile.MASK_M)
        if masks.KEPT_SUMS:
            _store_rows(out[0], rows, (kept_sum, kept_count), tile.MASK_M, KEPT_ROW)
    else:
        _store_rows(out[0], rows, (run_max, run_rest, pos_logit), tile.MASK_M)


# ---- configs ------------------------------------------------------------------------------------
# Each call's config: infcl.kernels.tiling.forward_config (one function for every family, operand class, D and
# mask option). Below, the autotuner's search space, built around those defaults.

# The (architecture family, operand class) pairs with configs, in the order the autotuner lists them.
CONFIG_KEYS = (
    *((arch, "mma") for arch in (90, 100, 80, 86, 120)),
    *((arch, "tf32") for arch in (90, 100, 80, 86, 120)),
    *((arch, operand_class) for arch in ARCH_FAMILIES for operand_class in ("ieee", "fp64")),
)


def _keep(key, config: TileConfig) -> bool:
    """Search points that compile without spills at ragged D (tests/test_triton_api_compile.py): a fourth
    stage on sm_80 (ptxas 12), a third on sm_100 / sm_120 and on sm_90 / sm_100 tf32 spill, so those
    defaults are searched alone. The FMA classes (ieee, fp64) sit at their register limit already, so they
    keep their default alone."""
    default = forward_config(*key[:2])
    more_stages = ((80, "mma"), (100, "mma"), (120, "mma"), (90, "tf32"), (100, "tf32"))
    if key[:2] in more_stages and config.num_stages > default.num_stages:
        return False
    return key[1] in TENSOR_CORE_CLASSES or config == default


# The search space under INFCL_AUTOTUNE=1 (keyed by D, dtypes, precision, the loss direction and the
# size bucket; pruned at tuning time to the call's (arch, class, ragged D) list): each default and one more
# stage, less what _keep drops; never another S tile (configs.neighbours). Opt-in: it benchmarks every
# config on each new key.
AUTOTUNE_CONFIGS = {
    (*key, ragged): [c for c in neighbours(forward_config(*key, ragged)) if _keep((*key, ragged), c)]
    for ragged in (False, True)
    for key in CONFIG_KEYS
}

# Every buffer a trial writes: the row partials are overwritten whole, the column partials are
# read-merged-written from the host's empty stats, so both are restored between trials.
_forward_autotuned = lazy_autotune(
    _forward_kernel,
    AUTOTUNE_CONFIGS,
    key=["D", "SYMMETRIC", "PRECISION", "BUCKET"],
    restore_value=["rows_ptr", "cols_ptr"],
)


# ---- launcher -----------------------------------------------------------------------------------


def merge_partials(parts: torch.Tensor, positives: Optional[str] = None) -> torch.Tensor:
    """[R, S, n] per-split partials -> [R, n], contiguous: stats in rows 0-1, further rows sums (R = 3), or
    the masked rows of :mod:`infcl.masks` (R = 6, or 8 with the kept sums, which add) merged by
    :func:`infcl.masks.merge_masked` for the loss kind ``positives`` ("mean" or "sum").

    Pairs are merged in a fixed tree order with :func:`infcl.lse.lse_merge` (the further rows added),
    so the result depends on nothing but the inputs.
    """
    n = parts.shape[1]
    while n > 1:
        half = n // 2
        if positives is None:
            lse_merge(parts[:2, :half], parts[:2, n - half : n])
            parts[2:, :half] += parts[2:, n - half : n]
        else:
            merge_masked(parts[:, :half], parts[:, n - half : n], positives)
            parts[MASKED_ROWS:, :half] += parts[MASKED_ROWS:, n - half : n]  # the kept sums (KEPT_ROWS), if any
        n -= half
    return parts[:, 0].contiguous()


def _empty_partials(rows: int, parts: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[rows, parts, n] partials of empty sets in the kernel's rest form: stats (-inf, -1) (and, masked,
    the positives' stats likewise), sums 0."""
    out = torch.zeros(rows, parts, n, dtype=dtype, device=device)
    out[MAX].fill_(float("-inf"))
    out[REL].fill_(-1.0)  # rest = -1: the empty set
    if rows >= MASKED_ROWS:
        out[POS_MAX].fill_(float("-inf"))
        out[POS_REL].fill_(-1.0)
    return out


def softmax_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: torch.Tensor,
    pos: torch.Tensor,
    symmetric: bool,
    tiling: Tiling,
    precision: Optional[str] = None,
    autotune: bool = False,
    sms: int = 1,
    wrap=lambda kernel: kernel,
    masks: Optional[MaskOptions] = None,
    kept_sums: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """rows [3, Bq] = (max, log-sum relative to it, positive logit or 0), cols [2, Bk] stats or None.

    ``tiling`` gives the block sizes (its forward config, unless ``autotune``) and the feature chunk;
    ``sms`` the device's SM count for the split plan; ``wrap`` wraps each kernel before its launch
    (``torch.library.wrap_triton`` inside a triton_op). ``masks`` (ids, guide; :mod:`infcl.masks`):
    rows [6, Bq] and cols [6, Bk] are the masked partials (the rows of :mod:`infcl.masks`) instead, [8, n]
    with ``kept_sums`` (label smoothing: also the sum and number of each line's kept logits).
    """
    opts = launch_options(q.dtype, precision)
    q, k = tf32_operands(opts["PRECISION"], q, k)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    masked = masks is not None
    if kept_sums and not masked:
        raise ValueError("softmax_forward: kept_sums needs mask options (the kept logits are the masked ones')")
    n_q, dim = q.shape
    n_k = k.shape[0]
    # Pairs of row blocks (TileConfig.row_tiles) in the plain symmetric forward; the autotuner keeps BLOCK_M.
    row_tiles = tiling.forward.row_tiles if symmetric and not masked else 1
    plan = plan_forward(n_q, n_k, tiling, symmetric, sms, row_tiles)
    n_rows = (KEPT_ROWS if kept_sums else MASKED_ROWS) if masked else 3
    rows = torch.empty(n_rows, plan.splits, n_q, dtype=acc, device=q.device)
    cols = None  # the column stats exist only for the symmetric loss
    if symmetric:
        cols = _empty_partials(n_rows if masked else 2, plan.groups, n_k, acc, q.device)
    args = dict(
        # One direction: an empty placeholder for the column partials, never read (Triton 3.4's autotuner
        # clones every restore_value argument, and fails on None).
        scale_ptr=scale,
        pos_ptr=pos,
        rows_ptr=rows,
        cols_ptr=rows[:, :0] if cols is None else cols,
        **qk_args(q, k),
        stride_rows_stat=rows.stride(0),
        stride_rows_split=rows.stride(1),
        stride_cols_stat=cols.stride(0) if symmetric else 0,
        stride_cols_group=cols.stride(1) if symmetric else 0,
        SYMMETRIC=symmetric,
        **feature_chunks(dim, tiling.block_d(dim)),
        PRECISION=opts["PRECISION"],
        ROW_TILES=row_tiles,
        BRANCH_POSITIVES=branch_positives(q.dtype, precision),
        EVEN_PAIRS=triton.cdiv(n_q, tiling.forward.block_m) % row_tiles == 0,
        **mask_kernel_args(masks, q.dtype, precision),
        KEPT_SUMS=kept_sums,
        **COMPILE_OPTIONS,
    )
    grid = (plan.groups, plan.splits)
    if autotune:
        wrap(_forward_autotuned())[grid](BUCKET=autotune_bucket(n_q, n_k), **args)
    else:
        cfg = tiling.forward
        wrap(_forward_kernel)[grid](
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            **even_blocks(n_q, n_k, cfg.block_m, cfg.block_n),
            BUCKET=0,
            **cfg.launch_options(),
            **args,
        )
    positives = masks.loss_kind if masked else None
    results = []
    for parts in (rows, cols) if symmetric else (rows,):
        parts[REL].log1p_()  # rest -> r = log1p(rest), the contract's form; -1 (empty) -> -inf
        if masked:
            parts[POS_REL].log1p_()
        results.append(merge_partials(parts, positives))
    return results[0], (results[1] if symmetric else None)
