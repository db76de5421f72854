"""The retrieval ranks' two passes as Triton kernels (``retrieval_metrics(backend="triton")``; definitions,
tie rule: :mod:`infcl.contract`; the torch tiles' version: :mod:`infcl.backends.torch_tiles.rank`; the backend
object: :mod:`infcl.backends.triton.rank`).

Both passes cut S = q @ k.T into the same tiles (BLOCK_M q rows x BLOCK_N k rows, summed over the same
BLOCK_D feature chunks by :func:`infcl.kernels.score_tiles.score_chunks`, always in that orientation, on one S
tile config): every tile is the same bits in every kernel, so the best positive's score (pass 1) ties
an exact duplicate in pass 2. Each kernel runs twice, ``BY_COLUMN`` False (a program owns BLOCK_M rows and
walks the column blocks) and True (it owns BLOCK_N columns and walks the row blocks): no atomics, every
output written by the one program that owns it.

- :func:`_best_positives_kernel` (pass 1): per line, the best positive's score, its global index (the
  lowest among equal scores) and the number of positives; a tile that holds no positive is skipped on a
  uniform branch (with labels: the rows' positive span, :func:`infcl.kernels.tile_stats.positive_span`; with
  ``ANY``: the ids of the tile's rows and columns).
- :func:`_ahead_counts_kernel` (pass 2): per line, the entries ahead of its best (greater, or equal with
  a lower global index; with ``EXCLUDE`` never one with the row's id) and the number of NaN or infinite
  scores.

GEMM-equivalents: pass 1 a sliver of one with labels (the tiles holding positives, twice), pass 2 two (the
row and the column walks recompute every tile): 2 + the sliver, against 1 + the sliver for the torch
and native backends (which count both directions from one tile), the price of no atomics.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..contract import NO_INDEX, Ahead, Best, Tensor
from ..op_fakes import ahead_counts_fake, best_positives_fake
from .kernel_args import launch_args
from .registration import register_op, wrap
from .score_tiles import Dot, Matrix, Tile, load_vector, score_chunks
from .tile_stats import positive_span

# infcl.contract.NO_INDEX where the kernels see it (a module-level value inside @triton.jit must be a constexpr).
NO_BEST = tl.constexpr(NO_INDEX)


@triton.jit
def _line_ids(ptr, idx, n, PRESENT: tl.constexpr):
    """ids at ``idx`` (-1 past n), or ``idx`` as an unused placeholder when absent."""
    if PRESENT:
        ids = load_vector(ptr, idx, n, 1, -1, True)
    else:
        ids = idx
    return ids


@triton.jit
def program_lines(n_q, n_k, BY_COLUMN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lines, n_lines, n_other, step) of a walk's program: its BLOCK_M rows (BY_COLUMN False) or BLOCK_N
    columns (True), how many that side has, the other side's length, and the other side's block (the
    walk's step)."""
    pid = tl.program_id(0).to(tl.int64)
    if BY_COLUMN:
        lines, n_lines, n_other, step = pid * BLOCK_N + tl.arange(0, BLOCK_N), n_k, n_q, BLOCK_M
    else:
        lines, n_lines, n_other, step = pid * BLOCK_M + tl.arange(0, BLOCK_M), n_q, n_k, BLOCK_N
    return lines, n_lines, n_other, step


@triton.jit
def tile_at(lines, o0, BY_COLUMN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows, cols) of the walk's tile whose other side starts at o0."""
    if BY_COLUMN:
        rows, cols = o0 + tl.arange(0, BLOCK_M).to(tl.int64), lines
    else:
        rows, cols = lines, o0 + tl.arange(0, BLOCK_N).to(tl.int64)
    return rows, cols


