"""The MaxSim (late-interaction) contrastive loss on the torch tiles (contract: :mod:`infcl.contract`).

A tile is a block of queries against a block of documents, and its token product is one GEMM: the queries'
tokens [nq * Lq, D] against the documents' tokens [nd * Lk, D]. Masked document tokens are set to -inf in it (so
they never win), each (query token, document) keeps its maximum over the document's tokens (``torch.max`` returns
the lowest index among equal maxima: the token the backward routes to), and the weighted sum over each query's
tokens (one batched product with the weights) gives the tile of scores R [nq, nd]. From there the softmax is the
softmax loss's: :func:`infcl.lse.tile_stats` merged by :func:`infcl.lse.lse_merge`, the positive read off the tile,
and in the backward dS = g * (P - Y) by the softmax tiles' own :func:`~.softmax.probabilities`.

The backward recomputes the token tile with the same operations (so R is bit-identical), writes the routing of
each maximum as a sparse matrix into the token tile's own buffer (P[(i, t), (j, u*)] = scale * dS[i, j] * w[i, t]),
and accumulates ``dq += P @ k`` and ``dk += P.T @ q`` as two more GEMMs: a fixed order, no atomics.

Masked tokens are zeroed in each tile's copy of the tokens (so a NaN or inf sitting in padding never reaches a
product); a document with no real token scores -inf against every query with a weighted token (the max over an
empty set) and 0 against a query without one (the empty sum), and routes no gradient.

GEMM count per tile: forward 1, backward 3 (the token product again, dq, dk). Extra memory: one token tile
(two in the backward: the product and the routing, which stays zero between tiles: each tile resets the entries
it wrote), the max's indices of a tile, a copy of the queries' tokens (with their extra feature) and of one
document tile's; never O(Bq * Bk * Lq * Lk): :data:`CPU_TOKEN_TILES` / :data:`GPU_TOKEN_TILES`.
"""

from typing import NamedTuple, Optional, Tuple

import torch

from ...contract import Block, Tensor, accum_dtype
from ...lse import empty_stats, lse_merge, tile_stats
from .softmax import _plain_masks, _tile_masks, probabilities
from .walk import CPU_PRODUCT_MULTIPLE, Tile, positives, product_rows

# (query tokens, document tokens) per token tile. CPU: 512 x 4096 fp32 is 8 MiB, two of which live in the backward;
# at Lq = 32, Lk = 180 that is 16 queries x 22 documents, products large enough for MKL's full rate on 2 threads.
CPU_TOKEN_TILES = (512, 4096)
# GPU: 4096 x 16384 fp32 is 256 MiB: each product fills the device; not measured on a GPU yet.
GPU_TOKEN_TILES = (4096, 16384)

NEG_INF = float("-inf")


class MaxSimTile(NamedTuple):
    """One tile: its queries (rows) and documents (cols), their tokens in the accumulation dtype with the masked
    tokens zeroed, the queries' weights, and the documents' mask and emptiness (None without a document mask)."""

    rows: slice
    cols: slice
    qi: Tensor  # [nq, Lq, W]: W = D, or D + 1 with the mask's extra feature
    kj: Tensor  # [nd, Lk, W]
    q_window: Tensor  # [R, W]: qi's tokens and, on a CPU, the rows after them up to a multiple of 16 (ignored)
    k_window: Tensor  # [C, W]: kj's tokens, likewise padded
    weight: Tensor  # [nq, Lq]
    mask: Optional[Tensor]  # [nd, Lk] bool
    empty: Optional[Tensor]  # [nd] bool: documents without a real token

    def as_tile(self) -> Tile:
        """The softmax tiles' view of this tile (rows and columns are queries and documents)."""
        return Tile(self.rows, self.cols, self.qi, self.kj)


