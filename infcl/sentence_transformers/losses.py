"""``MultipleNegativesRankingLoss`` and ``MultipleNegativesSymmetricRankingLoss`` on ``cal_inf_loss``.

Subclasses of sentence-transformers' classes: the embedding pass (``forward``), ``get_config_dict``,
``citation`` and the argument checks are theirs; only ``compute_loss_from_embeddings`` is ours.
"""

import warnings
from typing import Any, Dict, Sequence

from sentence_transformers.sentence_transformer import losses as st_losses
from torch import Tensor

from .mirror import mirrors
from .objective import SYMMETRIC_SETTINGS, call_options, check_supported, keep_options, ranking_loss, similarity_kind


class MultipleNegativesRankingLoss(st_losses.MultipleNegativesRankingLoss):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` with the loss computed by infcl.

    The same arguments, loss and gradients; the B x (world batch x (1 + negatives)) similarity
    matrix is never built (``cal_inf_loss`` works tile by tile, O(B·D) memory), and with
    ``gather_across_devices=True`` no rank gathers the others' embeddings: they travel around
    infcl's ring instead, and each rank gets exactly sentence-transformers' per-rank loss and
    gradients (the gradient of every rank's loss with respect to its own embeddings).

    Every option of sentence-transformers 6.3's class: (anchor, positive) pairs and (anchor,
    positive, negative_1, ..., negative_n) tuples; ``similarity_fct`` ``util.cos_sim``,
    ``util.dot_score`` or ``model.similarity`` resolving to either (any other raises ValueError, here
    or when the loss runs if the attribute is changed later); any ``scale``; ``directions`` in any
    combination with ``partition_mode`` ``"joint"`` or ``"per_direction"`` (where sentence-transformers
    allows it); ``hardness_mode`` / ``hardness_strength``. How each maps onto one ``cal_inf_loss``
    call (padded features, id and guide masks formed in the tiles):
    :mod:`infcl.sentence_transformers.objective`.

    Extra keyword-only arguments:
        group: the process group to gather across (default: the world); only with
            ``gather_across_devices=True``.
        backend: ``cal_inf_loss``'s backend ("auto", "torch", "cpu", "triton").
    """

    @mirrors(st_losses.MultipleNegativesRankingLoss)
    def __init__(self, arguments: Dict[str, Any], group, backend: str) -> None:
        super().__init__(**arguments)
        check_supported(self, group)
        keep_options(self, group, backend)

    def compute_loss_from_embeddings(self, embeddings: Sequence[Tensor], labels: Any = None) -> Tensor:
        """The loss of [anchors, positives, negatives...] embeddings ([B, D] each); labels are unused."""
        if len(embeddings) < 2:
            raise ValueError(f"Expected at least 2 embeddings, got {len(embeddings)}")
        check_supported(self, self.group)
        return ranking_loss(
            embeddings[0],
            embeddings[1:],
            scale=self.scale,
            similarity=similarity_kind(self.similarity_fct),
            directions=self.directions,
            partition_mode=self.partition_mode,
            hardness_mode=self.hardness_mode,
            hardness_strength=self.hardness_strength,
            matryoshka=getattr(self, "matryoshka", None),  # set by infcl.sentence_transformers.MatryoshkaLoss
            **call_options(self),
        )


def warn_deprecated(name: str, replacement: str) -> None:
    """The DeprecationWarning sentence-transformers gives for its symmetric loss classes."""
    warnings.warn(
        f"The {name} is deprecated and will be removed in a future release. Please use {replacement} with "
        "`directions=('query_to_doc', 'doc_to_query')` and `partition_mode='per_direction'` instead.",
        DeprecationWarning,
        stacklevel=4,  # past this function, the constructor's body and its mirror (mirror.mirrors): the caller
    )


class MultipleNegativesSymmetricRankingLoss(MultipleNegativesRankingLoss):
    """sentence-transformers' ``MultipleNegativesSymmetricRankingLoss`` (deprecated there, as here):
    :class:`MultipleNegativesRankingLoss` with ``directions=("query_to_doc", "doc_to_query")`` and
    ``partition_mode="per_direction"``, i.e. ``cal_inf_loss(..., symmetric=True)`` for pairs."""

    @mirrors(st_losses.MultipleNegativesSymmetricRankingLoss)
    def __init__(self, arguments: Dict[str, Any], group, backend: str) -> None:
        warn_deprecated(type(self).__name__, "MultipleNegativesRankingLoss")
        super().__init__(**arguments, **SYMMETRIC_SETTINGS, group=group, backend=backend)
