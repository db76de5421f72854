"""The kernels' arguments that the launchers compute on the host: the dtype options (ACC, UPCAST, PRECISION and
torch's own float32 matmul precision, TF32 rounding of the operands), the mask options' arguments
(:func:`mask_kernel_args`), the compiler options of every launch and the shape flags (EVEN_*, ONE_CHUNK).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..contract import MaskOptions
from .configs import DOT_PRECISIONS, FEATURE_CHUNKS, MIN_DOT, TENSOR_CORE_CLASSES, Tiling, operand_class_of
from .env import INTERPRETED
from .tiling import target_tiling


def torch_matmul_precision() -> str:
    """ "tf32" where torch's own float32 CUDA matmuls run in TF32, else "ieee". ``allow_tf32`` first (torch.compile
    traces it; on torch 2.9+ it reflects ``fp32_precision`` too), and where reading it raises (torch 2.9+ after
    TF32 was set through ``torch.backends.cuda.matmul.fp32_precision`` or ``torch.backends.fp32_precision``),
    ``fp32_precision``, which then says "tf32"."""
    matmul = torch.backends.cuda.matmul
    try:
        return "tf32" if matmul.allow_tf32 else "ieee"
    except RuntimeError:  # mixed legacy and new TF32 settings
        return "tf32" if matmul.fp32_precision == "tf32" else "ieee"


# TF32 keeps float32's top 19 bits (sign, 8 exponent bits, 10 mantissa bits): the low 13 go.
_TF32_DROPPED = 13


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to TF32, to nearest with ties away from zero (PTX ``cvt.rna.tf32.f32``), as
    float32 values whose low 13 bits are 0; NaN stays NaN, a value past TF32's largest rounds to inf. On the
    bits: add half of the dropped part's unit, then clear the dropped bits (sign-magnitude, so the carry
    rounds the magnitude; a mantissa carry steps the exponent, which is the correct rounding)."""
    rounded = x.view(torch.int32) + (1 << (_TF32_DROPPED - 1))
    rounded.bitwise_and_(-(1 << _TF32_DROPPED))
    return torch.where(torch.isnan(x), x, rounded.view(torch.float32))


