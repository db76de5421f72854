"""The fused Matryoshka kernels' launchers and their custom ops (the kernels: :mod:`infcl.kernels.matryoshka`;
the backend object: :mod:`infcl.backends.triton.matryoshka`): the launch arguments (the rank kernels' plus the
prefixes and their factors, and the mask options), the forward and backward bodies of the plain and the masked ops
and their fake impls."""

from typing import Optional, Tuple

import torch
import triton

from ..contract import MaskOptions, Tensor
from ..masks import MASKED_ROWS, POS_REL
from .kernel_args import mask_kernel_args, matrix_args
from .matryoshka import (
    _masked_matryoshka_backward_kernel,
    _masked_matryoshka_forward_kernel,
    _matryoshka_backward_kernel,
    _matryoshka_forward_kernel,
)
from .rank import launch_args
from .registration import register_op, wrap
from .softmax_forward import _empty_partials
from .softmax_ops import _mask_options as mask_options

# Partials per line and prefix of the forward: the stats (max, rest) and, by rows, the positive logit.
FORWARD_ROWS = 3


# Partials per line and prefix of the forward: the stats (max, rest) and, by rows, the positive logit.
FORWARD_ROWS = 3
# Partials per line and prefix of the backward's slice-0 programs: sum dS_row * u and sum dS_col * u.
SUM_ROWS = 2


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
