"""The block contract: what a backend computes on one (local q rows) x (k block) pair.

The ring driver (:mod:`infcl.ring.driver`) owns the loop over k blocks and the reductions; a backend
turns one block S = scale * q @ k.T into statistics (forward) and gradient contributions (backward)
without ever holding S whole. Everything a block operation reads travels in one frozen
:class:`Block`, so a new loss or option adds a field, not a parameter in every backend. All outputs are
in the accumulation dtype (float32 for float32/bfloat16/float16 inputs, float64 for float64).

The positives are part of the block: ``Block.pos[i]`` is the column *within this block* of row i's
positive, or -1 when it lies in another block. Backends read the positive logit off the same tile
arithmetic as the log-sum-exp and subtract the one-hot inside the tile, so nothing outside the tiles
recomputes a dot product with different rounding.

Softmax (InfoNCE / CLIP) loss — stats are ``[2, n]`` (max, log-sum relative to it; see :mod:`infcl.lse`):

``forward_block(block, want_cols) -> (rows [3, Bq], cols [2, Bk] or None)``
    rows[0:2] = stats of each row of S over this block's columns
    rows[2]   = S[i, pos[i]] where pos[i] >= 0, else 0 (the positive logit, from the same tile)
    cols      = stats of each column over the local rows (only when ``want_cols``: symmetric loss)

``backward_block(block, dq, dk) -> dscale [2]`` with the *global* stats and upstream gradients in the
block (``row_stats``, ``g_row`` and, symmetric, ``col_stats``, ``g_col``); Y is the one-hot of ``pos``:
    P_row   = exp((S - m_row) - r_row),  P_col likewise with the column stats
    dS      = g_row * (P_row - Y) + g_col * (P_col - Y)    formed in the accumulation dtype, in the tile
    dq     += scale * dS @ k                                accumulated in place, [Bq, D]
    dk     += scale * dS.T @ q                              accumulated in place, [Bk, D]
    dscale  = (sum(g_row * (P_row - Y) * q @ k.T), sum(g_col * (P_col - Y) * q @ k.T))
The scale gradient is a sum of per-entry terms (never a difference of two large sums), split by
direction so the ring can credit each rank's replica of the scale with the derivative of its own loss
(open_clip's convention). The backward must recompute S bit-identically to its forward.

Sigmoid (SigLIP) loss — ``Block.bias`` is set, logits are L = scale * q @ k.T + bias and z = +1 at the
positive (Y = one-hot of ``pos``), -1 elsewhere; nothing is merged across blocks but plain sums:

``sigmoid_forward_block(block) -> rows [Bq]``
    rows[i] = sum_j softplus(-z_ij * L_ij)    (= -log sigmoid(z_ij * L_ij), never formed as log(sigmoid))

``sigmoid_backward_block(block, dq, dk) -> dparams [2]`` with the upstream gradients ``g_row``:
    dL      = g_row * (sigmoid(L) - Y)     formed as g * sigmoid(L) off the positive, -g * sigmoid(-L) on it
    dq     += scale * dL @ k,   dk += scale * dL.T @ q
    dparams = (sum(dL * q @ k.T), sum(dL))     the scale and the bias gradient
"""

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch

Tensor = torch.Tensor


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Block:
    """The arguments of one block operation (forward fields first; backward-only fields default None)."""

    q: Tensor  # [Bq, D] this rank's rows, any strides
    k: Tensor  # [Bk, D] the k block held at this ring step, any strides
    scale: Tensor  # 0-d, accumulation dtype, on q's device (never a host value: no sync per step)
    pos: Tensor  # [Bq] int64: column in this block of each row's positive, -1 where it is elsewhere
    row_stats: Optional[Tensor] = None  # [2, Bq] global stats of each row (backward)
    g_row: Optional[Tensor] = None  # [Bq] upstream gradient of each row's loss (backward)
    col_stats: Optional[Tensor] = None  # [2, Bk] global stats of each column (symmetric backward)
    g_col: Optional[Tensor] = None  # [Bk] upstream gradient of each column's loss (symmetric backward)
    bias: Optional[Tensor] = None  # 0-d like scale: the sigmoid loss's logit bias (None for softmax)

    @property
    def symmetric(self) -> bool:
        return self.col_stats is not None


class BlockBackend(Protocol):
    name: str

    def forward_block(self, block: Block, want_cols: bool) -> Tuple[Tensor, Optional[Tensor]]:
        ...

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        ...


class SigmoidBlockBackend(Protocol):
    """The sigmoid (SigLIP) loss's block operations (see the module docstring); every backend has both."""

    name: str

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        ...

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        ...