@triton.jit
def _best_positives_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    q_ids_ptr,
    k_ids_ptr,
    row_index_ptr,
    col_index_ptr,
    score_ptr,
    best_ptr,
    count_ptr,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    BY_COLUMN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    ANY: tl.constexpr = q_ids_ptr is not None  # the positives: the ids' matches, else pos
    lines, n_lines, n_other, step = program_lines(n_q, n_k, BY_COLUMN, BLOCK_M, BLOCK_N)
    best = tl.full(lines.shape, float("-inf"), ACC)
    best_index = tl.full(lines.shape, NO_BEST, tl.int64)
    count = tl.zeros(lines.shape, tl.int64)
    for o0 in range(0, n_other, step):
        rows, cols = tile_at(lines, o0, BY_COLUMN, BLOCK_M, BLOCK_N)
        row_ids = _line_ids(q_ids_ptr, rows, n_q, ANY)  # (the compiler hoists what does not change)
        col_ids = _line_ids(k_ids_ptr, cols, n_k, ANY)
        row_pos = load_vector(pos_ptr, rows, n_q, 1, -1, True)
        lo, hi = positive_span(row_pos)
        if ANY:
            positive = (row_ids[:, None] == col_ids[None, :]) & (rows[:, None] < n_q) & (cols[None, :] < n_k)
            holds = tl.max(positive.to(tl.int32)) > 0
        else:
            positive = cols[None, :] == row_pos[:, None]  # -1 past n_q and where the positive is elsewhere
            c0 = tl.min(cols, axis=0)  # the tile's first column
            holds = (hi >= c0) & (lo < c0 + BLOCK_N)
        if holds:
            raw = score_chunks(
                Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
                Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
                rows,
                cols,
                Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
                Dot(ACC, UPCAST, PRECISION),
            )  # pass 2 forms exactly this tile
            values = tl.where(positive, raw, float("-inf"))
            if BY_COLUMN:
                other = load_vector(row_index_ptr, rows, n_q, 1, NO_BEST, True)
                top = tl.max(values, axis=0)
                first = tl.min(tl.where(positive & (values == top[None, :]), other[:, None], NO_BEST), axis=0)
                found = tl.sum(positive.to(tl.int64), axis=0)
            else:
                other = load_vector(col_index_ptr, cols, n_k, 1, NO_BEST, True)
                top = tl.max(values, axis=1)
                first = tl.min(tl.where(positive & (values == top[:, None]), other[None, :], NO_BEST), axis=1)
                found = tl.sum(positive.to(tl.int64), axis=1)
            better = (top > best) | ((top == best) & (first < best_index))
            best = tl.where(better, top, best)
            best_index = tl.where(better, first, best_index)
            count += found
    ok = lines < n_lines
    tl.store(score_ptr + lines, best, mask=ok)
    tl.store(best_ptr + lines, best_index, mask=ok)
    tl.store(count_ptr + lines, count, mask=ok)


