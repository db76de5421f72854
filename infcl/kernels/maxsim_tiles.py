"""The MaxSim kernels' token tile (:mod:`infcl.kernels.maxsim`, whose docstring states the tile, the tie rule and
the passes): the operands as named tuples (:class:`Tokens`, :class:`TokenTile`, :class:`Labels`), each document's
maxima and winners over its real tokens, a query's weighted score, the labels' exclusions and upstream gradients,
and the routing of a maximum's gradient to its winning token."""

from typing import Any, NamedTuple

import triton
import triton.language as tl

from .score_tiles import MIN_DOT, Matrix, dot_operand, load_tile, score_dot, tile_dot
from .tile_stats import softmax_grad

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
def _token_ptrs(x, b, tokens, feats):
    """The addresses of x[b, tokens, feats] (``x`` a :class:`Tokens`; ``b`` and ``tokens`` a column or a scalar,
    ``feats`` the row of feature indices), in int64."""
    return x.ptr + b * x.stride_b + tokens.to(tl.int64) * x.stride_t + feats[None, :].to(tl.int64) * x.stride_d


@triton.jit
def _load_rows(qs, rows, feats):
    """q[queries, tokens, feats] of ``rows`` (:func:`_query_rows`), 0 for a token that does not exist or is
    masked (weight 0: as the torch tiles zero it, a NaN there multiplies nothing) and past D."""
    queries, tokens, exists, w = rows
    ptrs = _token_ptrs(qs, queries[:, None], tokens[:, None], feats)
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
    ptrs = _token_ptrs(docs, j, winner[:, None], feats)
    read = (rows[2] & (p != 0))[:, None] & (feats[None, :] < docs.d)
    return p[:, None] * tl.load(ptrs, mask=read, other=0.0).to(p.dtype)


@triton.jit
def _add_tokens(grad, rows, feats, value):
    """grad[queries, tokens, feats] += value for the rows that exist (``grad`` a :class:`Tokens`); only the
    program owning them calls it."""
    queries, tokens, exists, w = rows
    ptrs = _token_ptrs(grad, queries[:, None], tokens[:, None], feats)
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
        ptrs = _token_ptrs(grad, j, u[:, None], feats)
        mask = (u[:, None] < grad.length) & (feats[None, :] < grad.d)
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + part, mask=mask)
