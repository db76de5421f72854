"""``MatryoshkaLoss``: sentence-transformers' wrapper, with every dimension's loss out of one fused pass where
the wrapped loss is infcl's.

sentence-transformers' ``MatryoshkaLoss`` runs the wrapped loss once per dimension on the truncated,
renormalized embeddings (``shrink``), and with the cached losses runs their loss stage once per dimension.
This subclass takes the same constructor arguments and, where the wrapped loss is one of infcl's and its batch
maps onto one ``cal_inf_loss`` call per loss term, runs the wrapped loss once with
``cal_inf_loss(matryoshka=...)``: the drawn dimensions' losses, weighted, each prefix renormalized as
``shrink`` does, out of the full embeddings. The wrapped losses that fuse (:func:`_fusable`):

- :class:`~.losses.MultipleNegativesRankingLoss`, its symmetric variant and their cached versions (whose loss
  stage is one of them), where the batch maps onto plain calls (:func:`~.objective.ranking.plain_calls`: no
  hardness weighting; query_to_doc, or both directions per direction);
- :class:`~.gist.GISTEmbedLoss` and :class:`~.gist.CachedGISTEmbedLoss` without ``contrast_positives``
  (:func:`~.objective.gist.prefixes_fuse`); the guide's embeddings stay whole, as sentence-transformers' loop
  leaves them (except where the plain GIST's guide is the model itself: their loop then truncates its
  embeddings too, so that case runs their loop).

``cal_inf_loss`` runs the plain prefixes (MNRL) in one tiled pass on the native kernel, the torch tiles and
Triton, and the GIST call (a guide and ids) in one pass on the same three; elsewhere (the chunked route) one
pass per prefix inside that one call (:mod:`infcl.matryoshka`, docs/options.md). Anything else (another wrapped
loss, GIST with ``contrast_positives``, hardness, joint multi-direction partitions) goes to
sentence-transformers' own per-dimension loop.

``n_dims_per_step`` draws the same dimensions as sentence-transformers' for the same ``random`` state (one
``random.sample`` per call, as theirs).
"""

import random
from typing import Any, Dict, Iterable, Sequence

from sentence_transformers.base.losses.gradcache import resolve_gradient_cache_loss, uses_gradient_cache
from sentence_transformers.sentence_transformer import losses as st_losses
from torch import Tensor, nn

from ..matryoshka import Matryoshka
from .gist import CachedGISTEmbedLoss, GISTEmbedLoss
from .losses import MultipleNegativesRankingLoss
from .mirror import mirrors
from .objective.gist import prefixes_fuse
from .objective.ranking import plain_calls

GIST_LOSSES = (GISTEmbedLoss, CachedGISTEmbedLoss)


def _objective_loss(loss: nn.Module):
    """The infcl loss whose ``matryoshka`` attribute its objective reads for ``loss``: an infcl ranking loss
    (itself, or a cached loss's ``.loss``) or an infcl GIST loss (itself, plain or cached); else None."""
    if isinstance(loss, GIST_LOSSES):
        return loss
    inner = resolve_gradient_cache_loss(loss).loss if uses_gradient_cache(loss) else loss
    return inner if isinstance(inner, MultipleNegativesRankingLoss) else None


def _fusable(objective: nn.Module, columns: int) -> bool:
    """Whether ``objective``'s loss of a batch of ``columns`` embedding columns takes the prefixes in its
    ``cal_inf_loss`` calls (module docstring)."""
    if isinstance(objective, GIST_LOSSES):
        return prefixes_fuse(objective.contrast_positives)
    docs = [None] * (columns - 1)
    return plain_calls(
        objective.directions, objective.partition_mode, objective.hardness_mode, objective.hardness_strength, docs
    )


class MatryoshkaLoss(st_losses.MatryoshkaLoss):
    """sentence-transformers' ``MatryoshkaLoss`` (the same arguments, loss and weights), fused where the wrapped
    loss is infcl's (module docstring)."""

    @mirrors(st_losses.MatryoshkaLoss, extras=())
    def __init__(self, arguments: Dict[str, Any]) -> None:
        super().__init__(**arguments)
        if _objective_loss(self.loss) is not None and self.uses_gradient_cache:
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
        objective = _objective_loss(self.loss)
        if self.uses_gradient_cache or objective is None:
            return super().forward(sentence_features, labels)
        features = list(sentence_features)
        # Their loop decorates the model's forward: a guide that is the model gets truncated embeddings too.
        guide_is_model = getattr(objective, "guide", None) is self.model
        if guide_is_model or not _fusable(objective, len(features)):
            return super().forward(features, labels)
        return _with_prefixes(objective, self._draw(), lambda: self.loss(features, labels))


def _with_prefixes(objective: nn.Module, prefixes: Matryoshka, run):
    """``run()`` with ``objective``'s ``cal_inf_loss`` calls taking ``prefixes``."""
    objective.matryoshka = prefixes
    try:
        return run()
    finally:
        objective.matryoshka = None


class _FusedLossStage:
    """A cached loss's ``calculate_loss`` under :class:`MatryoshkaLoss`: the fused stage where the batch fuses,
    else sentence-transformers' per-dimension loop (``loop``, its ``CachedLossDecorator``)."""

    def __init__(self, owner: MatryoshkaLoss, loop):
        self.owner, self.loop = owner, loop
        self.fn = loop.fn  # the cached loss's own calculate_loss

    def __call__(self, reps: Sequence[Sequence[Tensor]], *args, **kwargs) -> Tensor:
        objective = _objective_loss(self.owner.loss)
        if not _fusable(objective, len(reps)):
            return self.loop(reps, *args, **kwargs)
        return _with_prefixes(objective, self.owner._draw(), lambda: self.fn(reps, *args, **kwargs))