@triton.jit
def _ahead_counts_kernel(
    q_ptr,
    k_ptr,
    score_ptr,
    best_ptr,
    q_ids_ptr,
    k_ids_ptr,
    row_index_ptr,
    col_index_ptr,
    ahead_ptr,
    nonfinite_ptr,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    BY_COLUMN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    EXCLUDE: tl.constexpr = q_ids_ptr is not None  # equal ids are never ahead
    lines, n_lines, n_other, step = program_lines(n_q, n_k, BY_COLUMN, BLOCK_M, BLOCK_N)
    ahead = tl.zeros(lines.shape, tl.int32)
    bad = tl.zeros(lines.shape, tl.int32)
    threshold = load_vector(score_ptr, lines, n_lines, 1, 0.0, True)
    best_index = load_vector(best_ptr, lines, n_lines, 1, NO_BEST, True)
    for o0 in range(0, n_other, step):
        rows, cols = tile_at(lines, o0, BY_COLUMN, BLOCK_M, BLOCK_N)
        row_ids = _line_ids(q_ids_ptr, rows, n_q, EXCLUDE)
        col_ids = _line_ids(k_ids_ptr, cols, n_k, EXCLUDE)
        raw = score_chunks(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            rows,
            cols,
            Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
            Dot(ACC, UPCAST, PRECISION),
        )  # bit-identical to pass 1's tile
        inside = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        if EXCLUDE:
            inside = inside & (row_ids[:, None] != col_ids[None, :])
        not_finite = (raw != raw) | (tl.abs(raw) == float("inf"))
        if BY_COLUMN:
            other = load_vector(row_index_ptr, rows, n_q, 1, NO_BEST, True)
            t = threshold[None, :]
            is_ahead = (raw > t) | ((raw == t) & (other[:, None] < best_index[None, :]))
            ahead += tl.sum((is_ahead & inside).to(tl.int32), axis=0)
            bad += tl.sum((not_finite & inside).to(tl.int32), axis=0)
        else:
            other = load_vector(col_index_ptr, cols, n_k, 1, NO_BEST, True)
            t = threshold[:, None]
            is_ahead = (raw > t) | ((raw == t) & (other[None, :] < best_index[:, None]))
            ahead += tl.sum((is_ahead & inside).to(tl.int32), axis=1)
            bad += tl.sum((not_finite & inside).to(tl.int32), axis=1)
    ok = lines < n_lines
    tl.store(ahead_ptr + lines, ahead.to(tl.int64), mask=ok)
    tl.store(nonfinite_ptr + lines, bad.to(tl.int64), mask=ok)


def _walks(q: Tensor, k: Tensor, symmetric: bool, precision: str, launch, empty) -> tuple:
    """A pass's outputs, flat: ``launch(args, by_column, n, grid)`` (the kernel's launch arguments, BY_COLUMN, the
    walk's lines and grid) for the rows' walk, then for the columns' (``empty`` for the one-directional loss)."""
    args, tiling = launch_args(q, k, precision or None)
    cfg = tiling.forward
    rows = launch(args, False, q.shape[0], triton.cdiv(q.shape[0], cfg.block_m))
    cols = launch(args, True, k.shape[0], triton.cdiv(k.shape[0], cfg.block_n)) if symmetric else empty
    return (*rows, *cols)


def _best_positives(
    q: Tensor,
    k: Tensor,
    pos: Tensor,
    row_index: Tensor,
    col_index: Tensor,
    symmetric: bool,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    precision: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    def launch(args, by_column, n, grid) -> Best:
        best = Best(*(torch.empty(n, dtype=dtype, device=q.device) for dtype in (acc, torch.int64, torch.int64)))
        wrap(_best_positives_kernel)[(grid,)](
            pos_ptr=pos.contiguous(),
            q_ids_ptr=q_ids,
            k_ids_ptr=k_ids,
            row_index_ptr=row_index.contiguous(),
            col_index_ptr=col_index.contiguous(),
            score_ptr=best.score,
            best_ptr=best.index,
            count_ptr=best.count,
            BY_COLUMN=by_column,
            **args,
        )
        return best

    return _walks(q, k, symmetric, precision, launch, Best.empty(0, acc, q.device))


def _ahead_counts(
    q: Tensor,
    k: Tensor,
    row_score: Tensor,
    row_best: Tensor,
    col_score: Optional[Tensor],
    col_best: Optional[Tensor],
    row_index: Tensor,
    col_index: Tensor,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    precision: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    def launch(args, by_column, n, grid) -> Ahead:
        counts = Ahead.empty(n, q.device)
        score, best = (col_score, col_best) if by_column else (row_score, row_best)
        wrap(_ahead_counts_kernel)[(grid,)](
            score_ptr=score.contiguous(),
            best_ptr=best.contiguous(),
            q_ids_ptr=q_ids,
            k_ids_ptr=k_ids,
            row_index_ptr=row_index.contiguous(),
            col_index_ptr=col_index.contiguous(),
            ahead_ptr=counts.ahead,
            nonfinite_ptr=counts.nonfinite,
            BY_COLUMN=by_column,
            **args,
        )
        return counts

    return _walks(q, k, col_score is not None, precision, launch, Ahead.empty(0, q.device))


# The two passes as custom ops, registered as the loss kernels' block steps are (:func:`.registration.register_op`):
# torch.ops.infcl.triton_rank_best_positives (the schema of the native kernel's rank_best_positives, plus
# ``precision``: "" for None) -> (row score, index, count, column score, index, count; the columns' empty
# unless symmetric), torch.ops.infcl.triton_rank_ahead_counts -> (row ahead, nonfinite, column ahead,
# nonfinite). The ids are None unless they decide the positives (pass 1) or what is never ahead (pass 2).
best_positives_op = register_op("triton_rank_best_positives", _best_positives, best_positives_fake)
ahead_counts_op = register_op("triton_rank_ahead_counts", _ahead_counts, ahead_counts_fake)


def best_positives(
    q: Tensor,
    k: Tensor,
    pos: Tensor,
    row_index: Tensor,
    col_index: Tensor,
    symmetric: bool,
    q_ids=None,
    k_ids=None,
    precision=None,
):
    """Pass 1: (rows, cols or None), each a :class:`Best`; with ``q_ids`` / ``k_ids`` every same-id entry is a
    positive, else ``pos`` (the column in k of each row's positive, -1 elsewhere)."""
    out = best_positives_op(q, k, pos, row_index, col_index, symmetric, q_ids, k_ids, precision or "")
    return Best(*out[:3]), (Best(*out[3:]) if symmetric else None)


def ahead_counts(
    q: Tensor, k: Tensor, rows: Best, cols, row_index: Tensor, col_index: Tensor, q_ids=None, k_ids=None, precision=None
):
    """Pass 2: (rows, cols or None), each an :class:`Ahead`; with ``q_ids`` / ``k_ids`` the entries with the
    row's id are never ahead."""
    col_score, col_best = (None, None) if cols is None else (cols.score, cols.index)
    out = ahead_counts_op(
        q, k, rows.score, rows.index, col_score, col_best, row_index, col_index, q_ids, k_ids, precision or ""
    )
    return Ahead(*out[:2]), (Ahead(*out[2:]) if cols is not None else None)
