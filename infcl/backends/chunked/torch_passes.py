"""The chunked route's two passes in torch, for CPU tensors: the math of :mod:`infcl.kernels.chunked_softmax`
on a whole chunk at once (its stats from :func:`infcl.lse.tile_stats`, its dS from the torch tiles'
:func:`infcl.backends.torch_tiles.softmax.probabilities`, the positive's entry as ``g * expm1(x)``), rounded to the
operand dtype as the Triton pass rounds it. They hold two float32 [C, Bk] buffers besides the scores and dS
(:mod:`.plan` counts them). The Triton passes run on CPU tensors too, under TRITON_INTERPRET=1, when
``ChunkedBackend(passes="triton")`` asks (the interpreter tests): slower, the same results up to the order of
the sums.
"""

from typing import Optional

import torch

from ...lse import tile_stats
from ..torch_tiles.softmax import TileMasks, probabilities
from .plan import ROUND_ROWS


def _positives(pos: torch.Tensor):
    """(inside, idx): which rows have their positive in this block, and its column (0 for the others)."""
    inside = pos >= 0
    return inside, pos.clamp(min=0)[:, None]


def chunk_stats(raw, scale, pos, symmetric: bool, rows_out, scratch) -> Optional[torch.Tensor]:
    """rows_out [3, C] = (max, r, positive logit or 0) of s = raw * scale, and the column stats [2, Bk] (or
    None). ``raw`` is overwritten by s (the forward reads it no more); ``scratch``: two [C, Bk] float32 views."""
    s = raw.mul_(scale)
    inside, idx = _positives(pos)
    rows_out[2] = torch.where(inside, s.gather(1, idx).squeeze(1), 0.0)
    rows_out[:2] = tile_stats(s, 1, *scratch)
    return tile_stats(s, 0, *scratch) if symmetric else None


def chunk_grad(raw, ds, scale, factor, pos, row_stats, g_row, col_stats, g_col, operand, scratch) -> torch.Tensor:
    """ds [C, Bk] = dS * factor rounded to ``operand`` (held in float32), and the scale gradient's (row,
    column) parts ``[2]``: sums of dS * raw. ``scratch``: two [C, Bk] float32 views."""
    s = torch.mul(raw, scale, out=scratch[0])  # the forward's s, bit for bit
    masks = TileMasks(None, *_positives(pos), None, None)
    dscale = raw.new_zeros(2)
    grad = probabilities(ds, s, masks, None, row_stats[:, :, None], g_row[:, None], None, s)
    dscale[0] = torch.dot(grad.view(-1), raw.view(-1))
    if col_stats is not None:
        col = probabilities(scratch[1], s, masks, None, col_stats[:, None, :], g_col[None, :], None, s)
        dscale[1] = torch.dot(col.view(-1), raw.view(-1))
        grad.add_(col)
    grad.mul_(factor[:, None] if factor.dim() else factor)
    if operand != grad.dtype:
        for i in range(0, grad.shape[0], ROUND_ROWS):
            part = grad[i : i + ROUND_ROWS]
            part.copy_(part.to(operand))
    return dscale
