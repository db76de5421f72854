"""The sigmoid (SigLIP) loss's per-block steps in the ring loop.

Every logit L_ij = scale * q_i . k_j + bias is its own binary problem (z = +1 at the row's positive,
-1 elsewhere), so a row's loss is a plain sum over blocks: the forward row accumulator is
:class:`SigmoidPartials` (``loss`` [Bq]), each block adds ``sum_j softplus(-z_ij L_ij)`` over its columns,
and nothing travels back with the columns (the loss is not ``symmetric``). Backward: the rows carry
:class:`SigmoidUpstream` (``grad`` [Bq], the upstream gradients), nothing travels with k but k, and the
loss has two parameters, the scale and the bias. Both belong to this rank's own rows, so each block
returns them as its own and zeros for the block's owner: summed over ranks, the per-replica gradients are
the full derivative, as for the softmax loss.

With ids (``cal_siglip_loss(q_ids=, k_ids=)``: a :class:`~infcl.masks.MaskOptions` holding them) the rows' ids
stay and the columns' travel with k (``k_side``); each step's block holds the options of the block held.
"""

from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from ..contract import Block, MaskOptions, SigmoidBlockBackend, Tensor
from ..ring.driver import ParamGrads, SummedParts

PARAMS = ("scale", "bias")  # order of the loss parameters in a block's gradient


class SigmoidPartials(NamedTuple):
    """The forward partial of each row: ``[n]`` its loss summed over the columns seen so far."""

    loss: Tensor


class SigmoidUpstream(NamedTuple):
    """The backward's input per row: ``[n]`` the upstream gradient of its loss."""

    grad: Tensor


class SigmoidSteps(SummedParts):
    """:class:`infcl.ring.driver.RingLoss` for the sigmoid loss with this call's ``bias`` (0-d, on the features'
    device) and ``masks`` (the ids, or None: the positives are the labels)."""

    parts = SigmoidPartials  # row losses are sums over the global columns
    symmetric = False  # no column partials
    n_params = len(PARAMS)

    def __init__(self, bias: Tensor, masks: Optional[MaskOptions] = None):
        self.bias, self.masks = bias, masks
        self.k_side = () if masks is None else masks.k_side()  # the columns' ids travel with k

    def _block(self, block: Block, k_side, **fields) -> Block:
        masks = None if self.masks is None else self.masks.holding(k_side)
        return replace(block, bias=self.bias, masks=masks, **fields)

    def forward_step(self, backend: SigmoidBlockBackend, block: Block, k_side=()):
        return SigmoidPartials(backend.sigmoid_forward_block(self._block(block, k_side))), None

    def backward_step(
        self,
        backend: SigmoidBlockBackend,
        block: Block,
        rows: SigmoidUpstream,
        cols: None,
        dq: Tensor,
        dk: Tensor,
        k_side=(),
    ) -> ParamGrads:
        own = backend.sigmoid_backward_block(self._block(block, k_side, g_row=rows.grad), dq, dk)
        return ParamGrads(own=own, owner=torch.zeros_like(own))
