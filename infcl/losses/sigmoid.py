"""The sigmoid (SigLIP) loss's per-block steps in the ring loop.

Every logit L_ij = scale * q_i . k_j + bias is its own binary problem (z = +1 at the row's positive,
-1 elsewhere), so a row's loss is a plain sum over blocks: the forward row accumulator is ``[1, Bq]``,
each block adds ``sum_j softplus(-z_ij L_ij)`` over its columns, and nothing travels back with the
columns (``col_rows = 0``). Backward: the rows carry ``[1, Bq]`` upstream gradients, nothing travels
ahead with k, and the loss has two parameters, the scale and the bias. Both belong to this rank's own
rows, so each block returns them in row 0 and zeros in row 1 (nothing is credited to the block's
owner): summed over ranks, the per-replica gradients are the full derivative, as for the softmax loss.
"""

from typing import Optional

import torch

from ..backends.base import Block, SigmoidBlockBackend, Tensor

PARAMS = ("scale", "bias")  # order of the loss parameters in a block's gradient


class SigmoidRing:
    """:class:`infcl.ring.driver.RingLoss` for the sigmoid loss with this call's ``bias`` (0-d, on the features'
    device)."""

    col_rows = 0
    n_params = len(PARAMS)
    k_side = ()  # nothing travels with k but k

    def __init__(self, bias: Tensor):
        self.bias = bias

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.zeros(1, n, dtype=dtype, device=device)

    # Row losses are sums over the global columns; there are no column partials (col_rows = 0).
    merge_rows = merge_cols = staticmethod(Tensor.add_)

    def forward_step(self, backend: SigmoidBlockBackend, q: Tensor, k: Tensor, scale: Tensor, pos: Tensor, k_side=()):
        rows = backend.sigmoid_forward_block(Block(q=q, k=k, scale=scale, pos=pos, bias=self.bias))
        return rows[None], None

    def backward_step(
        self,
        backend: SigmoidBlockBackend,
        q: Tensor,
        k: Tensor,
        scale: Tensor,
        pos: Tensor,
        rows: Tensor,
        ahead: Optional[Tensor],
        dq: Tensor,
        dk: Tensor,
        k_side=(),
    ) -> Tensor:
        block = Block(q=q, k=k, scale=scale, pos=pos, g_row=rows[0], bias=self.bias)
        own = backend.sigmoid_backward_block(block, dq, dk)
        return torch.stack((own, torch.zeros_like(own)))
