"""``CachedMultipleNegativesRankingLoss`` (and its symmetric variant) on infcl's GradCache phases.

sentence-transformers' cached loss returns a detached loss whose backward hook re-embeds the batch.
Ours keeps that contract, so it works inside ``SentenceTransformerTrainer`` (the trainer's backward,
its gradient-accumulation scaling and fp16 loss scale reach every mini-batch through the hook's
upstream gradient), with infcl's pieces doing the work:

1. :meth:`GradCache.forward_no_grad` embeds each column (anchors, positives, negatives...) mini-batch
   by mini-batch without a graph, recording each mini-batch's RNG state (:class:`RandContext`: the
   CPU's, the inputs' devices' and the model's devices').
2. ``calculate_loss`` (sentence-transformers' extension point, so ``MatryoshkaLoss`` can wrap it)
   computes the loss of the whole batch with ``cal_inf_loss`` and back-propagates it to the
   embeddings: their gradients are the cache. Memory O(B·D), however large the batch.
3. In the hook, :meth:`GradCache.forward_backward` re-embeds each mini-batch with its RNG replayed
   and back-propagates ``dot(embeddings, cache * upstream)``; under DDP / FSDP / FSDP2 gradients are
   reduced once, on the last mini-batch (``no_sync_except_last``).

The mini-batches are sentence-transformers' own (``mini_batch_size`` or ``mini_batch_num_tokens``,
trailing padding trimmed per mini-batch, flattened and VLM inputs split as theirs are), taken once
before any forward, so the model sees the same tensors, and dropout draws the same numbers, as in
their cached loss.
"""

from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Sequence

import torch
import tqdm
from sentence_transformers.base.losses.gradcache import _create_minibatch, _minibatch_ranges
from sentence_transformers.sentence_transformer import losses as st_losses
from torch import Tensor, nn

from ..gradcache import GradCache, RandContext
from ..gradcache.sync import sync_kind
from .losses import MultipleNegativesRankingLoss, warn_deprecated
from .mirror import mirrors
from .objective import SYMMETRIC_SETTINGS, objective_arguments


class SentenceTransformerGradCache(GradCache):
    """GradCache over a SentenceTransformer: one model input per column, feature dicts in,
    ``sentence_embedding`` out."""

    def __init__(self, model: nn.Module, columns: int, chunk_size: int, loss_fn: Callable[..., Tensor]):
        super().__init__([model] * columns, chunk_size, loss_fn, rep_field="sentence_embedding")

    def model_call(self, model: nn.Module, model_input: dict) -> Any:
        # SentenceTransformer.forward takes the dict positionally and writes its outputs
        # (token_embeddings, sentence_embedding) into it; a copy keeps them out of the mini-batch,
        # which lives until the replay.
        return model(dict(model_input))


