"""The MaxSim (late-interaction) loss's block steps as Triton kernels (``cal_maxsim_loss(backend="triton")``; the
contract and the rules: :mod:`infcl.contract`, :func:`infcl.cal_maxsim_loss`; the torch tiles' version:
:mod:`infcl.backends.torch_tiles.maxsim`; the backend object: :mod:`infcl.backends.triton.maxsim`).

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
Backward, deterministic without atomics, two kernels as the softmax family's dq and dk:

- :func:`_maxsim_dq_kernel`: a program per (row block, feature slice) recomputes each document's maxima and
  scores, forms dS (:func:`infcl.kernels.tile_stats.softmax_grad`) and C = scale * dS * w per query token, and
  adds C times the winning document token to its rows of dq. P has one entry per (query token, document), so
  this row of P @ k is that token, loaded by its index: a gather of Lq x D values per document beside the
  Lq x Lk x D product, summed in document order. It writes its rows' dscale partial sums.
- :func:`_maxsim_dk_kernel`: a program per (document, feature slice) walks the row blocks, recomputes the same
  maxima, scores and dS, and adds P[:, chunk].T @ q (a ``tl.dot`` per document token chunk, the routing as a
  [BLOCK_M, BLOCK_N] one-hot tile of C) to its document's rows of dk: only this program writes them.

GEMM-equivalents per block (each 2 * Bq * Bk * Lq * Lk * D flops): forward 1, backward 3 (each pass recomputes
the token products; dk's P.T @ q is one more), against 1 + 3 for the torch tiles. A query longer than BLOCK_M
rows costs the backward one more product per row block (its scores need every block before the routing: dq and
dk recompute the winners of each block after them).

On a GPU, C is rounded to the inputs' dtype for dk's product (tensor-core operands, as the softmax kernels' dS);
under the interpreter bfloat16 / float16 operands are upcast (UPCAST, :func:`infcl.kernels.score_tiles.tile_dot`).
"""

from typing import Any, NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..contract import Tensor
from .kernel_args import COMPILE_OPTIONS, launch_options, tf32_operands
from .registration import register_op, wrap
from .score_tiles import MIN_DOT, Dot, Matrix, dot_operand, load_tile, scale_scores, score_dot, tile_dot
from .tile_stats import merge_kept_stats, softmax_grad
from .tiling import target_tiling

# The winner index before any token is seen: larger than every token index, so a real maximum replaces it.
NO_TOKEN = tl.constexpr(2**31 - 1)


class Tokens(NamedTuple):
    """A [n, length, d] tensor of token embeddings as a kernel reads it (pointer, sizes, strides) and its
    per-token side tensor ``side_ptr`` ([n, length], contiguous): the query tokens' weights (accumulation
    dtype) for q, the documents' token mask (bool, or None: every token real) for the documents; for a
    gradient, None."""

    ptr: Any
    n: Any
    length: Any
    d: Any
    stride_b: Any
    stride_t: Any
    stride_d: Any
    side_ptr: Any


class TokenTile(NamedTuple):
    """The token tile's shape, constexprs all: BLOCK_M query-token rows (QUERIES queries of TOKENS rows) by
    BLOCK_N document tokens, summed over BLOCK_D feature chunks (ONE_CHUNK: one covers D, and the rows' tile
    stays in registers), ONE_QCHUNK: a query fits one row block (Lq <= TOKENS); BLOCK_OUT: a backward program's
    gradient slice."""

    BLOCK_M: Any
    BLOCK_N: Any
    BLOCK_D: Any
    TOKENS: Any
    ONE_CHUNK: Any
    ONE_QCHUNK: Any
    BLOCK_OUT: Any


class Labels(NamedTuple):
    """What the softmax over S reads: each query's positive document (-1: elsewhere), the ids (None: no false
    negatives), the scale (a one-element tensor) and, in the backward, the rows' stats [2, n] (m, r) and upstream
    gradients."""

    pos_ptr: Any
    q_ids_ptr: Any
    k_ids_ptr: Any
    scale_ptr: Any
    stats_ptr: Any
    g_ptr: Any


@triton.jit
def _check_tile(tile):
    """A row block holds whole queries (or one chunk of one), and every side of a tl.dot operand is at least
    MIN_DOT."""
    tl.static_assert(tile.BLOCK_M % tile.TOKENS == 0)
    tl.static_assert(tile.BLOCK_M >= MIN_DOT and tile.BLOCK_N >= MIN_DOT)
    tl.static_assert(tile.BLOCK_D >= MIN_DOT and tile.BLOCK_OUT >= MIN_DOT)


