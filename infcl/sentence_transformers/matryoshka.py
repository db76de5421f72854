"""``MatryoshkaLoss``: sentence-transformers' wrapper, with every dimension's loss out of one fused pass where
the wrapped loss is infcl's.

sentence-transformers' ``MatryoshkaLoss`` runs the wrapped loss once per dimension on the truncated,
renormalized embeddings (``shrink``), and with the cached losses runs their loss stage once per dimension.
This subclass takes the same constructor arguments and, where the wrapped loss is one of infcl's ranking
losses (:class:`~.losses.MultipleNegativesRankingLoss`, its symmetric variant, or their cached versions,
whose loss stage is one of them) and the batch maps onto plain ``cal_inf_loss`` calls
(:func:`~.objective.ranking.plain_calls`: no hardness weighting; query_to_doc, or both directions per
direction), runs the wrapped loss once with ``cal_inf_loss(matryoshka=...)``: the drawn dimensions' losses,
weighted, each prefix renormalized as ``shrink`` does, out of one tiled pass over the full embeddings on the
torch tiles (:mod:`infcl.matryoshka`; the other backends run one pass per prefix inside that call). Anything
else (another wrapped loss, GIST, hardness, joint multi-direction partitions) goes to sentence-transformers'
own per-dimension loop.

``n_dims_per_step`` draws the same dimensions as sentence-transformers' for the same ``random`` state (one
``random.sample`` per call, as theirs).
"""

import random
from typing import Any, Dict, Iterable, Sequence

from sentence_transformers.base.losses.gradcache import resolve_gradient_cache_loss, uses_gradient_cache
from sentence_transformers.sentence_transformer import losses as st_losses
from torch import Tensor, nn

from ..matryoshka import Matryoshka
from .losses import MultipleNegativesRankingLoss
from .mirror import mirrors
from .objective.ranking import plain_calls


def _ranking_loss(loss: nn.Module):
    """The infcl ranking loss that computes ``loss``'s objective (itself, or a cached loss's ``.loss``), or None."""
    inner = resolve_gradient_cache_loss(loss).loss if uses_gradient_cache(loss) else loss
    return inner if isinstance(inner, MultipleNegativesRankingLoss) else None


def _fusable(ranking: MultipleNegativesRankingLoss, columns: int) -> bool:
    """Whether a batch of ``columns`` embedding columns runs as plain ``cal_inf_loss`` calls."""
    docs = [None] * (columns - 1)
    return plain_calls(
        ranking.directions, ranking.partition_mode, ranking.hardness_mode, ranking.hardness_strength, docs
    )


class MatryoshkaLoss(st_losses.MatryoshkaLoss):
    """sentence-transformers' ``MatryoshkaLoss`` (the same arguments, loss and weights), fused where the wrapped
    loss is infcl's (module docstring)."""

    @mirrors(st_losses.MatryoshkaLoss, extras=())
    def __init__(self, arguments: Dict[str, Any]) -> None:
        super().__init__(**arguments)
        if _ranking_loss(self.loss) is not None and self.uses_gradient_cache:
            # sentence-transformers' constructor wrapped the loss stage in its per-dimension loop: keep that loop
            # for the batches that cannot fuse, and run the fused stage for the others.
            target = resolve_gradient_cache_loss(self.loss)
            target.calculate_loss = _FusedLossStage(self, target.calculate_loss)

    def _draw(self):
        """(dims, weights) of this step, drawn as sentence-transformers draws them."""
        indices = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(indices):
            indices = sorted(random.sample(indices, self.n_dims_per_step))
        return Matryoshka(
            tuple(self.matryoshka_dims[i] for i in indices), tuple(float(self.matryoshka_weights[i]) for i in indices)
        )

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Tensor) -> Tensor:
        ranking = _ranking_loss(self.loss)
        if self.uses_gradient_cache or ranking is None:
            return super().forward(sentence_features, labels)
        features = list(sentence_features)
        if not _fusable(ranking, len(features)):
            return super().forward(features, labels)
        return _with_prefixes(ranking, self._draw(), lambda: self.loss(features, labels))


def _with_prefixes(ranking: MultipleNegativesRankingLoss, prefixes: Matryoshka, run):
    """``run()`` with ``ranking``'s ``cal_inf_loss`` calls taking ``prefixes``."""
    ranking.matryoshka = prefixes
    try:
        return run()
    finally:
        ranking.matryoshka = None


class _FusedLossStage:
    """A cached loss's ``calculate_loss`` under :class:`MatryoshkaLoss`: the fused stage where the batch fuses,
    else sentence-transformers' per-dimension loop (``loop``, its ``CachedLossDecorator``)."""

    def __init__(self, owner: MatryoshkaLoss, loop):
        self.owner, self.loop = owner, loop
        self.fn = loop.fn  # the cached loss's own calculate_loss

    def __call__(self, reps: Sequence[Sequence[Tensor]], *args, **kwargs) -> Tensor:
        ranking = _ranking_loss(self.owner.loss)
        if not _fusable(ranking, len(reps)):
            return self.loop(reps, *args, **kwargs)
        return _with_prefixes(ranking, self.owner._draw(), lambda: self.fn(reps, *args, **kwargs))