def tf32_operands(precision: str, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``tensors`` as the products' operands at tl.dot ``precision``: at "tf32", float32 tensors rounded to
    TF32 (:func:`round_to_tf32`; O(B * D) copies), else unchanged. The tensor cores read only an operand's
    top 19 bits, i.e. truncate it: every product of two positive operands comes out low by ~2**-11 of
    itself, so a confident row's positive logit and with it the loss carry a bias (8.7e-3 of the loss on
    an H100, against torch's 6.8e-5: cuBLAS rounds). Rounded once here, the operands are exact in TF32
    and the products unbiased; dS is rounded the same way in the kernels (:func:`score_tiles.dot_operand`)."""
    if precision != "tf32":
        return tensors
    return tuple(round_to_tf32(t) if t.dtype == torch.float32 else t for t in tensors)


def launch_options(dtype: torch.dtype, precision: Optional[str] = None) -> dict:
    """The dtype-dependent constexprs (ACC, UPCAST, PRECISION) for inputs of ``dtype``."""
    if precision is not None and precision not in DOT_PRECISIONS:
        raise ValueError(f"precision must be None or one of {DOT_PRECISIONS}, got {precision!r}")
    if dtype == torch.float32 and not INTERPRETED:
        if precision is None:
            precision = torch_matmul_precision()
    else:
        precision = "ieee"
    return {
        "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
        "UPCAST": INTERPRETED and dtype in (torch.bfloat16, torch.float16),
        "PRECISION": precision,
    }


def branch_positives(dtype: torch.dtype, precision: Optional[str] = None) -> bool:
    """BRANCH_POSITIVES, a softmax kernel constexpr: whether the positives' work (the positive logit, dS's
    expm1) sits on a uniform branch taken only by the tiles that may hold a positive (tile_stats.holds_positive).
    On tensor cores; not for the FMA classes (ieee, fp64), at their register limit; always under the interpreter,
    which tests it."""
    return INTERPRETED or operand_class_of(dtype, precision) in TENSOR_CORE_CLASSES


# ---- the mask options (infcl.masks) ----------------------------------------------------------------

# POSITIVES, the kernels' positives kind: one per row (``pos``; multi_positive None), or every column
# with the row's id, "mean" or "sum" (see softmax_mask_tiles.ONE_POSITIVE).
POSITIVES = {None: 0, "mean": 1, "sum": 2}


def guide_precision(dtype: torch.dtype, precision: Optional[str], guide_float64: bool) -> str:
    """tl.dot's input precision for the guide scores G = guide_q @ guide_k.T (float32 guides, float32
    sums), next to features of ``dtype`` at ``precision``: "tf32" where the features' products run on
    tensor cores (bfloat16 / float16, or float32 at tf32), "ieee" (FMA) where they do not (float32
    "ieee", float64, the interpreter), float64 guides in float64.

    tf32 keeps 10 mantissa bits: a guide that was bfloat16 or float16 features (as a guide model's
    usually are) is multiplied exactly, its scores those of float32 products; a float32 guide's features
    are rounded to 10 bits, which moves a score by ~1e-3 of |G| and can flip only exclusions that close
    to their threshold. An FMA guide GEMM would cost ~16 times a bfloat16 one and the registers of the
    features' own tiles.
    """
    if guide_float64 or INTERPRETED or dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32:
        return launch_options(dtype, precision)["PRECISION"]
    return "tf32"


def mask_kernel_args(masks: Optional[MaskOptions], dtype: torch.dtype, precision: Optional[str]) -> dict:
    """The launch's flattening of the mask options (:class:`infcl.masks.MaskOptions`, or None for the plain
    loss): the softmax kernels' mask arguments by keyword for features of ``dtype`` at ``precision``. The
    pointers (None where absent: the kernels read which mask options are given from them; ids and
    thresholds stride 1, as the ops pass them), the guides' rows contiguous and their row strides, the
    guide width and the constexprs POSITIVES and the guide GEMM's BLOCK_G, EVEN_G and GUIDE_PRECISION (its
    accumulation dtype is the guides' own). With no masks every pointer is None and nothing is read.

    The guide GEMM (:func:`guide_precision`) runs on the tensor cores wherever the features' products
    do, and its feature chunk is its operand class's (:data:`FEATURE_CHUNKS`): a function of D' and
    the dtypes alone, so the forward and both backward kernels sum each guide score over the same
    chunks and find the same exclusions.
    """
    masks = masks or MaskOptions()
    gq, gk = masks.guide_q, masks.guide_k
    has_guide = gq is not None
    if has_guide:  # rows of contiguous features (a copy only where a view is given)
        gq, gk = (g if g.stride(1) == 1 else g.contiguous() for g in (gq, gk))
    dim = gq.shape[1] if has_guide else 0
    guide_float64 = has_guide and gq.dtype == torch.float64
    precision = guide_precision(dtype, precision, guide_float64)
    operand_class = operand_class_of(torch.float64 if guide_float64 else torch.float32, precision)
    block_g = min(max(triton.next_power_of_2(max(dim, 1)), MIN_DOT), FEATURE_CHUNKS[operand_class][1])
    return dict(
        q_ids_ptr=masks.q_ids,
        k_ids_ptr=masks.k_ids,
        gq_ptr=gq,
        gk_ptr=gk,
        row_thr_ptr=masks.row_threshold,
        col_thr_ptr=masks.col_threshold,
        DG=dim,
        stride_gq=gq.stride(0) if has_guide else 0,
        stride_gk=gk.stride(0) if has_guide else 0,
        POSITIVES=POSITIVES[masks.multi_positive],
        BLOCK_G=block_g,
        EVEN_G=dim % block_g == 0,
        GUIDE_PRECISION=precision,
    )


# Every kernel launch passes these compiler options. FMA contraction stays on (it speeds up the
# elementwise math); the one product that must not be contracted, S = raw * scale, is an explicit
# mul.rn (tiles.scale_scores). Saying so explicitly also keeps Triton 3.9 from warning about its default.
# (maxnreg is per config: TileConfig.max_registers.)
COMPILE_OPTIONS = {"enable_fp_fusion": True}


# Shape flags every kernel takes as constexprs, computed by the launcher (a triton.heuristics wrapper
# is not a kernel torch.library.wrap_triton accepts): where a block cannot be ragged its loads and
# stores go unmasked.


def even_blocks(n_q: int, n_k: int, block_m: int, block_n: int) -> dict:
    """EVEN_M / EVEN_N: whether Bq (Bk) is a whole number of row (column) blocks."""
    return {"EVEN_M": n_q % block_m == 0, "EVEN_N": n_k % block_n == 0}


def feature_chunks(dim: int, block_d: int) -> dict:
    """BLOCK_D, the feature chunk; ONE_CHUNK: D fits one chunk (held in registers); EVEN_D: D is a whole number of
    chunks."""
    return {"BLOCK_D": block_d, "ONE_CHUNK": dim <= block_d, "EVEN_D": dim % block_d == 0}


def matrix_args(name: str, x) -> dict:
    """A strided matrix as a kernel entry takes it, flat: ``<name>_ptr`` and its row and column strides
    ``stride_<name>0`` / ``stride_<name>1`` (the last two dimensions'). Inside, the entry packs them into one
    :class:`infcl.kernels.score_tiles.Matrix`."""
    return {f"{name}_ptr": x, f"stride_{name}0": x.stride(-2), f"stride_{name}1": x.stride(-1)}


def qk_args(q, k) -> dict:
    """q [Bq, D] and k [Bk, D] as every kernel entry takes them, flat: the sizes ``n_q``, ``n_k``, ``D`` and each
    one's :func:`matrix_args`."""
    return dict(n_q=q.shape[0], n_k=k.shape[0], D=q.shape[1], **matrix_args("q", q), **matrix_args("k", k))


def launch_args(q, k, precision: Optional[str], family: str = "rank", tiling: Optional[Tiling] = None):
    """(arguments, tiling) of a kernel over one S tile per program with no mask options (the ranks', distillation's,
    top-k's, the sigmoid forward's): q and k (:func:`qk_args`, TF32-rounded at "tf32"), the forward config's S
    tile and feature chunk, the dtype options and the compile options; ``tiling`` the caller's, else kernel
    ``family``'s on the active target (:func:`infcl.kernels.tiling.target_tiling`: "rank", the ranks' and
    distillation's; "topk"; "sigmoid"; "matryoshka")."""
    opts = launch_options(q.dtype, precision)
    q, k = tf32_operands(opts["PRECISION"], q, k)
    if tiling is None:
        tiling = target_tiling(family, q.dtype, opts["PRECISION"])
    cfg = tiling.forward
    args = dict(
        **qk_args(q, k),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=tiling.block_d(q.shape[1]),
        **cfg.launch_options(),
        **opts,
        **COMPILE_OPTIONS,
    )
    return args, tiling
