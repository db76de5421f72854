"""The chunked route's passes in torch, for CPU tensors: the math of :mod:`infcl.kernels.chunked_softmax` (and
of :mod:`infcl.kernels.chunked_sigmoid`: :func:`sigmoid_chunk`, the torch tiles' softplus and sigmoid of the margins)
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
from ..torch_tiles.sigmoid import SOFTPLUS_THRESHOLD
from ..torch_tiles.softmax import TileMasks, probabilities
from ..torch_tiles.walk import replace_positives
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
    _round(grad.mul_(factor[:, None] if factor.dim() else factor), operand)
    return dscale


def _round(values: torch.Tensor, operand: torch.dtype) -> None:
    """``values`` (float32) rounded to ``operand`` in place, ROUND_ROWS rows at a time (the temporary stays small)."""
    if operand != values.dtype:
        for i in range(0, values.shape[0], ROUND_ROWS):
            part = values[i : i + ROUND_ROWS]
            part.copy_(part.to(operand))


def sigmoid_chunk(raw, params, pos, loss_out, ds, factor, g_row, operand, scratch) -> Optional[torch.Tensor]:
    """The sigmoid pass over one chunk (:func:`infcl.kernels.chunked_sigmoid.sigmoid_chunk`'s contract): ``loss_out``
    [C] (or None) = each row's sum of softplus(t), t = -z * (raw * scale + bias); ``ds`` (or None) = dL * factor
    rounded to ``operand`` (held in float32), dL = g_row * -z * sigmoid(t); returns the (scale, bias) gradients'
    parts ``[2]`` (or None without ``ds``). ``scratch``: two [C, Bk] float32 views."""
    inside, idx = _positives(pos)
    t = torch.mul(raw, params[0], out=scratch[0]).add_(params[1])
    replace_positives(t, inside, idx, -t.gather(1, idx))
    if loss_out is not None:
        softplus = torch._C._nn.softplus(t, 1.0, SOFTPLUS_THRESHOLD, out=scratch[1])
        torch.sum(softplus, dim=1, out=loss_out)
    if ds is None:
        return None
    # -z * sigmoid(t): sigmoid(t) off the positive, -sigmoid(t) on it (never 1 - sigmoid: a confident entry keeps
    # its digits), times the row's upstream gradient.
    dl = torch.sigmoid(t, out=ds)
    replace_positives(dl, inside, idx, -dl.gather(1, idx)).mul_(g_row[:, None])
    # Cascade sums (torch.sum), as the torch tiles: these terms do not cancel.
    dparams = torch.stack((torch.mul(dl, raw, out=scratch[1]).sum(), dl.sum()))
    _round(dl.mul_(factor[:, None] if factor.dim() else factor), operand)
    return dparams