def token_tiles(device: torch.device, lq: int, lk: int, tiles: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
    """(queries, documents) per tile from the token budget (``tiles``, or the device kind's default)."""
    tq, tk = tiles or (CPU_TOKEN_TILES if device.type == "cpu" else GPU_TOKEN_TILES)
    return max(1, tq // lq), max(1, tk // lk)


def _walk(block: Block, tiles: Optional[Tuple[int, int]]):
    """The block's tiles, document blocks outer. The queries are copied once per block and each document tile
    once: the tokens in the accumulation dtype with the masked ones zeroed and, with a document mask, one more
    feature: 1 for every query token, 0 for a real document token and -inf for a masked one, so the token product
    itself puts -inf where a masked token sits (adding an exact 0 leaves every real product's bits as they are)
    and no pass over the product is spent on the mask."""
    acc, device = accum_dtype(block.q.dtype), block.q.device
    bq, lq, _ = block.q.shape
    bk, lk, _ = block.k.shape
    nq, nk = token_tiles(device, lq, lk, tiles)
    masked = block.k_mask is not None
    weight = block.q_weight
    q_rows = _tokens(block.q, weight != 0, acc, torch.ones_like(weight) if masked else None)
    for j0 in range(0, bk, nk):
        cols = slice(j0, min(j0 + nk, bk))
        mask = empty = None
        if masked:
            mask = block.k_mask[cols]
            k_rows = _tokens(block.k[cols], mask, acc, torch.where(mask, 0.0, NEG_INF))
            empty = ~mask.any(dim=1)
        else:
            k_rows = _tokens(block.k[cols], None, acc, None)
        nd = cols.stop - cols.start
        kj = k_rows[: nd * lk].view(nd, lk, -1)
        k_window = k_rows[: product_rows(nd * lk, device)]
        for i0 in range(0, bq, nq):
            rows = slice(i0, min(i0 + nq, bq))
            first, count = i0 * lq, (rows.stop - i0) * lq
            qi = q_rows[first : first + count].view(-1, lq, q_rows.shape[1])
            q_window = q_rows[first : first + product_rows(count, device)]
            yield MaxSimTile(rows, cols, qi, kj, q_window, k_window, weight[rows], mask, empty)


def _tokens(tokens: Tensor, real: Optional[Tensor], acc: torch.dtype, extra: Optional[Tensor]) -> Tensor:
    """[n * L + spare, W]: the tokens' rows in ``acc``, the masked ones (``real`` False) zeroed, with ``extra``
    [n, L] as one more feature (W = D + 1) or none (W = D), and on a CPU :data:`.walk.CPU_PRODUCT_MULTIPLE` zero rows
    after them (a product's window may reach past the last token). Formed by contiguous operations (a strided
    destination takes torch's slow copy path)."""
    n, length, d = tokens.shape
    kept = tokens.to(acc) if real is None else torch.where(real[..., None], tokens.to(acc), 0.0)
    if extra is not None:
        kept = torch.cat((kept, extra[..., None].to(acc)), dim=2)
    width = kept.shape[2]
    if tokens.device.type != "cpu":
        return kept.reshape(n * length, width)  # a copy unless the tokens were already plain rows
    out = kept.new_zeros(n * length + CPU_PRODUCT_MULTIPLE, width)
    out[: n * length].view(n, length, width).copy_(kept)
    return out


def _token_product(tile: MaxSimTile, buf: Tensor) -> Tensor:
    """[nq * Lq, nd, Lk]: every query token of the tile against every document token (a masked one -inf, by the
    tokens' extra feature), read out of the product of the two windows; a view into ``buf``."""
    rows, cols = tile.q_window.shape[0], tile.k_window.shape[0]
    product = torch.mm(tile.q_window, tile.k_window.T, out=buf[: rows * cols].view(rows, cols))
    nq, lq = tile.weight.shape
    nd, lk = tile.kj.shape[:2]
    return product[: nq * lq, : nd * lk].view(nq * lq, nd, lk)


def _scores(tile: MaxSimTile, maxima: Tensor) -> Tensor:
    """R [nq, nd] = sum_t w[i, t] * maxima[i, t, j] (``maxima`` [nq * Lq, nd], overwritten where a document is
    empty); -inf for an empty document against a query with a weighted token, 0 against one without."""
    nq, lq = tile.weight.shape
    per_token = maxima.view(nq, lq, -1)
    if tile.empty is not None:
        per_token.masked_fill_(tile.empty[None, None], 0.0)
    # A sum over the tokens, not a batched product: the same reduction in both passes, and torch's bmm of these
    # 1 x Lq rows costs as much as the token product itself on CPU.
    scores = per_token.mul_(tile.weight[:, :, None]).sum(dim=1)
    if tile.empty is not None:
        weighted = (tile.weight != 0).any(dim=1)
        scores.masked_fill_(tile.empty[None] & weighted[:, None], NEG_INF)
    return scores


def _tile_buffer(block: Block, tiles: Optional[Tuple[int, int]]) -> Tensor:
    """One flat buffer large enough for the block's largest token product (its windows' rows and columns)."""
    bq, lq, _ = block.q.shape
    bk, lk, _ = block.k.shape
    device = block.q.device
    nq, nk = token_tiles(device, lq, lk, tiles)
    numel = product_rows(min(nq, bq) * lq, device) * product_rows(min(nk, bk) * lk, device)
    return torch.empty(numel, dtype=accum_dtype(block.q.dtype), device=device)


def merge_score_tile(block: Block, rows: Tensor, tile: Tile, raw: Tensor) -> None:
    """The forward's softmax over one tile of scores ``raw`` = R [nq, nd] (queries ``tile.rows`` against documents
    ``tile.cols``, overwritten with S = scale * R): its stats merged into ``rows[:2]`` by :func:`infcl.lse.lse_merge`
    (the ids' false negatives left out), the positives' S into ``rows[2]``. Every backend's MaxSim forward ends
    here (the native kernel forms R in C++)."""
    s = raw.mul_(block.scale)  # score_tile_gradients repeats this product
    masks = _tile_masks(block, tile, False, None) if block.masks is not None else None
    kept = s if masks is None else s.masked_fill(masks.excluded, NEG_INF)
    lse_merge(rows[:2, tile.rows], tile_stats(kept, 1))
    inside, idx = positives(block.pos, tile)
    pos_row = rows[2, tile.rows]
    torch.where(inside, s.gather(1, idx).squeeze(1), pos_row, out=pos_row)


def score_tile_gradients(block: Block, tile: Tile, raw: Tensor, dscale: Tensor) -> Tensor:
    """The backward's softmax over one tile of scores ``raw`` = R [nq, nd] (bit-identical to the forward's):
    adds sum dS * R to ``dscale[0]`` and returns C = scale * dS [nq, nd], with dS = g * (P - Y) by the softmax
    tiles' own :func:`~.softmax.probabilities`; C[i, j] * w[i, t] is what query token (i, t) routes to its
    winning token of document j."""
    scale = block.scale
    s = raw * scale  # bit-identical to the forward's tile
    masks = _tile_masks(block, tile, False, None) if block.masks is not None else _plain_masks(block, tile)
    ds = probabilities(
        torch.empty_like(s),
        s,
        masks,
        masks.excluded,
        block.row_stats[:, tile.rows, None],
        block.g_row[tile.rows, None],
        None,
        s,
    )
    # An empty document's -inf score meets dS = 0 off its row's positive: that term is 0, not NaN.
    dscale[0] += torch.where(ds == 0, 0.0, ds * raw).sum()
    return ds.mul_(scale)


class MaxSimTiles:
    """The MaxSim loss's block operations on the torch tiles. ``token_tiles``: (query tokens, document tokens) per
    tile (None: the device kind's default, :data:`CPU_TOKEN_TILES` / :data:`GPU_TOKEN_TILES`)."""

    token_tiles: Optional[Tuple[int, int]] = None

    def maxsim_forward_block(self, block: Block) -> Tensor:
        acc, dev = accum_dtype(block.q.dtype), block.q.device
        bq = block.q.shape[0]
        rows = torch.cat((empty_stats(bq, acc, dev), torch.zeros(1, bq, dtype=acc, device=dev)))
        buf = _tile_buffer(block, self.token_tiles)
        for tile in _walk(block, self.token_tiles):
            product = _token_product(tile, buf)
            merge_score_tile(block, rows, tile.as_tile(), _scores(tile, torch.amax(product, dim=2)))
        return rows

    def maxsim_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        acc = accum_dtype(block.q.dtype)
        dscale = torch.zeros(2, dtype=acc, device=block.q.device)
        buf = _tile_buffer(block, self.token_tiles)
        routing_buf = torch.zeros_like(buf)  # all zeros between tiles: each tile resets the entries it wrote
        d = block.q.shape[-1]
        for tile in _walk(block, self.token_tiles):
            product = _token_product(tile, buf)
            maxima, winner = torch.max(product, dim=2)  # the lowest index among equal maxima
            coef = score_tile_gradients(block, tile.as_tile(), _scores(tile, maxima), dscale)
            # The routing: each (query token, document) sends scale * dS * w to its winning document token.
            routed = coef[:, None, :] * tile.weight[:, :, None]  # [nq, Lq, nd]
            if tile.empty is not None:
                routed.masked_fill_(tile.empty[None, None], 0.0)
            routing = routing_buf[: product.numel()].view(product.shape)
            routing.scatter_(2, winner[..., None], routed.view(winner.shape)[..., None])
            flat = routing.view(routing.shape[0], -1)
            q_tokens, k_tokens = tile.qi[..., :d].reshape(-1, d), tile.kj[..., :d].reshape(-1, d)
            dq[tile.rows].view(-1, d).addmm_(flat, k_tokens)
            dk[tile.cols].view(-1, d).addmm_(flat.T, q_tokens)
            routing.scatter_(2, winner[..., None], 0.0)  # back to zeros, O(nq * Lq * nd)
        return dscale
