"""Backward: recompute each S tile, form dS in registers, accumulate dq, dk and the scale gradient —
deterministic, without atomics.

With raw = q @ k.T, S = scale * raw, the global stats (m, r) of every row (and, symmetric, column),
the upstream gradients g_row [Bq] (g_col [Bk]) and Y the one-hot of the positives:

    dS     = g_row * (P_row - Y) [+ g_col * (P_col - Y)],   P = exp((S - m) - r), formed in ACC
    dq    += scale * dS @ k            dk += scale * dS.T @ q
    dscale = (sum(g_row * (P_row - Y) * raw), sum(g_col * (P_col - Y) * raw))

One kernel, ``_backward_kernel``, launched once per direction, shaped like the fused-attention backward:
- dq (``BY_COLUMN`` False): a program owns BLOCK_M rows of q and one slice of BLOCK_OUT feature columns,
  walks the k blocks of its split, and accumulates its dq slice in registers; it writes it once at the
  end. It also sums the two scale-gradient parts per program into a small buffer that the host adds up
  in a fixed order.
- dk (``BY_COLUMN`` True): a program owns BLOCK_N rows of k (one slice), walks the q blocks, and
  accumulates dk the same way; it computes the S tile in the same q-rows-by-k-rows orientation as every
  other kernel (then transposes dS for the product), so its S is bit-identical too.
Nothing is accumulated across programs except through per-program buffers summed in a fixed order
(k splits of dq, q splits of dk, the scale gradient), so the same inputs give the same bits every run.

dS is formed in the accumulation dtype with the positive's entry as g * expm1(x), then rounded to the
inputs' dtype for the two products (tensor-core operands). For float16 each row (column) of dS is
first divided by the largest |g| that can reach it, max(|g_row[i]|, max|g_col|) (for dk:
max(|g_col[j]|, max|g_row|)), and the product multiplied back in float32, so that entries of order
g * p (1e-9 for a mean over 65536 rows) do not flush to zero in float16's range.

With mask options (as in the forward: HAS_IDS, HAS_GUIDE, POSITIVES) the kernels form each tile's positives
and exclusions the same way and dS with :func:`infcl.kernels.softmax_mask_tiles.masked_softmax_grad`: P is 0 on the
exclusions and Y is the one-hot of ``pos``, 1/|P| on the positives ("mean") or their softmax ("sum"). With label
smoothing's uniform weights (``row_uniform`` / ``col_uniform``: KEPT_SUMS, read off whether they are given) dS also
loses each line's weight on its kept entries (:func:`infcl.kernels.softmax_mask_tiles.subtract_uniform`), so dq, dk
and dscale take it as they take the rest of dS; without them the kernel compiles to the code it had before.

GEMM count per call, for D up to one slice (BLOCK_OUT, 256 by default; D <= 128 is one chunk): 4 —
S in each kernel, dq, dk — whether the loss is one-directional or symmetric. A wider D runs
ceil(D / BLOCK_OUT) slices, each recomputing S: 2 * slices + 2. With the forward's 1: 5 for either
loss at D <= BLOCK_OUT (Inf-CL: 5 for one direction, 10 for the symmetric loss).

The kernel: :mod:`infcl.kernels.softmax_backward_kernels`, its per-tile helpers
:mod:`infcl.kernels.softmax_backward_tiles`; below, the autotuner's search spaces and the launcher.
"""

from typing import Optional

import torch
import triton

from ..contract import MaskOptions
from .autotune import autotune_bucket, lazy_autotune, neighbours
from .configs import TENSOR_CORE_CLASSES, TileConfig, Tiling
from .kernel_args import (
    COMPILE_OPTIONS,
    branch_positives,
    even_blocks,
    feature_chunks,
    launch_options,
    mask_kernel_args,
    matrix_args,
    qk_args,
    tf32_operands,
)
from .softmax_backward_kernels import _backward_kernel
from .split_plan import plan_backward_splits
from .target import ARCH_FAMILIES
from .tiling import dk_config, dq_config

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
    """Search points that compile without spills (tests/test_triton_api_compile.py): the FMA classes (ieee,
    fp64) sit at their register limit already, so they keep their default alone."""
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
    _backward_kernel, DQ_AUTOTUNE_CONFIGS, _KEY, restore_value=["out_ptr"], reset_to_zero=["dscale_ptr"]
)
_dk_autotuned = lazy_autotune(_backward_kernel, DK_AUTOTUNE_CONFIGS, _KEY, restore_value=["out_ptr"])


# ---- launcher -----------------------------------------------------------------------------------


def _launch(autotuned, grid, args: dict, cfg: TileConfig, autotune: bool, wrap):
    """The backward kernel for one direction, by keyword: autotuned (the config and its EVEN_M / EVEN_N chosen
    per key) or with ``cfg``."""
    n_q, n_k = args["n_q"], args["n_k"]
    if autotune:
        wrap(autotuned())[grid](BUCKET=autotune_bucket(n_q, n_k), **args)
    else:
        blocks = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
        wrap(_backward_kernel)[grid(blocks)](
            **blocks,
            **even_blocks(n_q, n_k, cfg.block_m, cfg.block_n),
            BUCKET=0,
            **cfg.launch_options(),
            **args,
        )


