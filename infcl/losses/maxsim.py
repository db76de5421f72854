"""The MaxSim (late-interaction) contrastive loss's per-block steps in the ring loop.

The scores are S = scale * R, R[i, j] = sum_t w[i, t] * max_u q[i, t] . k[j, u] (contract: :mod:`infcl.contract`),
and the loss over them is the plain softmax loss, one direction: the same named partials
(:class:`~infcl.losses.softmax.SoftmaxPartials`: stats and positive score, merged by :func:`infcl.lse.lse_merge`)
and backward inputs (:class:`~infcl.losses.softmax.SoftmaxUpstream`). What differs is the block: q and k are token
embeddings, the query tokens' weights stay with the rows, and the documents' token mask and ids travel with the
documents (``k_side``), in the same exchange as their tokens.
"""

from dataclasses import replace
from typing import Optional, Tuple

import torch

from ..contract import Block, MaskOptions, Tensor
from ..ring.driver import ParamGrads
from .softmax import SoftmaxPartials, SoftmaxUpstream


class MaxSimSteps:
    """:class:`infcl.ring.driver.RingLoss` for the MaxSim loss (one direction: queries against documents).

    ``q_weight`` [Bq, Lq]: the rows' token weights, which stay. ``k_mask`` [Bk, Lk] bool or None: this rank's
    documents' token mask, and ``masks`` (:class:`~infcl.contract.MaskOptions` with ids, or None) the false
    negatives' ids; the documents' mask and the options' k side (their ids) travel with the documents.
    """

    symmetric = False
    n_params = 1

    def __init__(self, q_weight: Tensor, k_mask: Optional[Tensor], masks: Optional[MaskOptions]):
        self.q_weight, self.masks = q_weight, masks
        self.has_k_mask = k_mask is not None
        self.k_side = (() if k_mask is None else (k_mask,)) + (() if masks is None else masks.k_side())

    def _block(self, block: Block, k_side) -> Block:
        """The held block with the rows' weights and the held documents' mask and options."""
        k_mask = k_side[0] if self.has_k_mask else None
        rest = tuple(k_side[1:] if self.has_k_mask else k_side)
        masks = None if self.masks is None else self.masks.holding(rest)
        return replace(block, q_weight=self.q_weight, k_mask=k_mask, masks=masks)

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> SoftmaxPartials:
        return SoftmaxPartials.empty(n, dtype, device)

    @staticmethod
    def merge(acc: SoftmaxPartials, part: SoftmaxPartials) -> None:
        acc.merge_(part)

    def forward_step(self, backend, block: Block, k_side=()):
        return SoftmaxPartials.unpack(backend.maxsim_forward_block(self._block(block, k_side))), None

    def backward_step(
        self,
        backend,
        block: Block,
        rows: SoftmaxUpstream,
        cols: Optional[SoftmaxUpstream],
        dq: Tensor,
        dk: Tensor,
        k_side=(),
    ) -> ParamGrads:
        held = replace(self._block(block, k_side), **rows.block_fields("row"))
        dscale = backend.maxsim_backward_block(held, dq, dk)
        return ParamGrads(own=dscale[:1], owner=dscale[1:])

    # What the autograd Function calls with a forward result (infcl.function).

    def losses(self, part: SoftmaxPartials) -> Tensor:
        return part.losses()

    def saved(self, part: SoftmaxPartials) -> Tuple[Tensor, ...]:
        return (part.stats,)

    def upstream(self, saved: Tuple[Tensor, ...], grad: Tensor) -> SoftmaxUpstream:
        (stats,) = saved
        return SoftmaxUpstream(stats.contiguous(), grad.to(stats.dtype).contiguous())
