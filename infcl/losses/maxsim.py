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

from ..contract import Block, Tensor
from ..ring.driver import ParamGrads
from .softmax import SoftmaxPartials, SoftmaxUpstream

# The k-side tensors a MaxSim block may carry, in the order they travel (the ones given, in this order).
K_SIDE_FIELDS = ("k_mask", "k_ids")


class MaxSimSteps:
    """:class:`infcl.ring.driver.RingLoss` for the MaxSim loss (one direction: queries against documents).

    ``q_weight`` [Bq, Lq]: the rows' token weights; ``q_ids`` [Bq] or None: the rows' ids. ``k_mask`` [Bk, Lk] bool
    and ``k_ids`` [Bk] (each may be None): this rank's documents' own, sent around the ring with them.
    """

    symmetric = False
    n_params = 1

    def __init__(self, q_weight: Tensor, q_ids: Optional[Tensor], k_mask: Optional[Tensor], k_ids: Optional[Tensor]):
        self.rows_side = {"q_weight": q_weight, "q_ids": q_ids}
        given = {"k_mask": k_mask, "k_ids": k_ids}
        self.k_names = tuple(name for name in K_SIDE_FIELDS if given[name] is not None)
        self.k_side = tuple(given[name] for name in self.k_names)

    def _block(self, block: Block, k_side) -> Block:
        """The held block with the rows' weights and ids and the held documents' mask and ids."""
        return replace(block, **self.rows_side, **dict(zip(self.k_names, k_side)))

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
