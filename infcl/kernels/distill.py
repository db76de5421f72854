"""The distillation loss's block steps as Triton kernels (``cal_distill_loss(backend="triton")``; the math and
the partials: :mod:`infcl.losses.distill`; the torch tiles' version: :mod:`infcl.backends.torch_tiles.distill`;
the backend object: :mod:`infcl.backends.triton.distill`).

Each tile of the student's S = scale * q @ k.T is formed beside the same tile of the teacher's
T = teacher_scale * tq @ tk.T, both by :func:`infcl.kernels.score_tiles.score_chunks` in the q-rows x k-rows
orientation on one S tile config (:func:`infcl.kernels.tiling.rank_tiling`) and scaled by one rounded
multiply (:func:`infcl.kernels.score_tiles.masked_scores`), so every kernel forms the same bits and S - m,
T - mT are exact at a line's maxima.

- :func:`_distill_forward_kernel`: a program owns BLOCK_M rows (``BY_COLUMN`` False) or BLOCK_N columns
  (True) and walks the other side's blocks, keeping per line the student's and the teacher's stats in
  rest form and cross = sum exp(T - mT) * (m - S), merged tile by tile with the one online merge of
  the kernels (:func:`infcl.kernels.tile_stats.merge_rest_stats`) and cross rescaled beside it:
  (cross + (M - m) * (1 + rest_T)) * exp(mT - MT) per side. The host turns rest into r = log1p(rest).
- :func:`_distill_backward_kernel`: a program owns (BLOCK_M rows or BLOCK_N columns) x (a BLOCK_OUT slice
  of D), recomputes S and T per tile, forms dS = g_row (softmax_row(S) - softmax_row(T)) (+ the columns'
  term when symmetric) and accumulates dq = scale * dS @ k (rows) or dk = scale * dS.T @ q (columns) in
  registers; the row programs of slice 0 also write their sums of dS * (q @ k.T) per direction. No
  atomics: each output has one program.

dS at an entry equal to its line's student maximum (the only one where both probabilities can exceed
1/2) is -sign(a - b) * exp(max(a, b)) * expm1(-|a - b|), a = (S - m) - r, b = (T - mT) - rT, so two
near-1 probabilities keep the digits of their difference; elsewhere exp(a) - exp(b).

GEMM-equivalents per block: forward 2 per direction (S and T; symmetric: 4), backward 3 per walk and D
slice (S, T, the gradient product): 6 for a D of one slice, against 2 + 4 for the torch and native
backends, the price of no atomics.
"""

