"""The MaxSim (late-interaction) loss's block steps as Triton kernels (``cal_maxsim_loss(backend="triton")``; the
contract and the rules: :mod:`infcl.contract`, :func:`infcl.cal_maxsim_loss`; the torch tiles' version:
:mod:`infcl.backends.torch_tiles.maxsim`; the backend object: :mod:`infcl.backends.triton.maxsim`). Here: the row
walks, the entry kernels and their launchers; the token tile's helpers named below: :mod:`.maxsim_tiles`.

**The token tile.** A program's rows are BLOCK_M query tokens: ``QUERIES`` whole queries of ``TOKENS`` rows each
(TOKENS = Lq rounded up to a power of two, at most BLOCK_M; a longer query takes several row blocks, its token
chunks). Against one document the tile is BLOCK_M query tokens x BLOCK_N of the document's tokens, one
``tl.dot`` per feature chunk (:func:`infcl.kernels.score_tiles.score_dot`, the S product of every kernel), walked
over the document's token chunks: each row keeps its running maximum over the document's real tokens and the
lowest token index holding it (:func:`_doc_maxima`). The weighted sum of a query's rows is its score R against
the document (:func:`_row_scores`), S = scale * R (:func:`infcl.kernels.score_tiles.scale_scores`), and the
documents are walked one at a time with the one online log-sum-exp of the kernels
(:func:`infcl.kernels.tile_stats.merge_kept_stats`).

**Ties.** Every kernel forms a token product in the same orientation (query tokens on the MMA's M side), on
the same tile config and feature chunks, so an entry is the same bits in the forward and in both backward
passes; and an exact copy of a document token scores the same bits wherever it sits in a tile (each entry of a
tile is summed over the same chunks by the same instruction), so "the lowest index among equal maxima" is a
property of the data: the forward's maxima, the backward's winners and the scores R are identical in every pass.
A NaN product makes its row's maximum NaN (and its winner the first NaN), as torch.amax does.

**Passes.** :func:`_maxsim_forward_kernel`: a program per row block, the rows' (m, rest, positive score).
Backward, deterministic without atomics, two launches of :func:`_maxsim_backward_kernel` as the softmax
family's dq and dk (its BY_COLUMN constexpr picks the walk):

- dq (:func:`_maxsim_dq_rows`): a program per (row block, feature slice) recomputes each document's maxima and
  scores, forms dS (:func:`infcl.kernels.tile_stats.softmax_grad`) and C = scale * dS * w per query token, and
  adds C times the winning document token to its rows of dq. P has one entry per (query token, document), so
  this row of P @ k is that token, loaded by its index: a gather of Lq x D values per document beside the
  Lq x Lk x D product, summed in document order. It writes its rows' dscale partial sums.
- dk (:func:`_maxsim_dk_rows`): a program per (document, feature slice) walks the row blocks, recomputes the same
  maxima, scores and dS, and adds P[:, chunk].T @ q (a ``tl.dot`` per document token chunk, the routing as a
  [BLOCK_M, BLOCK_N] one-hot tile of C) to its document's rows of dk: only this program writes them.

GEMM-equivalents per block (each 2 * Bq * Bk * Lq * Lk * D flops): forward 1, backward 3 (each pass recomputes
the token products; dk's P.T @ q is one more), against 1 + 3 for the torch tiles. A query longer than BLOCK_M
rows costs the backward one more product per row block (its scores need every block before the routing: dq and
dk recompute the winners of each block after them).

On a GPU, C is rounded to the inputs' dtype for dk's product (tensor-core operands, as the softmax kernels' dS);
under the interpreter bfloat16 / float16 operands are upcast (UPCAST, :func:`infcl.kernels.score_tiles.tile_dot`).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..contract import Tensor
from .kernel_args import COMPILE_OPTIONS, launch_options, tf32_operands
from .maxsim_tiles import (
    Labels,
    Tokens,
    TokenTile,
    _add_tokens,
    _check_tile,
    _doc_maxima,
    _doc_scores,
    _dscores,
    _excluded,
    _query_labels,
    _query_rows,
    _resident_rows,
    _route_to_doc,
    _routing,
    _upstream,
    _weighted,
    _winning_tokens,
)
from .registration import register_op, wrap
from .score_tiles import Dot, scale_scores
from .tile_stats import merge_kept_stats
from .tiling import target_tiling


@triton.jit
def _maxsim_forward_rows(qs, docs, labels, out_ptr, tile, dot):
    """The forward program's QUERIES queries: their (m, rest, positive score) over the block's documents, stored
    to ``out_ptr`` [3, n_q]."""
    _check_tile(tile)
    QUERIES: tl.constexpr = tile.BLOCK_M // tile.TOKENS
    i0 = tl.program_id(0).to(tl.int64) * QUERIES
    qrow, pos, q_ids = _query_labels(labels, i0, qs.n, QUERIES)
    weighted = _weighted(qs, i0, tile)
    q_res = _resident_rows(qs, _query_rows(qs, i0, 0, tile), tile)
    scale = tl.load(labels.scale_ptr)
    m = tl.full([QUERIES], float("-inf"), dot.ACC)
    rest = tl.full([QUERIES], -1.0, dot.ACC)  # the empty set
    positive = tl.zeros([QUERIES], dot.ACC)
    for doc in range(0, docs.n):
        j = tl.cast(doc, tl.int64)  # a new name: Triton 3.4 takes a reassigned loop variable for a carried one
        raw = _doc_scores(qs, docs, j, i0, q_res, weighted, tile, dot, False)[0]
        s = scale_scores(raw, scale)
        kept = tl.where(_excluded(labels, j, pos, q_ids), float("-inf"), s)
        # One entry's stats (kept, 0): s - s is 0, NaN for a NaN or infinite score (-inf: the empty set).
        m, rest = merge_kept_stats(m, rest, kept, kept - kept)
        positive = tl.where(pos == j, s, positive)
    valid = qrow < qs.n
    tl.store(out_ptr + qrow, m, mask=valid)
    tl.store(out_ptr + qs.n + qrow, rest, mask=valid)
    tl.store(out_ptr + 2 * qs.n + qrow, positive, mask=valid)


@triton.jit
def _maxsim_dq_rows(qs, docs, labels, grad, partials_ptr, tile, dot):
    """The dq program's rows (token chunk ``program_id(1)`` of QUERIES queries) and feature slice
    (``program_id(2)``): their dq slice, and (chunk 0, slice 0) the queries' dscale partial sum."""
    _check_tile(tile)
    QUERIES: tl.constexpr = tile.BLOCK_M // tile.TOKENS
    i0 = tl.program_id(0).to(tl.int64) * QUERIES
    feats = tl.program_id(2).to(tl.int64) * tile.BLOCK_OUT + tl.arange(0, tile.BLOCK_OUT)
    qrow, pos, q_ids = _query_labels(labels, i0, qs.n, QUERIES)
    upstream = _upstream(labels, qrow, qs.n)
    weighted = _weighted(qs, i0, tile)
    own = _query_rows(qs, i0, tl.program_id(1) * tile.TOKENS, tile)
    q_res = _resident_rows(qs, own, tile)
    scale = tl.load(labels.scale_ptr)
    acc = tl.zeros([tile.BLOCK_M, tile.BLOCK_OUT], dot.ACC)
    dscale = tl.zeros([QUERIES], dot.ACC)
    for doc in range(0, docs.n):
        j = tl.cast(doc, tl.int64)  # a new name: Triton 3.4 takes a reassigned loop variable for a carried one
        if tile.ONE_QCHUNK:
            raw, best, winner, n_real = _doc_scores(qs, docs, j, i0, q_res, weighted, tile, dot)
        else:  # the scores over every row block, then the own block's winners again
            raw = _doc_scores(qs, docs, j, i0, q_res, weighted, tile, dot, False)[0]
            best, winner, n_real = _doc_maxima(qs, docs, j, own, None, tile, dot)
        ds = _dscores(scale_scores(raw, scale), j, upstream, pos, _excluded(labels, j, pos, q_ids))
        # An empty document's -inf score meets dS = 0 off its row's positive: that term is 0, not NaN.
        dscale += tl.where(ds == 0, 0.0, ds * raw)
        p = _routing(ds * scale, n_real, own, tile)
        acc += _winning_tokens(docs, j, own, winner, p, feats)
    _add_tokens(grad, own, feats, acc)
    first = (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    tl.store(partials_ptr + tl.program_id(0), tl.sum(dscale, axis=0), mask=first)


@triton.jit
def _maxsim_dk_rows(qs, docs, labels, grad, tile, dot):
    """The dk program's document (``program_id(0)``) and feature slice (``program_id(1)``): its dk slice, over
    every row block of the queries."""
    _check_tile(tile)
    QUERIES: tl.constexpr = tile.BLOCK_M // tile.TOKENS
    j = tl.program_id(0).to(tl.int64)
    feats = tl.program_id(1).to(tl.int64) * tile.BLOCK_OUT + tl.arange(0, tile.BLOCK_OUT)
    scale = tl.load(labels.scale_ptr)
    for first in range(0, qs.n, QUERIES):
        i0 = tl.cast(first, tl.int64)
        qrow, pos, q_ids = _query_labels(labels, i0, qs.n, QUERIES)
        rows = _query_rows(qs, i0, 0, tile)
        q_res = _resident_rows(qs, rows, tile)
        raw, best, winner, n_real = _doc_scores(qs, docs, j, i0, q_res, _weighted(qs, i0, tile), tile, dot)
        ds = _dscores(scale_scores(raw, scale), j, _upstream(labels, qrow, qs.n), pos, _excluded(labels, j, pos, q_ids))
        c = ds * scale
        if tile.ONE_QCHUNK:
            _route_to_doc(qs, grad, j, rows, winner, _routing(c, n_real, rows, tile), feats, tile, dot)
        else:  # every row block's winners again (one routing loop: one copy of its registers)
            for t0 in range(0, qs.length, tile.TOKENS):
                more = _query_rows(qs, i0, t0, tile)
                more_best, more_winner, n_real = _doc_maxima(qs, docs, j, more, None, tile, dot)
                _route_to_doc(qs, grad, j, more, more_winner, _routing(c, n_real, more, tile), feats, tile, dot)


@triton.jit
def _maxsim_backward_rows(qs, docs, labels, grad, partials_ptr, tile, dot, BY_COLUMN: tl.constexpr):
    """The backward program's walk: dk's (BY_COLUMN; ``grad`` is dk) or dq's (``grad`` is dq)."""
    if BY_COLUMN:
        _maxsim_dk_rows(qs, docs, labels, grad, tile, dot)
    else:
        _maxsim_dq_rows(qs, docs, labels, grad, partials_ptr, tile, dot)


@triton.jit
def _maxsim_forward_kernel(
    q_ptr,
    k_ptr,
    weight_ptr,
    k_mask_ptr,
    pos_ptr,
    q_ids_ptr,
    k_ids_ptr,
    scale_ptr,
    out_ptr,
    n_q,
    n_k,
    LQ,
    LK,
    D,
    stride_q0,
    stride_q1,
    stride_q2,
    stride_k0,
    stride_k1,
    stride_k2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    ONE_QCHUNK: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    _maxsim_forward_rows(
        Tokens(q_ptr, n_q, LQ, D, stride_q0, stride_q1, stride_q2, weight_ptr),
        Tokens(k_ptr, n_k, LK, D, stride_k0, stride_k1, stride_k2, k_mask_ptr),
        Labels(pos_ptr, q_ids_ptr, k_ids_ptr, scale_ptr, None, None),
        out_ptr,
        TokenTile(BLOCK_M, BLOCK_N, BLOCK_D, TOKENS, ONE_CHUNK, ONE_QCHUNK, BLOCK_D),
        Dot(ACC, UPCAST, PRECISION),
    )


@triton.jit
def _maxsim_backward_kernel(
    q_ptr,
    k_ptr,
    weight_ptr,
    k_mask_ptr,
    pos_ptr,
    q_ids_ptr,
    k_ids_ptr,
    scale_ptr,
    stats_ptr,
    g_ptr,
    grad_ptr,
    partials_ptr,
    n_q,
    n_k,
    LQ,
    LK,
    D,
    stride_q0,
    stride_q1,
    stride_q2,
    stride_k0,
    stride_k1,
    stride_k2,
    stride_grad0,
    stride_grad1,
    stride_grad2,
    BY_COLUMN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    ONE_QCHUNK: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dq (BY_COLUMN false: ``grad_ptr`` is dq, ``partials_ptr`` the dscale partials) or dk (BY_COLUMN: ``grad_ptr``
    is dk, ``partials_ptr`` None). The named tuples are built in the call: a tuple held in a local loses its
    constexprs (the tile's sizes, the specialized strides, the absent pointers)."""
    _maxsim_backward_rows(
        Tokens(q_ptr, n_q, LQ, D, stride_q0, stride_q1, stride_q2, weight_ptr),
        Tokens(k_ptr, n_k, LK, D, stride_k0, stride_k1, stride_k2, k_mask_ptr),
        Labels(pos_ptr, q_ids_ptr, k_ids_ptr, scale_ptr, stats_ptr, g_ptr),
        Tokens(
            grad_ptr,
            n_k if BY_COLUMN else n_q,
            LK if BY_COLUMN else LQ,
            D,
            stride_grad0,
            stride_grad1,
            stride_grad2,
            None,
        ),
        partials_ptr,
        TokenTile(BLOCK_M, BLOCK_N, BLOCK_D, TOKENS, ONE_CHUNK, ONE_QCHUNK, BLOCK_OUT),
        Dot(ACC, UPCAST, PRECISION),
        BY_COLUMN,
    )


def _tokens_args(name: str, x: Tensor) -> dict:
    """A [n, length, d] strided tensor as a kernel entry takes it, flat: ``<name>_ptr`` and its three strides."""
    return {f"{name}_ptr": x, **{f"stride_{name}{i}": x.stride(i) for i in range(3)}}


def _launch_args(q, k, q_weight, k_mask, scale, pos, q_ids, k_ids, precision: Optional[str]):
    """(args, tiling, block_out): what every MaxSim kernel takes (the tokens, their sides, the labels, the sizes,
    the token tile and the dtype options), the tiling of the active target, and the gradient slice."""
    opts = launch_options(q.dtype, precision)
    q, k = tf32_operands(opts["PRECISION"], q, k)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    tiling = target_tiling("maxsim", q.dtype, opts["PRECISION"])
    cfg = tiling.forward
    n_q, lq, dim = q.shape
    tokens = min(triton.next_power_of_2(lq), cfg.block_m)
    block_d = tiling.block_d(dim)
    args = dict(
        **_tokens_args("q", q),
        **_tokens_args("k", k),
        weight_ptr=q_weight.to(acc).contiguous(),
        k_mask_ptr=None if k_mask is None else k_mask.contiguous(),
        pos_ptr=pos.contiguous(),
        q_ids_ptr=None if q_ids is None else q_ids.contiguous(),
        k_ids_ptr=None if k_ids is None else k_ids.contiguous(),
        # A tensor, not a launch argument: a Python float would be rounded to float32.
        scale_ptr=scale.to(acc).reshape(1),
        n_q=n_q,
        n_k=k.shape[0],
        LQ=lq,
        LK=k.shape[1],
        D=dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        TOKENS=tokens,
        ONE_CHUNK=dim <= block_d,
        ONE_QCHUNK=lq <= tokens,
        **cfg.launch_options(),
        **opts,
        **COMPILE_OPTIONS,
    )
    return args, tiling, acc


def _forward(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_mask: Optional[Tensor],
    scale: Tensor,
    pos: Tensor,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    precision: str,
) -> Tensor:
    args, tiling, acc = _launch_args(q, k, q_weight, k_mask, scale, pos, q_ids, k_ids, precision or None)
    out = torch.empty(3, q.shape[0], dtype=acc, device=q.device)
    queries = args["BLOCK_M"] // args["TOKENS"]
    wrap(_maxsim_forward_kernel)[(triton.cdiv(q.shape[0], queries),)](out_ptr=out, **args)
    out[1].log1p_()  # rest -> r = log1p(rest) (-inf for the empty set)
    return out


def _forward_fake(q, k, q_weight, k_mask, scale, pos, q_ids, k_ids, precision):
    return q.new_empty(3, q.shape[0], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


def _backward(
    q: Tensor,
    k: Tensor,
    q_weight: Tensor,
    k_mask: Optional[Tensor],
    scale: Tensor,
    pos: Tensor,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    row_stats: Tensor,
    g_row: Tensor,
    dq: Tensor,
    dk: Tensor,
    precision: str,
) -> Tensor:
    args, tiling, acc = _launch_args(q, k, q_weight, k_mask, scale, pos, q_ids, k_ids, precision or None)
    n_q, lq, dim = q.shape
    block_out = tiling.block_out(tiling.dq, dim)
    queries = args["BLOCK_M"] // args["TOKENS"]
    blocks = triton.cdiv(n_q, queries)
    partials = torch.zeros(blocks, dtype=acc, device=q.device)
    args.update(stats_ptr=row_stats.to(acc).contiguous(), g_ptr=g_row.to(acc).contiguous(), BLOCK_OUT=block_out)
    slices = triton.cdiv(dim, block_out)
    wrap(_maxsim_backward_kernel)[(blocks, triton.cdiv(lq, args["TOKENS"]), slices)](
        **_tokens_args("grad", dq), partials_ptr=partials, BY_COLUMN=False, **args
    )
    wrap(_maxsim_backward_kernel)[(k.shape[0], slices)](
        **_tokens_args("grad", dk), partials_ptr=None, BY_COLUMN=True, **args
    )
    return torch.stack((partials.sum(), partials.new_zeros(())))


def _backward_fake(q, k, q_weight, k_mask, scale, pos, q_ids, k_ids, row_stats, g_row, dq, dk, precision):
    return q.new_empty(2, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


# The block steps as custom ops (:func:`.registration.register_op`):
# torch.ops.infcl.triton_maxsim_forward_block(q, k, q_weight, k_mask, scale, pos, q_ids, k_ids, precision)
# -> rows [3, Bq] (m, r, positive score); torch.ops.infcl.triton_maxsim_backward_block(..., row_stats [2, Bq],
# g_row [Bq], dq!, dk!, precision) -> dscale [2] (accumulates into dq [Bq, Lq, D] and dk [Bk, Lk, D]).
# ``k_mask``, ``q_ids`` / ``k_ids``: None where absent; ``precision``: "" for None (torch's float32 matmul precision).
forward_op = register_op("triton_maxsim_forward_block", _forward, _forward_fake)
backward_op = register_op("triton_maxsim_backward_block", _backward, _backward_fake, ("dq", "dk"))
