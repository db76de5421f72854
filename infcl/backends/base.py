"""What a backend computes: the loss's two block operations on one (q rows) x (k block) pair.

The ring driver (:mod:`infcl.ring.driver`) owns the loop over k blocks, the positive logits and the
reductions; a backend only turns one block S = scale * q @ k.T into log-sum-exps (forward) and into
gradient contributions (backward), without ever holding S whole. All outputs are in the accumulation
dtype (float32 for float32/bfloat16/float16 inputs, float64 for float64).

Forward ``forward_block(q, k, scale, want_cols) -> (row_lse, col_lse)``:
    row_lse[i] = log sum_j exp(S[i, j])      shape [Bq]
    col_lse[j] = log sum_i exp(S[i, j])      shape [Bk], or None unless ``want_cols``

Backward ``backward_block(q, k, scale, row_lse, g_row, col_lse, g_col, dq, dk) -> (dscale_row, dscale_col)``
with the *global* log-sum-exps and the upstream gradients of the row / column log-sum-exps:
    dS      = g_row[:, None] * exp(S - row_lse[:, None]) + g_col[None, :] * exp(S - col_lse[None, :])
    dq     += scale * dS @ k                 accumulated in place, [Bq, D]
    dk     += scale * dS.T @ q               accumulated in place, [Bk, D]
    dscale_row = sum(g_row-part of dS * q @ k.T), dscale_col likewise (0-d tensors)
``col_lse``/``g_col`` are None for the one-directional loss (then dscale_col is 0).
The scale gradient is split by direction so the ring can credit each rank's replica of the scale
with the derivative of its own loss (open_clip's convention).
"""

from typing import Optional, Protocol, Tuple

import torch

Tensor = torch.Tensor


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BlockBackend(Protocol):
    name: str

    def forward_block(self, q: Tensor, k: Tensor, scale: float, want_cols: bool) -> Tuple[Tensor, Optional[Tensor]]:
        ...

    def backward_block(
        self,
        q: Tensor,
        k: Tensor,
        scale: float,
        row_lse: Tensor,
        g_row: Tensor,
        col_lse: Optional[Tensor],
        g_col: Optional[Tensor],
        dq: Tensor,
        dk: Tensor,
    ) -> Tuple[Tensor, Tensor]:
        ...