class CachedMultipleNegativesRankingLoss(st_losses.CachedMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` with the loss computed by infcl.

    Same arguments, loss and gradients (and, with dropout, the same dropout masks under the same
    seed), with two differences in cost: the loss stage never builds a mini-batch x (world batch x
    (1 + negatives)) similarity block (``cal_inf_loss``, O(B·D)), and ``gather_across_devices=True``
    gathers nothing (infcl's ring). The supported options are :class:`MultipleNegativesRankingLoss`'s
    plus ``mini_batch_size``, ``mini_batch_num_tokens`` and ``show_progress_bar`` (a bar over the
    embedding mini-batches; the loss stage is one call, so it has none). The module docstring says
    how the three GradCache phases run. Extra keyword-only arguments: ``group`` and ``backend``, as
    for :class:`MultipleNegativesRankingLoss`.
    """

    @mirrors(st_losses.CachedMultipleNegativesRankingLoss)
    def __init__(self, arguments: Dict[str, Any], group, backend: str) -> None:
        super().__init__(**arguments)
        # As in sentence-transformers, the wrapped loss owns (and checks) the hyperparameters; the
        # properties and attribute delegation of the parent class now reach infcl's loss.
        objective = objective_arguments(arguments)
        self.loss = MultipleNegativesRankingLoss(arguments["model"], **objective, group=group, backend=backend)

    def calculate_loss(self, reps: List[List[Tensor]], labels: Any = None, *, with_backward: bool = False) -> Tensor:
        """The loss of the whole batch from per-column lists of mini-batch embeddings; with
        ``with_backward`` it is back-propagated to them and returned detached (their ``.grad`` is the
        cache). Labels are unused."""
        loss = self.loss.compute_loss_from_embeddings([_concatenated(column) for column in reps], labels)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def _mini_batches(self, features: dict) -> List[dict]:
        ranges = _minibatch_ranges(features, self.mini_batch_size, self.mini_batch_num_tokens)
        return [_create_minibatch(features, begin, end) for begin, end in ranges]

    def _progress(self, mini_batches: list):
        return tqdm.tqdm(mini_batches, desc="Embed mini-batches", disable=not self.show_progress_bar)

    def forward_cached(self, sentence_features: Iterable[dict], labels: Any = None) -> Tensor:
        """Phases 1 and 2 now; phase 3 in a hook on the returned loss (module docstring)."""
        features = list(sentence_features)
        grad_enabled = torch.is_grad_enabled()

        def whole_batch_loss(*columns):  # GradCache's loss_fn (what its cache_step would call)
            return self.calculate_loss([[column] for column in columns])

        grad_cache = SentenceTransformerGradCache(self.model, len(features), self.mini_batch_size, whole_batch_loss)
        # Boundaries first: modules may edit the features in place while embedding.
        mini_batches = [self._mini_batches(f) for f in features]
        reps, random_states = [], []
        for column in mini_batches:
            # Kept per mini-batch (calculate_loss's contract): the loss concatenates each column once, and
            # autograd splits its gradient back into the per-mini-batch cache.
            embeddings, states = grad_cache.forward_no_grad_chunks(self.model, self._progress(column))
            reps.append([e.requires_grad_(grad_enabled) for e in embeddings])
            random_states.append(states)
        if not grad_enabled:
            return self.calculate_loss(reps, labels)

        loss = self.calculate_loss(reps, labels, with_backward=True)
        cache = [[e.grad for e in column] for column in reps]
        unused = [str(i) for i, column in enumerate(cache) if any(g is None for g in column)]
        if unused:
            raise ValueError(
                f"The loss computation of {type(self).__name__} did not use input column(s) {', '.join(unused)}: "
                "their embeddings received no gradient; remove the unused column(s) from the dataset instead."
            )
        loss = loss.detach().requires_grad_()
        loss.register_hook(partial(self._replay, grad_cache, mini_batches, cache, random_states))
        return loss

    def _replay(
        self,
        grad_cache: SentenceTransformerGradCache,
        mini_batches: Sequence[list],
        cache: Sequence[List[Tensor]],
        random_states: Sequence[List[RandContext]],
        upstream: Tensor,
    ) -> None:
        """Phase 3, run by autograd when the returned loss is back-propagated with ``upstream``."""
        model = grad_cache.models[0]
        synced = sync_kind(model) is not None
        last = len(mini_batches) - 1
        for i, (column, grads, states) in enumerate(zip(mini_batches, cache, random_states)):
            grad_cache.forward_backward(
                model,
                self._progress(column),
                [g * upstream for g in grads],
                states,
                no_sync_except_last=synced,
                sync_last_chunk=i == last,
            )


def _concatenated(mini_batches: Sequence[Tensor]) -> Tensor:
    """A column's embeddings, [sum of rows, D], from its mini-batches (no copy for a single one)."""
    return mini_batches[0] if len(mini_batches) == 1 else torch.cat(mini_batches)


class CachedMultipleNegativesSymmetricRankingLoss(CachedMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultipleNegativesSymmetricRankingLoss`` (deprecated there, as
    here): :class:`CachedMultipleNegativesRankingLoss` with ``directions=("query_to_doc",
    "doc_to_query")`` and ``partition_mode="per_direction"``."""

    @mirrors(st_losses.CachedMultipleNegativesSymmetricRankingLoss)
    def __init__(self, arguments: Dict[str, Any], group, backend: str) -> None:
        warn_deprecated(type(self).__name__, "CachedMultipleNegativesRankingLoss")
        super().__init__(**arguments, **SYMMETRIC_SETTINGS, group=group, backend=backend)