@triton.jit
def _query_rows(qs, i0, t0, tile):
    """(queries, tokens, exists, w) of the row block of queries i0.. and tokens t0..t0 + TOKENS: each row's query
    and token index, whether that token exists, and its weight (0 where it does not)."""
    r = tl.arange(0, tile.BLOCK_M)
    queries = i0 + (r // tile.TOKENS).to(tl.int64)
    tokens = t0 + r % tile.TOKENS
    exists = (queries < qs.n) & (tokens < qs.length)
    w = tl.load(qs.side_ptr + queries * qs.length + tokens, mask=exists, other=0.0)
    return queries, tokens, exists, w


@triton.jit
def _load_rows(qs, rows, feats):
    """q[queries, tokens, feats] of ``rows`` (:func:`_query_rows`), 0 for a token that does not exist or is
    masked (weight 0: as the torch tiles zero it, a NaN there multiplies nothing) and past D."""
    queries, tokens, exists, w = rows
    ptrs = (
        qs.ptr
        + queries[:, None] * qs.stride_b
        + tokens[:, None].to(tl.int64) * qs.stride_t
        + feats[None, :].to(tl.int64) * qs.stride_d
    )
    return tl.load(ptrs, mask=(exists & (w != 0))[:, None] & (feats[None, :] < qs.d), other=0.0)


@triton.jit
def _real_tokens(docs, j, u):
    """Which of document j's tokens ``u`` exist and are real (its mask; every existing one without)."""
    valid = u < docs.length
    if docs.side_ptr is not None:
        valid &= tl.load(docs.side_ptr + j * docs.length + u, mask=valid, other=0) != 0
    return valid


@triton.jit
def _doc_maxima(qs, docs, j, rows, q_res, tile, dot, WINNERS: tl.constexpr = True):
    """(best, winner, n_real) of the row block against document j: each row's maximum over the document's real
    tokens (-inf over none, NaN where a product is NaN), the lowest token index holding it (the first NaN's for
    a NaN maximum; 0 where the maximum stays -inf; not formed, all 0, without WINNERS: the forward) and the
    document's real token count. ``q_res``: the rows' one feature chunk held in registers (tile.ONE_CHUNK), or
    None."""
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    doc = Matrix(docs.ptr + j * docs.stride_b, docs.length, docs.d, docs.stride_t, docs.stride_d)
    best = tl.full([BLOCK_M], float("-inf"), dot.ACC)
    winner = tl.zeros([BLOCK_M], tl.int32)
    n_real = 0
    for u0 in range(0, docs.length, BLOCK_N):
        u = u0 + tl.arange(0, BLOCK_N)
        raw = tl.zeros([BLOCK_M, BLOCK_N], dot.ACC)
        for d0 in range(0, docs.d, tile.BLOCK_D):
            feats = d0 + tl.arange(0, tile.BLOCK_D)
            if q_res is None:
                q_tile = _load_rows(qs, rows, feats)
            else:
                q_tile = q_res
            raw = score_dot(q_tile, load_tile(doc, u, feats, True, True), raw, dot)
        real = _real_tokens(docs, j, u)
        n_real += tl.sum(real.to(tl.int32), axis=0)
        raw = tl.where(real[None, :], raw, float("-inf"))
        is_nan = raw != raw
        any_nan = tl.max(is_nan.to(tl.int32), axis=1) > 0
        top = tl.where(any_nan, float("nan"), tl.max(raw, axis=1))  # tl.max drops NaN on a GPU
        # A later chunk wins only with a greater maximum (or the first NaN): the lowest index among equal maxima.
        take = (top > best) | (any_nan & (best == best))
        best = tl.where(take, top, best)
        if WINNERS:
            first = tl.min(tl.where((raw == top[:, None]) | is_nan, u[None, :], NO_TOKEN), axis=1)
            winner = tl.where(take, first, winner)
    return best, winner, n_real


@triton.jit
def _row_scores(best, n_real, rows, tile):
    """The row block's part of each query's R: sum over its rows of w * max ([QUERIES]); a document without a
    real token adds 0 here (its -inf is :func:`_finish_scores`' rule)."""
    QUERIES: tl.constexpr = tile.BLOCK_M // tile.TOKENS
    exists = rows[2]
    per_token = tl.where(exists, rows[3] * tl.where(n_real == 0, 0.0, best), 0.0)
    return tl.sum(tl.reshape(per_token, [QUERIES, tile.TOKENS]), axis=1)


@triton.jit
def _weighted(qs, i0, tile):
    """Whether each of the QUERIES queries from i0 has a weighted (real) token ([QUERIES] bool)."""
    QUERIES: tl.constexpr = tile.BLOCK_M // tile.TOKENS
    found = tl.zeros([QUERIES], tl.int32)
    for t0 in range(0, qs.length, tile.TOKENS):
        w = _query_rows(qs, i0, t0, tile)[3]
        found = tl.maximum(found, tl.max(tl.reshape((w != 0).to(tl.int32), [QUERIES, tile.TOKENS]), axis=1))
    return found > 0


@triton.jit
def _finish_scores(partial, n_real, weighted):
    """R from the rows' sums: -inf for a document without a real token against a query with a weighted one."""
    return tl.where((n_real == 0) & weighted, float("-inf"), partial)


@triton.jit
def _resident_rows(qs, rows, tile):
    """The rows' one feature chunk, held in registers across the documents (tile.ONE_CHUNK and tile.ONE_QCHUNK),
    else None (the product loads each chunk)."""
    if tile.ONE_CHUNK and tile.ONE_QCHUNK:
        q_res = _load_rows(qs, rows, tl.arange(0, tile.BLOCK_D))
    else:
        q_res = None
    return q_res


@triton.jit
def _doc_scores(qs, docs, j, i0, q_res, weighted, tile, dot, WINNERS: tl.constexpr = True):
    """(R, best, winner, n_real): R [QUERIES] of the queries from i0 against document j, and the maxima and
    winners (WINNERS: the backward) of their first row block (every row of a query with tile.ONE_QCHUNK). The row
    blocks' sums are added in token order: every kernel forms R from the same bits in the same order."""
    rows = _query_rows(qs, i0, 0, tile)
    best, winner, n_real = _doc_maxima(qs, docs, j, rows, q_res, tile, dot, WINNERS)
    partial = _row_scores(best, n_real, rows, tile)
    if not tile.ONE_QCHUNK:
        for t0 in range(tile.TOKENS, qs.length, tile.TOKENS):
            more = _query_rows(qs, i0, t0, tile)
            more_best, _, n_real = _doc_maxima(qs, docs, j, more, None, tile, dot, False)
            partial += _row_scores(more_best, n_real, more, tile)
    return _finish_scores(partial, n_real, weighted), best, winner, n_real


@triton.jit
def _query_labels(labels, i0, n_q, QUERIES: tl.constexpr):
    """(qrow, pos, q_ids) of the QUERIES queries from i0: their indices, positives (-1 past n_q) and ids (their
    indices when there are none: unread)."""
    qrow = i0 + tl.arange(0, QUERIES).to(tl.int64)
    pos = tl.load(labels.pos_ptr + qrow, mask=qrow < n_q, other=-1)
    if labels.q_ids_ptr is not None:
        q_ids = tl.load(labels.q_ids_ptr + qrow, mask=qrow < n_q, other=-1)
    else:
        q_ids = qrow
    return qrow, pos, q_ids


@triton.jit
def _excluded(labels, j, pos, q_ids):
    """The false negatives among the queries' entries for document j: the query's id, not its positive."""
    if labels.k_ids_ptr is not None:
        out = (q_ids == tl.load(labels.k_ids_ptr + j)) & (pos != j)
    else:
        out = pos < -1  # nothing excluded
    return out


@triton.jit
def _upstream(labels, qrow, n_q):
    """(m, r, g) of the queries ``qrow``: their global stats (``stats_ptr`` [2, n_q]) and upstream gradients,
    0 past n_q."""
    valid = qrow < n_q
    m = tl.load(labels.stats_ptr + qrow, mask=valid, other=0.0)
    r = tl.load(labels.stats_ptr + n_q + qrow, mask=valid, other=0.0)
    g = tl.load(labels.g_ptr + qrow, mask=valid, other=0.0)
    return m, r, g


@triton.jit
def _dscores(s, j, upstream, pos, excluded):
    """dS [QUERIES] = g * (P - Y) of the queries' entries for document j (expm1 at the positive,
    :func:`infcl.kernels.tile_stats.softmax_grad`), 0 at a false negative."""
    m, r, g = upstream
    ds = softmax_grad(s[:, None], m[:, None], r[:, None], g[:, None], (pos == j)[:, None], True)
    return tl.where(excluded, 0.0, tl.sum(ds, axis=1))


@triton.jit
def _routing(c, n_real, rows, tile):
    """P's entries of the row block: C = scale * dS * w per query token ([BLOCK_M]; ``c`` = scale * dS per query),
    0 for a document without a real token (it routes nothing)."""
    QUERIES: tl.constexpr = tile.BLOCK_M // tile.TOKENS
    per_row = tl.reshape(tl.broadcast_to(c[:, None], [QUERIES, tile.TOKENS]), [tile.BLOCK_M])
    return tl.where(n_real == 0, 0.0, per_row * rows[3])


@triton.jit
def _winning_tokens(docs, j, rows, winner, p, feats):
    """p * k[j, winner] per row ([BLOCK_M, len(feats)]): the rows' part of P @ k for document j, P having one
    entry per row. Rows with p = 0 read nothing (a masked token's NaN stays unread)."""
    ptrs = (
        docs.ptr
        + j * docs.stride_b
        + winner[:, None].to(tl.int64) * docs.stride_t
        + feats[None, :].to(tl.int64) * docs.stride_d
    )
    read = (rows[2] & (p != 0))[:, None] & (feats[None, :] < docs.d)
    return p[:, None] * tl.load(ptrs, mask=read, other=0.0).to(p.dtype)


@triton.jit
def _add_tokens(grad, rows, feats, value):
    """grad[queries, tokens, feats] += value for the rows that exist (``grad`` a :class:`Tokens`); only the
    program owning them calls it."""
    queries, tokens, exists, w = rows
    ptrs = (
        grad.ptr
        + queries[:, None] * grad.stride_b
        + tokens[:, None].to(tl.int64) * grad.stride_t
        + feats[None, :].to(tl.int64) * grad.stride_d
    )
    mask = exists[:, None] & (feats[None, :] < grad.d)
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + value, mask=mask)


