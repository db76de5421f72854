"""The sigmoid (SigLIP) loss on the torch tiles (contract: :mod:`infcl.contract`): each tile's logits
scale * raw + bias with their sign flipped at the positive (the margins), their softplus summed per row in
the forward and their sigmoid as dL in the backward.

GEMMs per block: forward 1 (the logits), backward 3 (the logits again, dq, dk).
"""

import torch
import torch.nn.functional as F

from ...contract import Block, Tensor
from .walk import TileSizes, Walk, positives, replace_positives

# F.softplus returns x itself above its threshold. The default, 20, drops log1p(e^-20) ~ 2e-9, which
# float64 resolves; above 40, e^-x is below half an ulp of x even in float64, and below it exp(x) <= 2e17
# is finite in every accumulation dtype.
SOFTPLUS_THRESHOLD = 40.0


def _margins(out: Tensor, raw: Tensor, block: Block, inside: Tensor, idx: Tensor) -> Tensor:
    """out = -z * (scale * raw + bias): the sigmoid loss's logits, their sign flipped at the positives,
    so that each entry's loss is softplus(out) and its derivative by the logit is -z * sigmoid(out)."""
    torch.mul(raw, block.scale, out=out).add_(block.bias)
    return replace_positives(out, inside, idx, -out.gather(1, idx))


class SigmoidTiles(TileSizes):
    """The sigmoid loss's block operations on the torch tiles."""

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        walk = Walk(block, self.tiles(block.q.device))
        rows = walk.zeros(walk.q.shape[0])
        (buf,) = walk.buffers(1)
        for tile in walk:
            margins = torch.mm(tile.qi, tile.kj.T, out=tile.view(buf))
            _margins(margins, margins, block, *positives(block.pos, tile))
            rows[tile.rows] += F.softplus(margins, threshold=SOFTPLUS_THRESHOLD).sum(dim=1)
        return rows

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        walk = Walk(block, self.tiles(block.q.device))
        dparams = walk.zeros(2)  # (scale, bias)
        raw_buf, ds_buf = walk.buffers(2)
        for tile in walk:
            raw = torch.mm(tile.qi, tile.kj.T, out=tile.view(raw_buf))
            inside, idx = positives(block.pos, tile)
            # dLoss/dL = -z * sigmoid(-z * L): sigmoid(L) off the positive, -sigmoid(-L) on it, both
            # from sigmoid of the margin (never 1 - sigmoid: a confident positive keeps its digits).
            ds = _margins(tile.view(ds_buf), raw, block, inside, idx).sigmoid_()
            ds = replace_positives(ds, inside, idx, -ds.gather(1, idx)).mul_(block.g_row[tile.rows, None])
            # Cascade sums (torch.sum), not torch.dot: these terms do not cancel, so a running sum
            # over the tile would lose ~sqrt(n) * eps of their total.
            dparams[0] += torch.mul(ds, raw, out=raw).sum()
            dparams[1] += ds.sum()
            dq[tile.rows].addcmul_(ds @ tile.kj, block.scale)
            dk[tile.cols].addcmul_(ds.T @ tile.qi, block.scale)
        return dparams
