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

``forward_block(block, symmetric) -> (rows [3, Bq], cols [2, Bk] or None)``
    rows[0:2] = stats of each row of S over this block's columns
    rows[2]   = S[i, pos[i]] where pos[i] >= 0, else 0 (the positive logit, from the same tile)
    cols      = stats of each column over the local rows (only for the ``symmetric`` loss)

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

Masks (:mod:`infcl.masks`; ``Block.masked``) — the block also carries the ids of its rows and columns
(``q_ids`` [Bq], ``k_ids`` [Bk], int64), the guide features (``guide_q`` [Bq, D'], ``guide_k`` [Bk, D'],
in the guide's accumulation dtype) with each row's (and, symmetric, column's) threshold, and
``multi_positive``. Inside each tile, never beyond it: the positives P (the one-hot of ``pos`` when
``multi_positive`` is None, else ``q_ids[i] == k_ids[j]``) and the exclusions E = (same id or guide score
G = guide_q @ guide_k.T above the threshold) and not P; the column direction's E uses the column
thresholds. The forward's outputs are then ``[6, n]`` for rows and columns alike (rows of
:mod:`infcl.masks`): the stats over the columns not in E, the positives' max (and, for "sum", their
log-sum relative to it), the sum of the positives' logits and their count. The backward forms, with
P_row = exp((S - m) - r) off E and 0 on E, and the positives' global count (``row_pos_count``, "mean")
or stats (``row_pos_stats``, "sum"):
    Y = the one-hot of ``pos`` (multi_positive None): as above, the positive's entry g * expm1(x)
    Y = 1 / |P(i)| on P ("mean"): the entry p - 1/c as expm1(x + log c) / c
    Y = softmax of S over P(i) ("sum"): the entry p - y as y * expm1(d), d = lse(P(i)) - lse_i <= 0
and dq, dk, dscale as above. The thresholds come from a pass before the loss:
``guide_label_scores(guide_q, guide_k, pos, feature_dtype) -> [Bq]`` G[i, pos[i]] (0 where pos[i] < 0),
by the same arithmetic as the guide scores of the backend's tiles for features of ``feature_dtype``,
so a column that duplicates the labelled one ties its threshold exactly. With ids that never repeat
(nothing excluded, one positive per row) every one of these is the plain loss bit for bit.

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
    # Masks (softmax loss; see the module docstring), all None for the plain loss.
    q_ids: Optional[Tensor] = None  # [Bq] int64 ids of the rows
    k_ids: Optional[Tensor] = None  # [Bk] int64 ids of the block's columns
    guide_q: Optional[Tensor] = None  # [Bq, D'] guide features of the rows (guide accumulation dtype)
    guide_k: Optional[Tensor] = None  # [Bk, D'] guide features of the block's columns
    row_threshold: Optional[Tensor] = None  # [Bq]: G[i, j] above it excludes column j from row i
    col_threshold: Optional[Tensor] = None  # [Bk]: G[i, j] above it excludes row i from column j (symmetric)
    multi_positive: Optional[str] = None  # None (positive: pos) | "mean" | "sum" (positives: same id)
    row_pos_count: Optional[Tensor] = None  # [Bq] |P(i)|, global (masked backward, "mean")
    row_pos_stats: Optional[Tensor] = None  # [2, Bq] global stats of the row's positives (masked backward, "sum")
    col_pos_count: Optional[Tensor] = None  # [Bk] the same per column (symmetric)
    col_pos_stats: Optional[Tensor] = None  # [2, Bk]

    @property
    def symmetric(self) -> bool:
        return self.col_stats is not None

    @property
    def masked(self) -> bool:
        return self.q_ids is not None or self.guide_q is not None


class BlockBackend(Protocol):
    name: str

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]: ...

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor: ...


class SigmoidBlockBackend(Protocol):
    """The sigmoid (SigLIP) loss's block operations (see the module docstring); every backend has both."""

    name: str

    def sigmoid_forward_block(self, block: Block) -> Tensor: ...

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor: ...
