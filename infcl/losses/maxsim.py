"""The MaxSim (late-interaction) contrastive loss's per-block steps in the ring loop.

The scores are S = scale * R, R[i, j] = sum_t w[i, t] * max_u q[i, t] . k[j, u] (contract: :mod:`infcl.contract`),
and the loss over them is the plain softmax loss, one direction: the same named partials
(:class:`~infcl.losses.softmax.SoftmaxPartials`: stats and positive score, merged by :func:`infcl.lse.lse_merge`)
and backward inputs (:class:`~infcl.losses.softmax.SoftmaxUpstream`). What differs is the block: q and k are token
embeddings, the query tokens' weights stay with the rows, and the documents' token mask and ids travel with the
documents (``k_side``), in the same exchange as their tokens.
"""

from dataclasses import replace
from typing import Optional

from ..contract import Block, MaskOptions, Tensor
from .softmax import SoftmaxPartials, SoftmaxSteps


class MaxSimSteps(SoftmaxSteps):
    """:class:`infcl.ring.driver.RingLoss` for the MaxSim loss (one direction: queries against documents): the
    softmax loss's steps on MaxSim's own block operations.

    ``q_weight`` [Bq, Lq]: the rows' token weights, which stay. ``k_mask`` [Bk, Lk] bool or None: this rank's
    documents' token mask, and ``masks`` (:class:`~infcl.contract.MaskOptions` with ids, or None) the false
    negatives' ids; the documents' mask and the options' k side (their ids) travel with the documents.
    """

    def __init__(self, q_weight: Tensor, k_mask: Optional[Tensor], masks: Optional[MaskOptions]):
        super().__init__(symmetric=False)
        self.q_weight, self.masks = q_weight, masks
        self.has_k_mask = k_mask is not None
        self.k_side = (() if k_mask is None else (k_mask,)) + (() if masks is None else masks.k_side())

    def _block(self, block: Block, k_side, **fields) -> Block:
        """The held block with the rows' weights, the held documents' mask and options, and ``fields``."""
        k_mask = k_side[0] if self.has_k_mask else None
        rest = tuple(k_side[1:] if self.has_k_mask else k_side)
        masks = None if self.masks is None else self.masks.holding(rest)
        return replace(block, q_weight=self.q_weight, k_mask=k_mask, masks=masks, **fields)

    def forward_step(self, backend, block: Block, k_side=()):
        return SoftmaxPartials.unpack(backend.maxsim_forward_block(self._block(block, k_side))), None

    @staticmethod
    def _backward_block(backend, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return backend.maxsim_backward_block(block, dq, dk)