@triton.jit
def _route_to_doc(qs, grad, j, rows, winner, p, feats, tile, dot):
    """dk[j, :, feats] += P.T @ q over the row block: per document token chunk, the routing as a one-hot
    [BLOCK_M, BLOCK_N] tile of ``p`` at each row's winner, times the rows' feature slice (``grad`` a
    :class:`Tokens` for dk; only document j's program calls it)."""
    q_slice = _load_rows(qs, rows, feats)
    for u0 in range(0, grad.length, tile.BLOCK_N):
        u = u0 + tl.arange(0, tile.BLOCK_N)
        routed = tl.where(winner[:, None] == u[None, :], p[:, None], 0.0)
        operand = dot_operand(tl.trans(routed), qs.ptr.dtype.element_ty, dot.PRECISION)
        part = tile_dot(operand, q_slice, tl.zeros([tile.BLOCK_N, tile.BLOCK_OUT], dot.ACC), dot.UPCAST, dot.PRECISION)
        ptrs = grad.ptr + j * grad.stride_b + u[:, None].to(tl.int64) * grad.stride_t + feats[None, :] * grad.stride_d
        mask = (u[:, None] < grad.length) & (feats[None, :] < grad.d)
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + part, mask=mask)


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
def _maxsim_dq_kernel(
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
    _maxsim_dq_rows(
        Tokens(q_ptr, n_q, LQ, D, stride_q0, stride_q1, stride_q2, weight_ptr),
        Tokens(k_ptr, n_k, LK, D, stride_k0, stride_k1, stride_k2, k_mask_ptr),
        Labels(pos_ptr, q_ids_ptr, k_ids_ptr, scale_ptr, stats_ptr, g_ptr),
        Tokens(grad_ptr, n_q, LQ, D, stride_grad0, stride_grad1, stride_grad2, None),
        partials_ptr,
        TokenTile(BLOCK_M, BLOCK_N, BLOCK_D, TOKENS, ONE_CHUNK, ONE_QCHUNK, BLOCK_OUT),
        Dot(ACC, UPCAST, PRECISION),
    )


@triton.jit
def _maxsim_dk_kernel(
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
    _maxsim_dk_rows(
        Tokens(q_ptr, n_q, LQ, D, stride_q0, stride_q1, stride_q2, weight_ptr),
        Tokens(k_ptr, n_k, LK, D, stride_k0, stride_k1, stride_k2, k_mask_ptr),
        Labels(pos_ptr, q_ids_ptr, k_ids_ptr, scale_ptr, stats_ptr, g_ptr),
        Tokens(grad_ptr, n_k, LK, D, stride_grad0, stride_grad1, stride_grad2, None),
        TokenTile(BLOCK_M, BLOCK_N, BLOCK_D, TOKENS, ONE_CHUNK, ONE_QCHUNK, BLOCK_OUT),
        Dot(ACC, UPCAST, PRECISION),
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
    wrap(_maxsim_dq_kernel)[(blocks, triton.cdiv(lq, args["TOKENS"]), slices)](
        **_tokens_args("grad", dq), partials_ptr=partials, **args
    )
    wrap(_maxsim_dk_kernel)[(k.shape[0], slices)](**_tokens_args("grad", dk), **args)
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
