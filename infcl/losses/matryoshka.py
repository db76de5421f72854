"""The softmax loss over Matryoshka prefixes (:mod:`infcl.matryoshka`): its per-block steps in the ring loop.

Every prefix k has its own softmax loss on S^k, so every field of the plain loss's partials gains a prefix
axis before the items: forward :class:`PrefixPartials` (stats ``[2, K, n]``, positive ``[K, n]``), backward
:class:`PrefixUpstream` (stats ``[2, K, n]``, grad ``[K, n]``). The backend walks each tile once for all K
(``matryoshka_forward_block`` / ``matryoshka_backward_block``, :mod:`infcl.backends.torch_tiles.matryoshka`).
"""

from dataclasses import replace
from typing import NamedTuple, Optional, Tuple

import torch

from ..contract import Block, Tensor
from ..lse import empty_stats, lse_merge
from ..matryoshka import Prefixes
from ..ring.driver import ParamGrads
from .softmax import SoftmaxPartials


class PrefixUpstream(NamedTuple):
    stats: Tensor  # [2, K, n] global (max, rel) per prefix
    grad: Tensor  # [K, n] upstream gradient of each prefix's row loss


class PrefixPartials(NamedTuple):
    stats: Tensor  # [2, K, n]
    positive: Tensor  # [K, n]

    def losses(self) -> Tensor:
        """[K, n] per-prefix row losses (m - pos) + r, NaN where the lse is not finite."""
        return torch.stack([self.prefix(k).losses() for k in range(self.positive.shape[0])])

    def info(self) -> Tensor:
        """[K, 3, n] per-prefix row infos (:mod:`infcl.stats`)."""
        return torch.stack([self.prefix(k).info() for k in range(self.positive.shape[0])])

    def prefix(self, k: int) -> SoftmaxPartials:
        return SoftmaxPartials(self.stats[:, k], self.positive[k])


def _scatter_to_columns(row_values: Tensor, pos: Tensor, size: int) -> Tensor:
    """[K, size]: col[:, c] = row_values[:, i] for the row i whose positive is column c (0 for none)."""
    out = row_values.new_zeros(row_values.shape[0], size + 1)
    index = torch.where(pos >= 0, pos, size).expand(row_values.shape[0], -1)
    out.scatter_(1, index, row_values)
    return out[:, :size]


class MatryoshkaSteps:
    """:class:`infcl.ring.driver.RingLoss` for the softmax loss over Matryoshka prefixes."""

    n_params = 1
    k_side = ()

    def __init__(self, symmetric: bool, prefixes: Prefixes):
        self.symmetric, self.prefixes = symmetric, prefixes

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> PrefixPartials:
        count = self.prefixes.count
        stats = empty_stats(count * n, dtype, device).view(2, count, n)
        return PrefixPartials(stats, torch.zeros(count, n, dtype=dtype, device=device))

    @staticmethod
    def merge(acc: PrefixPartials, part: PrefixPartials) -> None:
        lse_merge(acc.stats, part.stats)
        acc.positive.add_(part.positive)

    def forward_step(self, backend, block: Block, k_side=()):
        row_stats, row_pos, col_stats = backend.matryoshka_forward_block(block, self.prefixes, self.symmetric)
        rows = PrefixPartials(row_stats, row_pos)
        if not self.symmetric:
            return rows, None
        return rows, PrefixPartials(col_stats, _scatter_to_columns(row_pos, block.pos, block.k.shape[0]))

    def backward_step(
        self,
        backend,
        block: Block,
        rows: PrefixUpstream,
        cols: Optional[PrefixUpstream],
        dq: Tensor,
        dk: Tensor,
        k_side=(),
    ) -> ParamGrads:
        fields = {"row_stats": rows.stats, "g_row": rows.grad}
        if cols is not None:
            fields.update(col_stats=cols.stats, g_col=cols.grad)
        dscale = backend.matryoshka_backward_block(replace(block, **fields), self.prefixes, dq, dk)
        return ParamGrads(own=dscale[:1], owner=dscale[1:])

    def losses(self, part: PrefixPartials) -> Tensor:
        return part.losses()

    def saved(self, part: PrefixPartials) -> Tuple[Tensor, ...]:
        return (part.stats,)

    def upstream(self, saved: Tuple[Tensor, ...], grad: Tensor) -> PrefixUpstream:
        (stats,) = saved
        return PrefixUpstream(stats.contiguous(), grad.to(stats.dtype).contiguous())