from typing import Any, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..contract import DISTILL_ROWS, Tensor
from ..op_fakes import dscale_fake, stats_fake
from .kernel_args import launch_args, matrix_args, tf32_operands
from .rank import program_lines, tile_at
from .registration import register_op, wrap
from .score_tiles import (
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
from .tile_stats import exp, expm1, merge_rest_stats, tile_rest_stats


class Operands(NamedTuple):
    """A distillation kernel's operands: the student's q and k and the teacher's tq and tk (:class:`Matrix`
    each), and ``params_ptr``: (scale, teacher_scale), read in the kernel."""

    q: Any
    k: Any
    tq: Any
    tk: Any
    params_ptr: Any


@triton.jit
def _tiles(ops, rows, cols, tile, t_tile, dot):
    """(raw, s, t) of the tile q[rows] x k[cols]: raw = q @ k.T, s = scale * raw and t = teacher_scale *
    tq @ tk.T (``tile`` / ``t_tile``: the student's and the teacher's S tile), -inf outside the block. Every
    kernel forms them here."""
    raw = score_chunks(ops.q, ops.k, rows, cols, tile, dot)
    t_raw = score_chunks(ops.tq, ops.tk, rows, cols, t_tile, dot)
    s = masked_scores(raw, tl.load(ops.params_ptr), rows, cols, ops.q.n, ops.k.n, True, True)
    t = masked_scores(t_raw, tl.load(ops.params_ptr + 1), rows, cols, ops.q.n, ops.k.n, True, True)
    return raw, s, t


@triton.jit
def _cross_rescaled(cross, m, rest_t, m_t, new_m, new_m_t):
    """cross relative to the maxima (new_m, new_m_t) >= (m, m_t): (cross + (M - m) * (1 + rest_T)) *
    exp(mT - MT); 0 for the empty set (m = -inf)."""
    shifted = (cross + (new_m - m) * (rest_t + 1.0)) * exp(m_t - new_m_t)
    return tl.where(m == float("-inf"), 0.0, shifted)


@triton.jit
def _distill_forward_kernel(
    q_ptr,
    k_ptr,
    tq_ptr,
    tk_ptr,
    params_ptr,
    out_ptr,
    n_q,
    n_k,
    D,
    DT,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_tq0,
    stride_tq1,
    stride_tk0,
    stride_tk1,
    BY_COLUMN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DT: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    _distill_forward_lines(
        Operands(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            Matrix(tq_ptr, n_q, DT, stride_tq0, stride_tq1),
            Matrix(tk_ptr, n_k, DT, stride_tk0, stride_tk1),
            params_ptr,
        ),
        out_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
        Tile(BLOCK_M, BLOCK_N, BLOCK_DT, True, True, True),
        Dot(ACC, UPCAST, PRECISION),
        BY_COLUMN,
    )


@triton.jit
def _distill_forward_lines(ops, out_ptr, tile, t_tile, dot, BY_COLUMN: tl.constexpr):
    """The forward program's lines (rows, or BY_COLUMN columns): their student and teacher stats and cross
    term, stored to ``out_ptr`` [5, n]."""
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    ACC: tl.constexpr = dot.ACC
    n_q = ops.q.n
    n_k = ops.k.n
    lines, n_lines, n_other, step = program_lines(n_q, n_k, BY_COLUMN, BLOCK_M, BLOCK_N)
    AXIS: tl.constexpr = 0 if BY_COLUMN else 1  # the tile's axis along a line
    zero = tl.zeros(lines.shape, ACC)
    # Running partials (the empty set: max -inf, rest -1): student (m, rest), teacher (m_t, rest_t), cross.
    m, rest, m_t, rest_t, cross = zero - float("inf"), zero - 1.0, zero - float("inf"), zero - 1.0, zero
    for o0 in range(0, n_other, step):
        rows, cols = tile_at(lines, o0, BY_COLUMN, BLOCK_M, BLOCK_N)
        raw, s, t = _tiles(ops, rows, cols, tile, t_tile, dot)
        tile_m, tile_rest = tile_rest_stats(s, AXIS)
        tile_m_t, tile_rest_t = tile_rest_stats(t, AXIS)
        if BY_COLUMN:
            weights, gaps = exp(t - tile_m_t[None, :]), tile_m[None, :] - s
        else:
            weights, gaps = exp(t - tile_m_t[:, None]), tile_m[:, None] - s
        inside = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        tile_cross = tl.sum(tl.where(inside, weights * gaps, 0.0), axis=AXIS)  # >= 0: no cancellation
        new_m = tl.maximum(m, tile_m)
        new_m_t = tl.maximum(m_t, tile_m_t)
        cross = _cross_rescaled(cross, m, rest_t, m_t, new_m, new_m_t) + _cross_rescaled(
            tile_cross, tile_m, tile_rest_t, tile_m_t, new_m, new_m_t
        )
        m, rest = merge_rest_stats(m, rest, tile_m, tile_rest)
        m_t, rest_t = merge_rest_stats(m_t, rest_t, tile_m_t, tile_rest_t)
    ok = lines < n_lines
    tl.store(out_ptr + lines, m, mask=ok)
    tl.store(out_ptr + n_lines + lines, rest, mask=ok)
    tl.store(out_ptr + 2 * n_lines + lines, m_t, mask=ok)
    tl.store(out_ptr + 3 * n_lines + lines, rest_t, mask=ok)
    tl.store(out_ptr + 4 * n_lines + lines, cross, mask=ok)


@triton.jit
def _probability_gap(s, t, stats_ptr, idx, n, g_ptr, ROWS: tl.constexpr):
    """g * (softmax(S) - softmax(T)) over the tile along rows (ROWS: each row's stats) or columns, from the
    lines' global (m, r, mT, rT) at stats_ptr [4, n] and their upstream gradients g; 0 past n."""
    m = load_vector(stats_ptr, idx, n, 1, 0.0, True)
    r = load_vector(stats_ptr + n, idx, n, 1, 0.0, True)
    m_t = load_vector(stats_ptr + 2 * n, idx, n, 1, 0.0, True)
    r_t = load_vector(stats_ptr + 3 * n, idx, n, 1, 0.0, True)
    g = load_vector(g_ptr, idx, n, 1, 0.0, True)
    if ROWS:
        m, r, m_t, r_t, g = m[:, None], r[:, None], m_t[:, None], r_t[:, None], g[:, None]
    else:
        m, r, m_t, r_t, g = m[None, :], r[None, :], m_t[None, :], r_t[None, :], g[None, :]
    a = (s - m) - r
    b = (t - m_t) - r_t
    d = a - b
    at_max = s == m  # a = -r: where both probabilities may exceed 1/2
    sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    exact = -sign * exp(tl.maximum(a, b)) * expm1(tl.where(at_max, -tl.abs(d), 0.0))
    return tl.where(at_max, g * exact, g * (exp(a) - exp(b)))


@triton.jit
def _distill_backward_kernel(
    q_ptr,
    k_ptr,
    tq_ptr,
    tk_ptr,
    params_ptr,
    row_stats_ptr,
    g_row_ptr,
    col_stats_ptr,
    g_col_ptr,
    grad_ptr,
    partials_ptr,
    n_q,
    n_k,
    D,
    DT,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    stride_tq0,
    stride_tq1,
    stride_tk0,
    stride_tk1,
    stride_grad0,
    stride_grad1,
    BY_COLUMN: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DT: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    _distill_backward_lines(
        Operands(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            Matrix(tq_ptr, n_q, DT, stride_tq0, stride_tq1),
            Matrix(tk_ptr, n_k, DT, stride_tk0, stride_tk1),
            params_ptr,
        ),
        (row_stats_ptr, g_row_ptr, col_stats_ptr, g_col_ptr),
        Matrix(grad_ptr, n_q if not BY_COLUMN else n_k, D, stride_grad0, stride_grad1),
        partials_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
        Tile(BLOCK_M, BLOCK_N, BLOCK_DT, True, True, True),
        Dot(ACC, UPCAST, PRECISION),
        BY_COLUMN,
        SYMMETRIC,
        BLOCK_OUT,
    )


@triton.jit
def _distill_backward_lines(
    ops,
    upstream,
    grad_out,
    partials_ptr,
    tile,
    t_tile,
    dot,
    BY_COLUMN: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
):
    """The backward program's lines (rows, or BY_COLUMN columns) and feature slice: their gradient slice
    (added to ``grad_out``) and, by rows, the dscale partials; ``upstream``: (row_stats_ptr, g_row_ptr,
    col_stats_ptr, g_col_ptr)."""
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    ACC: tl.constexpr = dot.ACC
    n_q = ops.q.n
    n_k = ops.k.n
    D = ops.q.d
    pid = tl.program_id(0).to(tl.int64)
    feats = tl.program_id(1).to(tl.int64) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    lines, n_lines, n_other, step = program_lines(n_q, n_k, BY_COLUMN, BLOCK_M, BLOCK_N)
    grad = tl.zeros([lines.shape[0], BLOCK_OUT], ACC)
    dscale_rows = tl.zeros([BLOCK_M], ACC)  # per row of the tile: the row walk's sums of dS * raw
    dscale_cols = tl.zeros([BLOCK_M], ACC)
    for o0 in range(0, n_other, step):
        rows, cols = tile_at(lines, o0, BY_COLUMN, BLOCK_M, BLOCK_N)
        raw, s, t = _tiles(ops, rows, cols, tile, t_tile, dot)
        inside = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        ds = tl.where(inside, _probability_gap(s, t, upstream[0], rows, n_q, upstream[1], True), 0.0)
        if not BY_COLUMN:
            dscale_rows += tl.sum(ds * raw, axis=1)
        if SYMMETRIC:
            ds_cols = tl.where(inside, _probability_gap(s, t, upstream[2], cols, n_k, upstream[3], False), 0.0)
            if not BY_COLUMN:
                dscale_cols += tl.sum(ds_cols * raw, axis=1)
            ds = ds + ds_cols
        if BY_COLUMN:
            other = load_tile(ops.q, rows, feats, True, True)
            operand = dot_operand(tl.trans(ds), ops.q.ptr.dtype.element_ty, dot.PRECISION)
        else:
            other = load_tile(ops.k, cols, feats, True, True)
            operand = dot_operand(ds, ops.k.ptr.dtype.element_ty, dot.PRECISION)
        grad = tile_dot(operand, other, grad, dot.UPCAST, dot.PRECISION)
    scale = tl.load(ops.params_ptr)
    mask = (lines[:, None] < n_lines) & (feats[None, :] < D)
    ptrs = grad_out.ptr + lines[:, None] * grad_out.stride_r + feats[None, :] * grad_out.stride_c
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + scale * grad, mask=mask)
    if not BY_COLUMN:
        first_slice = tl.program_id(1) == 0  # every slice recomputes the same dS: one writes its sums
        tl.store(partials_ptr + 2 * pid, tl.sum(dscale_rows, axis=0), mask=first_slice)
        tl.store(partials_ptr + 2 * pid + 1, tl.sum(dscale_cols, axis=0), mask=first_slice)


def _launch_args(q: Tensor, k: Tensor, scale: Tensor, tq: Tensor, tk: Tensor, teacher_scale: Tensor, precision):
    """The rank kernels' arguments (:func:`infcl.kernels.rank.launch_args`) plus the teacher's features (in the
    accumulation dtype, as the torch tiles take them), the scales; the tiling and the accumulation dtype."""
    args, tiling = launch_args(q, k, precision)
    tq, tk = tf32_operands(args["PRECISION"], tq, tk)
    acc = torch.float64 if args["q_ptr"].dtype == torch.float64 else torch.float32
    # Tensors, not launch arguments: a Python float would be rounded to float32.
    params = torch.stack((scale.to(acc), teacher_scale.to(device=q.device, dtype=acc)))
    args.update(
        params_ptr=params,
        DT=tq.shape[1],
        **matrix_args("tq", tq),
        **matrix_args("tk", tk),
        BLOCK_DT=tiling.block_d(tq.shape[1]),
    )
    return args, tiling, acc


def _forward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    teacher_q: Tensor,
    teacher_k: Tensor,
    teacher_scale: Tensor,
    symmetric: bool,
    precision: str,
) -> Tuple[Tensor, Tensor]:
    args, tiling, acc = _launch_args(q, k, scale, teacher_q, teacher_k, teacher_scale, precision or None)
    out = []
    for by_column, n, block_size in (
        (False, args["n_q"], tiling.forward.block_m),
        (True, args["n_k"], tiling.forward.block_n),
    )[: 2 if symmetric else 1]:
        packed = torch.empty(DISTILL_ROWS, n, dtype=acc, device=q.device)
        wrap(_distill_forward_kernel)[(triton.cdiv(n, block_size),)](out_ptr=packed, BY_COLUMN=by_column, **args)
        packed[1:4:2].log1p_()  # rest -> r = log1p(rest) (-inf for the empty set), the student's and the teacher's
        out.append(packed)
    if not symmetric:
        out.append(torch.empty(DISTILL_ROWS, 0, dtype=acc, device=q.device))
    return tuple(out)


def _backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    teacher_q: Tensor,
    teacher_k: Tensor,
    teacher_scale: Tensor,
    row_stats: Tensor,
    g_row: Tensor,
    col_stats: Optional[Tensor],
    g_col: Optional[Tensor],
    dq: Tensor,
    dk: Tensor,
    precision: str,
) -> Tensor:
    args, tiling, acc = _launch_args(q, k, scale, teacher_q, teacher_k, teacher_scale, precision or None)
    cfg, dim = tiling.dq, args["D"]
    block_out = tiling.block_out(cfg, dim)
    symmetric = col_stats is not None
    row_stats = row_stats.to(acc).contiguous()
    col_stats = col_stats.to(acc).contiguous() if symmetric else row_stats
    g_row = g_row.to(acc).contiguous()
    g_col = g_col.to(acc).contiguous() if symmetric else g_row
    row_programs = triton.cdiv(args["n_q"], cfg.block_m)
    partials = torch.zeros(row_programs, 2, dtype=acc, device=q.device)
    # dq from the row walk, dk from the column walk (one direction: of the rows' term alone)
    for by_column, grad, programs in ((False, dq, row_programs), (True, dk, triton.cdiv(args["n_k"], cfg.block_n))):
        wrap(_distill_backward_kernel)[(programs, triton.cdiv(dim, block_out))](
            row_stats_ptr=row_stats,
            g_row_ptr=g_row,
            col_stats_ptr=col_stats,
            g_col_ptr=g_col,
            partials_ptr=partials,
            **matrix_args("grad", grad),
            BY_COLUMN=by_column,
            SYMMETRIC=symmetric,
            BLOCK_OUT=block_out,
            **args,
        )
    return partials.sum(dim=0)


# The block steps as custom ops, registered as the loss kernels' are (:func:`.registration.register_op`), with the
# native kernel's schemas (csrc/distill.cpp) but the scales as 0-d tensors (no host sync) and ``precision``
# ("" for None): torch.ops.infcl.triton_distill_forward_block -> (rows [5, Bq], cols [5, Bk] or [5, 0]),
# packed (m, r, mT, rT, cross); torch.ops.infcl.triton_distill_backward_block(..., row_stats [4, Bq]
# (m, r, mT, rT), g_row, col_stats, g_col (None: one direction), dq!, dk!, precision) -> dscale [2].
forward_op = register_op("triton_distill_forward_block", _forward, stats_fake(DISTILL_ROWS, DISTILL_ROWS, 6))
backward_op = register_op("triton_distill_backward_block", _backward, dscale_fake, ("dq", "dk"))