def _contiguous(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A per-row (per-column) input of the kernel, stats [2, n] or a vector [n], as it reads it: contiguous
    (a copy of O(n) only where a view is given), None where absent."""
    return None if x is None else x.contiguous()


def _stat_stride(x: Optional[torch.Tensor]) -> int:
    """The distance between the rows of stats [2, n] (0 for a vector [n] or None)."""
    return x.stride(0) if x is not None and x.dim() == 2 else 0


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
    masks: Optional[MaskOptions] = None,
    row_positives: Optional[torch.Tensor] = None,
    col_positives: Optional[torch.Tensor] = None,
    row_uniform: Optional[torch.Tensor] = None,
    col_uniform: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Accumulate dq [Bq, D] and dk [Bk, D] in place (any strides); return dscale [2] (row part, column part).

    q, k, scale, pos as in :func:`infcl.kernels.softmax_forward.softmax_forward`; row_stats [2, Bq] and
    g_row [Bq], and for the symmetric loss col_stats [2, Bk] and g_col [Bk] (else None), all in the
    accumulation dtype, any strides. ``tiling``, ``autotune``, ``sms`` and ``wrap`` as in the forward.
    ``masks`` as in the forward, with each row's (column's, symmetric) positives: with ``multi_positive``
    "mean" their global count ``row_positives`` [Bq] (``col_positives`` [Bk]), with "sum" their global
    stats [2, Bq] ([2, Bk]); None with one positive per row. ``row_uniform`` [Bq] (``col_uniform`` [Bk],
    symmetric; masked only): label smoothing's weights, subtracted from dS on each kept entry of the row
    (column), as the accumulation dtype; None: none.
    """
    opts = launch_options(q.dtype, precision)
    q, k = tf32_operands(opts["PRECISION"], q, k)
    acc = dq.dtype
    n_q, dim = q.shape
    n_k = k.shape[0]
    symmetric = col_stats is not None
    if row_uniform is not None and masks is None:
        raise ValueError("softmax_backward: row_uniform needs mask options (the uniform part is over the kept entries)")
    if (row_uniform is not None and symmetric) != (col_uniform is not None):
        raise ValueError("softmax_backward: col_uniform goes with row_uniform on the symmetric loss, alone never")
    normalize = q.dtype == torch.float16
    # float16: max|g_row| (and max|g_col|, read only when symmetric), the dS normalizers; else absent.
    g_max = torch.stack([g.abs().amax() for g in (g_row, g_col) if g is not None]) if normalize else None
    # The stats' rows and the positives, as the kernel reads them: each row contiguous.
    row_stats, col_stats = _contiguous(row_stats), _contiguous(col_stats)
    row_positives, col_positives = _contiguous(row_positives), _contiguous(col_positives)
    common = dict(
        scale_ptr=scale,
        pos_ptr=pos,
        row_stats_ptr=row_stats,
        g_row_ptr=g_row.contiguous(),
        col_stats_ptr=col_stats,
        g_col_ptr=_contiguous(g_col),
        g_max_ptr=g_max,
        **qk_args(q, k),
        stride_row_stats=row_stats.stride(0),
        stride_col_stats=col_stats.stride(0) if symmetric else 0,
        SYMMETRIC=symmetric,
        **feature_chunks(dim, tiling.block_d(dim)),
        PRECISION=opts["PRECISION"],
        **mask_kernel_args(masks, q.dtype, precision),
        BRANCH_POSITIVES=branch_positives(q.dtype, precision),
        row_pos_ptr=row_positives,
        col_pos_ptr=col_positives,
        stride_row_pos=_stat_stride(row_positives),
        stride_col_pos=_stat_stride(col_positives),
        row_uniform_ptr=_contiguous(row_uniform),
        col_uniform_ptr=_contiguous(col_uniform),
        **COMPILE_OPTIONS,
    )
    dscale_parts = None
    for by_column, grad, cfg, n_owned, n_other in (
        (False, dq, tiling.dq, triton.cdiv(n_q, tiling.dq.block_m), triton.cdiv(n_k, tiling.dq.block_n)),
        (True, dk, tiling.dk, triton.cdiv(n_k, tiling.dk.block_n), triton.cdiv(n_q, tiling.dk.block_m)),
    ):
        block_out = tiling.block_out(cfg, dim)
        slices = triton.cdiv(dim, block_out)
        splits = plan_backward_splits(n_owned, n_other, slices, tiling, sms)
        # One split accumulates straight into the caller's gradient; several write fresh partials, contiguous
        # [splits, n, D] (the kernel finds a split's partial n rows on).
        out = grad if splits == 1 else torch.empty(splits, *grad.shape, dtype=acc, device=grad.device)
        args = dict(
            common,
            stride_out_split=out.stride(0) if splits > 1 else 0,
            **matrix_args("out", out),
            BY_COLUMN=by_column,
            ADD=splits == 1,
            BLOCK_OUT=block_out,
            EVEN_OUT=dim % block_out == 0,
        )
        if by_column:
            grid = lambda meta, slices=slices, splits=splits: (triton.cdiv(n_k, meta["BLOCK_N"]), slices, splits)  # noqa: E731
            _launch(_dk_autotuned, grid, dict(args, dscale_ptr=None), cfg, autotune, wrap)
        else:
            n_rows_max = triton.cdiv(n_q, min(_MIN_BLOCK_M, cfg.block_m) if autotune else cfg.block_m)
            dscale_parts = torch.zeros(n_rows_max * splits, 2, dtype=acc, device=q.device)
            grid = lambda meta, slices=slices, splits=splits: (triton.cdiv(n_q, meta["BLOCK_M"]), slices, splits)  # noqa: E731
            _launch(_dq_autotuned, grid, dict(args, dscale_ptr=dscale_parts), cfg, autotune, wrap)
        if splits > 1:
            grad += out.sum(dim=0)
    return dscale_parts.sum(dim=0)
