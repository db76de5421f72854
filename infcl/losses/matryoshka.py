"""The softmax loss over Matryoshka prefixes (:mod:`infcl.matryoshka`): its per-block steps in the ring loop.

Every prefix k has its own softmax loss on S^k, so every field of the plain loss's partials gains a prefix
axis before the items: forward :class:`PrefixPartials` (stats ``[2, K, n]``, positive ``[K, n]``), backward
:class:`PrefixUpstream` (stats ``[2, K, n]``, grad ``[K, n]``). The backend walks each tile once for all K
(``matryoshka_forward_block`` / ``matryoshka_backward_block``, :mod:`infcl.backends.torch_tiles.matryoshka`).

With the mask options (:mod:`infcl.masks`), :class:`MaskedMatryoshkaSteps`: the masked loss's partials
(:class:`~infcl.losses.softmax.MaskedPartials`) with the same prefix axis, ``[6, K, n]`` packed (the masks' rows per
prefix), on a backend whose ``masked_matryoshka`` attribute is True: a tile's positives and exclusions do not depend
on the prefix (ids, and a guide whose features are never truncated), so the backend forms them once per tile and
applies them to every prefix's S^k (the torch tiles, the native kernel, Triton). The other backends run one call
per prefix (:func:`infcl.api.matryoshka_loss`).
"""

from dataclasses import replace
from typing import NamedTuple, Optional, Tuple

import torch

from ..contract import Block, Tensor, accum_dtype
from ..lse import empty_stats, lse_merge
from ..masks import MaskOptions, empty_masked
from ..matryoshka import NORM_EPS, Prefixes
from ..ring.driver import ParamGrads
from .softmax import MaskedPartials, MaskedSoftmaxSteps, SoftmaxPartials


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
        if hasattr(backend, "matryoshka_forward_block"):
            row_stats, row_pos, col_stats = backend.matryoshka_forward_block(block, self.prefixes, self.symmetric)
        else:
            row_stats, row_pos, col_stats = self._per_prefix_forward(backend, block)
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
        if hasattr(backend, "matryoshka_backward_block"):
            dscale = backend.matryoshka_backward_block(replace(block, **fields), self.prefixes, dq, dk)
        else:
            dscale = self._per_prefix_backward(backend, block, rows, cols, dq, dk)
        return ParamGrads(own=dscale[:1], owner=dscale[1:])

    # A backend without the fused block operations: its plain block operations once per prefix, on the block's
    # prefix features (unit rows where renormalized), the normalization's gradient applied per block.

    def _prefix_block(self, block: Block, i: int) -> Tuple[Block, Tensor, Tensor]:
        """(the block on prefix i's features, q's and k's row factors [n] or None)."""
        acc = accum_dtype(block.q.dtype)
        m, renorm = self.prefixes.dims[i], self.prefixes.renormalize[i]
        q, k = block.q.to(acc)[:, :m], block.k.to(acc)[:, :m]
        if not renorm:
            return replace(block, q=q, k=k), None, None
        a, b = _inverse_norms(q), _inverse_norms(k)
        return replace(block, q=q * a[:, None], k=k * b[:, None]), a, b

    def _per_prefix_forward(self, backend, block: Block):
        rows, cols = [], []
        for i in range(self.prefixes.count):
            prefix, _, _ = self._prefix_block(block, i)
            r, c = backend.forward_block(prefix, self.symmetric)
            rows.append(r)
            cols.append(c)
        row_stats = torch.stack([r[:2] for r in rows], dim=1)
        row_pos = torch.stack([r[2] for r in rows])
        col_stats = torch.stack(cols, dim=1) if self.symmetric else None
        return row_stats, row_pos, col_stats

    def _per_prefix_backward(self, backend, block: Block, rows, cols, dq: Tensor, dk: Tensor) -> Tensor:
        dscale = dq.new_zeros(2)
        for i in range(self.prefixes.count):
            prefix, a, b = self._prefix_block(block, i)
            fields = {"row_stats": rows.stats[:, i], "g_row": rows.grad[i]}
            if cols is not None:
                fields.update(col_stats=cols.stats[:, i], g_col=cols.grad[i])
            m = self.prefixes.dims[i]
            dq_hat, dk_hat = dq.new_zeros(dq.shape[0], m), dk.new_zeros(dk.shape[0], m)
            dscale += backend.backward_block(replace(prefix, **fields), dq_hat, dk_hat)
            dq[:, :m] += _through_normalization(dq_hat, prefix.q, a)
            dk[:, :m] += _through_normalization(dk_hat, prefix.k, b)
            del prefix, dq_hat, dk_hat  # one prefix's copies at a time
        return dscale

    def losses(self, part: PrefixPartials) -> Tensor:
        return part.losses()

    def saved(self, part: PrefixPartials) -> Tuple[Tensor, ...]:
        return (part.stats,)

    def upstream(self, saved: Tuple[Tensor, ...], grad: Tensor) -> PrefixUpstream:
        (stats,) = saved
        return PrefixUpstream(stats.contiguous(), grad.to(stats.dtype).contiguous())


def _inverse_norms(x: Tensor) -> Tensor:
    """[n] 1 / max(|x_i|, eps), F.normalize's factor."""
    return 1.0 / torch.linalg.vector_norm(x, dim=1).clamp_min(NORM_EPS)


def _through_normalization(grad_hat: Tensor, unit: Tensor, factor: Optional[Tensor]) -> Tensor:
    """The gradient of x from that of x_hat = x / |x|: factor * (g - (g . x_hat) x_hat), as F.normalize's
    backward forms it, in place in ``grad_hat`` (``factor`` None: no normalization, g itself)."""
    if factor is None:
        return grad_hat
    radial = torch.bmm(grad_hat[:, None, :], unit[:, :, None]).view(-1)
    return grad_hat.addcmul_(unit, radial[:, None], value=-1.0).mul_(factor[:, None])


class PrefixMaskedPartials(MaskedPartials):
    """:class:`~infcl.losses.softmax.MaskedPartials` whose fields carry a prefix axis before the items (stats and
    the positives' stats ``[2, K, n]``, their logits' sum and count ``[K, n]``); every method of the masked
    partials is elementwise over it but :meth:`info`, whose rows go after the prefix axis."""

    __slots__ = ()

    def info(self) -> Tensor:
        """[K, 3, n] per-prefix row infos (:mod:`infcl.stats`)."""
        return super().info().transpose(0, 1)


class MaskedMatryoshkaSteps(MaskedSoftmaxSteps):
    """:class:`infcl.ring.driver.RingLoss` for the softmax loss over Matryoshka prefixes with mask options
    (``masks``, guide thresholds set): the masked loss's ring steps (its k side, merges, NaN thresholds, losses,
    upstream) with a prefix axis, each block walked once for all K by the backend's fused masked operations."""

    parts = PrefixMaskedPartials

    def __init__(self, symmetric: bool, masks: MaskOptions, prefixes: Prefixes):
        super().__init__(symmetric, masks)
        self.prefixes = prefixes

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> PrefixMaskedPartials:
        return PrefixMaskedPartials.unpack(
            empty_masked(self.prefixes.count * n, dtype, device).view(-1, self.prefixes.count, n)
        )

    def _forward_block(self, backend, block: Block) -> Tuple[Tensor, Optional[Tensor]]:
        """(rows [6, K, Bq], columns [6, K, Bk] or None)."""
        return backend.matryoshka_forward_block(block, self.prefixes, self.symmetric)

    def _backward_block(self, backend, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return backend.matryoshka_backward_block(block, self.prefixes, dq, dk)
