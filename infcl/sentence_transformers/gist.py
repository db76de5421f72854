"""``GISTEmbedLoss`` and ``CachedGISTEmbedLoss`` with the loss computed by infcl.

Subclasses of sentence-transformers' classes: the constructor checks, the embedding passes (the
guide's re-tokenization when its vocabulary differs, the cached loss's mini-batches, RNG replay and
backward hook), ``get_config_dict`` and ``citation`` are theirs; the loss of the embeddings is
:func:`infcl.sentence_transformers.objective.gist_loss`: one ``cal_inf_loss`` whose guide mask is GIST's
false-negative rule, formed inside the tiles (no B x B similarity or guide matrix), and with
``gather_across_devices`` infcl's ring instead of an all_gather.
"""

from typing import Any, Dict, Iterable, List, Sequence

import torch
from sentence_transformers.base.losses.merged_forward import embed_columns
from sentence_transformers.sentence_transformer import losses as st_losses
from sentence_transformers.util import batch_to_device
from torch import Tensor

from .mirror import mirrors
from .objective import call_options, gist_loss, keep_options


def _loss_of(loss, embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor]) -> Tensor:
    """A GIST loss object's (plain or cached) loss of [anchors, positives, negatives...] embeddings."""
    return gist_loss(
        embeddings[0],
        embeddings[1:],
        guide_embeddings[0],
        guide_embeddings[1:],
        temperature=loss.temperature,
        margin_strategy=loss.margin_strategy,
        margin=loss.margin,
        contrast_anchors=loss.contrast_anchors,
        contrast_positives=loss.contrast_positives,
        matryoshka=getattr(loss, "matryoshka", None),  # set by infcl.sentence_transformers.MatryoshkaLoss
        **call_options(loss),
    )


class GISTEmbedLoss(st_losses.GISTEmbedLoss):
    """sentence-transformers' ``GISTEmbedLoss`` with the loss computed by infcl.

    The same arguments, loss and gradients: (anchor, positive) pairs or (anchor, positive, negative)
    triplets, the guide's absolute or relative margin, ``contrast_anchors`` / ``contrast_positives``,
    ``gather_across_devices`` (each rank gets sentence-transformers' per-rank loss and gradients; the
    anchor-anchor columns stay this rank's, as theirs). Extra keyword-only arguments:

        group: the process group to gather across (default: the world); only with
            ``gather_across_devices=True``.
        backend: ``cal_inf_loss``'s backend; the guide mask runs on the torch tiles ("auto" picks them).
    """

    @mirrors(st_losses.GISTEmbedLoss)
    def __init__(self, arguments: Dict[str, Any], group, backend: str) -> None:
        super().__init__(**arguments)
        keep_options(self, group, backend)

    def forward(self, sentence_features: Iterable[dict], labels: Any = None) -> Tensor:
        features = list(sentence_features)
        # The guide reads copies: a model writes its outputs into the features it is given.
        guide_features = [dict(f) for f in features]
        embeddings = embed_columns(self.model, features)
        if len(embeddings) not in (2, 3):
            raise ValueError(f"Expected 2 or 3 embeddings, got {len(embeddings)}")
        with torch.no_grad():
            if self.must_retokenize:
                guide_features = [self._retokenize(f) for f in features]
            guide_embeddings = embed_columns(self.guide, guide_features)
        return self.compute_loss_from_embeddings(embeddings, guide_embeddings)

    def _retokenize(self, features: dict) -> dict:
        """The guide's inputs for one column when its tokenizer differs: the model's tokens decoded to
        text (per sequence, also for flattened batches) and preprocessed by the guide."""
        input_ids = features["input_ids"]
        if "cu_seq_lens_q" in features:  # flattened: one row of concatenated sequences
            flat, bounds = input_ids[0].tolist(), features["cu_seq_lens_q"].tolist()
            input_ids = [flat[begin:end] for begin, end in zip(bounds[:-1], bounds[1:])]
        texts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        return batch_to_device(self.guide.preprocess(texts), self.guide.device)

    def compute_loss_from_embeddings(self, embeddings: Sequence[Tensor], guide_embeddings: Sequence[Tensor]) -> Tensor:
        """The loss of the model's [anchors, positives(, negatives)] embeddings ([B, D] each) and the
        guide's embeddings of the same columns ([B, D'] each)."""
        return _loss_of(self, embeddings, guide_embeddings)


class CachedGISTEmbedLoss(st_losses.CachedGISTEmbedLoss):
    """sentence-transformers' ``CachedGISTEmbedLoss`` with the loss stage computed by infcl.

    Their mini-batched embedding (``mini_batch_size`` or ``mini_batch_num_tokens``, the progress bar,
    RNG replay and the backward hook that re-embeds each mini-batch) with one ``cal_inf_loss`` over the
    whole batch as the loss stage (:func:`~infcl.sentence_transformers.objective.gist_loss`): no
    mini-batch x batch similarity or guide block is built, and ``gather_across_devices`` runs over
    infcl's ring. Any number of negative columns, as theirs. Extra keyword-only arguments ``group``
    and ``backend``, as for :class:`GISTEmbedLoss`.
    """

    @mirrors(st_losses.CachedGISTEmbedLoss)
    def __init__(self, arguments: Dict[str, Any], group, backend: str) -> None:
        super().__init__(**arguments)
        keep_options(self, group, backend)

    def calculate_loss(
        self, reps: List[List[Tensor]], reps_guided: List[List[Tensor]], *, with_backward: bool = False
    ) -> Tensor:
        """The loss of the whole batch from per-column lists of mini-batch embeddings (the model's and
        the guide's); with ``with_backward`` it is back-propagated to them (their ``.grad`` is the
        cache) and returned detached."""
        if len(reps) != len(reps_guided):
            raise ValueError("reps and reps_guided must have the same length")
        loss = _loss_of(self, [torch.cat(c) for c in reps], [torch.cat(c) for c in reps_guided])
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss
