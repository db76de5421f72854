"""The sigmoid (SigLIP) loss on the torch tiles (contract: :mod:`infcl.contract`): each tile's logits
scale * raw + bias with their sign flipped at the positive (the margins), their softplus summed per row in
the forward and their sigmoid as dL in the backward. With ids (``Block.masks``) every column with the row's id is
a positive: a bool tile of the ids' matches selects the flipped margins.

GEMMs per block: forward 1 (the logits), backward 3 (the logits again, dq, dk).
"""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ...contract import Block, Tensor
from .walk import Tile, TileSizes, Walk, positives, replace_positives

# F.softplus returns x itself above its threshold. The default, 20, drops log1p(e^-20) ~ 2e-9, which
# float64 resolves; above 40, e^-x is below half an ulp of x even in float64, and below it exp(x) <= 2e17
# is finite in every accumulation dtype.
SOFTPLUS_THRESHOLD = 40.0


class _Positives(NamedTuple):
    """A tile's positives: by index (``inside``, ``idx``: the one-hot of ``pos``), or ``same`` [ni, nj] bool (ids)."""

    inside: Optional[Tensor]
    idx: Optional[Tensor]
    same: Optional[Tensor]


def _positives(block: Block, tile: Tile) -> _Positives:
    if block.masks is None:
        return _Positives(*positives(block.pos, tile), None)
    return _Positives(None, None, block.masks.q_ids[tile.rows, None] == block.masks.k_ids[None, tile.cols])


def _flip(out: Tensor, p: _Positives) -> Tensor:
    """``out`` with its sign flipped at the positives, in place."""
    if p.same is not None:
        return torch.where(p.same, out.neg(), out, out=out)
    return replace_positives(out, p.inside, p.idx, -out.gather(1, p.idx))


def _margins(out: Tensor, raw: Tensor, block: Block, p: _Positives) -> Tensor:
    """out = -z * (scale * raw + bias): the sigmoid loss's logits, their sign flipped at the positives,
    so that each entry's loss is softplus(out) and its derivative by the logit is -z * sigmoid(out)."""
    torch.mul(raw, block.scale, out=out).add_(block.bias)
    return _flip(out, p)


class SigmoidTiles(TileSizes):
    """The sigmoid loss's block operations on the torch tiles."""

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        walk = Walk(block, self.tiles(block.q.device))
        rows = walk.zeros(walk.q.shape[0])
        (buf,) = walk.buffers(1)
        for tile in walk:
            margins = torch.mm(tile.qi, tile.kj.T, out=tile.view(buf))
            _margins(margins, margins, block, _positives(block, tile))
            rows[tile.rows] += F.softplus(margins, threshold=SOFTPLUS_THRESHOLD).sum(dim=1)
        return rows

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        walk = Walk(block, self.tiles(block.q.device))
        dparams = walk.zeros(2)  # (scale, bias)
        raw_buf, ds_buf = walk.buffers(2)
        for tile in walk:
            raw = torch.mm(tile.qi, tile.kj.T, out=tile.view(raw_buf))
            p = _positives(block, tile)
            # dLoss/dL = -z * sigmoid(-z * L): sigmoid(L) off the positive, -sigmoid(-L) on it, both
            # from sigmoid of the margin (never 1 - sigmoid: a confident positive keeps its digits).
            ds = _flip(_margins(tile.view(ds_buf), raw, block, p).sigmoid_(), p).mul_(block.g_row[tile.rows, None])
            # Cascade sums (torch.sum), not torch.dot: these terms do not cancel, so a running sum
            # over the tile would lose ~sqrt(n) * eps of their total.
            dparams[0] += torch.mul(ds, raw, out=raw).sum()
            dparams[1] += ds.sum()
            dq[tile.rows].addcmul_(ds @ tile.kj, block.scale)
            dk[tile.cols].addcmul_(ds.T @ tile.qi, block.scale)
        return dparams
