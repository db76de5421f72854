"""``MultiVectorMultipleNegativesRankingLoss`` and ``CachedMultiVectorMultipleNegativesRankingLoss`` on
``cal_maxsim_loss``.

Subclasses of sentence-transformers' multi-vector classes: the embedding passes (the cached loss's mini-batches,
their RNG replay and its backward hook included), ``get_config_dict`` and ``citation`` are theirs; the scores and
the loss are :func:`infcl.cal_maxsim_loss`'s: never the [B, B * N, Lq, Ld] token scores nor the [B, B * N] scores,
and with ``gather_across_devices=True`` the documents travel around infcl's ring instead of being gathered.
"""

from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from sentence_transformers.base.losses.merged_forward import embed_columns_padded
from sentence_transformers.multi_vector_encoder import losses as st_losses
from sentence_transformers.multi_vector_encoder.scoring import colbert_scores, mean_colbert_scores
from sentence_transformers.util import cat_padded_token_embeddings, stack_padded_token_embeddings
from torch import Tensor

from ..maxsim import cal_maxsim_loss
from .mirror import mirrors
from .objective import keep_options

# model.similarity_fn_name -> length_normalize
MODEL_SIMILARITIES = {"maxsim": False, "meanmaxsim": True}


def _length_normalize(loss) -> bool:
    """Whether the loss scores MeanMaxSim (True) or MaxSim (False): ``similarity_fct`` None (the model's similarity),
    ``colbert_scores`` or ``mean_colbert_scores``; another scorer (XTR, say) raises ValueError."""
    fct = loss.similarity_fct
    if fct is None:
        name = str(getattr(loss.model.similarity_fn_name, "value", loss.model.similarity_fn_name))
        if name not in MODEL_SIMILARITIES:
            raise ValueError(
                f"{type(loss).__name__} runs MaxSim or MeanMaxSim models; model.similarity_fn_name is {name!r}"
            )
        return MODEL_SIMILARITIES[name]
    if fct is colbert_scores:
        return False
    if fct is mean_colbert_scores:
        return True
    raise ValueError(
        f"{type(loss).__name__} computes colbert_scores or mean_colbert_scores (or the model's similarity); got "
        f"similarity_fct={fct!r}: use sentence-transformers' own class for other scorers"
    )


def maxsim_ranking_loss(loss, queries: Tensor, query_mask: Tensor, doc_columns: List[Tensor], doc_masks: List[Tensor]):
    """The mean in-batch ranking loss of queries [B, Lq, D] against the documents of every column (each [B, T_c, D]),
    in sentence-transformers' query-major layout: query i's positive is document i of the first column."""
    docs, docs_mask = stack_padded_token_embeddings(doc_columns, doc_masks)  # [B, N, T, D]
    batch, columns = docs.shape[:2]
    docs, docs_mask = docs.flatten(0, 1), docs_mask.flatten(0, 1)
    labels = torch.arange(batch, device=queries.device) * columns
    group = "local"
    if loss.gather_across_devices:
        group = loss.group
        labels = labels + _docs_before_this_rank(docs.shape[0], group, docs.device)
    return cal_maxsim_loss(
        queries,
        docs,
        labels,
        loss.scale,
        q_mask=query_mask,
        docs_mask=docs_mask,
        length_normalize=_length_normalize(loss),
        group=group,
        backend=loss.backend,
    )


def _docs_before_this_rank(count: int, group, device) -> int:
    """The global index of this rank's first document: the document counts of the lower ranks (uneven ones too)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    world = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([count], dtype=torch.int64, device=device), group=group)
    return int(sum(c.item() for c in counts[: dist.get_rank(group)]))


class MultiVectorMultipleNegativesRankingLoss(st_losses.MultiVectorMultipleNegativesRankingLoss):
    """sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss`` with the loss computed by infcl.

    The same arguments, loss and gradients (within float32 rounding); the scores are computed tile by tile by
    :func:`infcl.cal_maxsim_loss`, so ``score_mini_batch_size`` bounds nothing more (it is accepted and kept).
    Scorers: the model's similarity (``"maxsim"`` or ``"meanmaxsim"``), ``colbert_scores`` or
    ``mean_colbert_scores``; another ``similarity_fct`` raises ValueError when the loss runs. A document with no
    real token scores -inf here (sentence-transformers: -1e9): it is no negative, and a query whose positive it is
    gets an infinite loss.

    Extra keyword-only arguments:
        group: the process group to ring over (default: the world); only with ``gather_across_devices=True``.
        backend: ``cal_maxsim_loss``'s backend ("auto", "torch", "cpu").
    """

    @mirrors(st_losses.MultiVectorMultipleNegativesRankingLoss)
    def __init__(self, arguments: Dict[str, Any], group, backend: str) -> None:
        super().__init__(**arguments)
        keep_options(self, group, backend)

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Optional[Tensor] = None) -> Tensor:
        """The loss of [queries, positives, negatives...] feature dicts; labels are unused (as upstream's)."""
        features = [dict(f) for f in sentence_features]
        query = features[0]
        outputs = self.model(query, task=query.get("task", "query"))
        doc_columns, doc_masks = embed_columns_padded(
            self.model, features[1:], self.mini_batch_size, task_default="document"
        )
        return maxsim_ranking_loss(
            self, outputs["token_embeddings"], outputs["attention_mask"].bool(), doc_columns, doc_masks
        )


class CachedMultiVectorMultipleNegativesRankingLoss(st_losses.CachedMultiVectorMultipleNegativesRankingLoss):
    """sentence-transformers' ``CachedMultiVectorMultipleNegativesRankingLoss`` with the loss computed by infcl.

    Upstream's GradCache phases run as they are (mini-batches embedded without a graph, the token embeddings'
    gradients cached, each mini-batch embedded again with its RNG replayed); the cached loss is
    :func:`infcl.cal_maxsim_loss` over the whole batch at once (``score_mini_batch_size`` is accepted and kept, but
    the loss's memory is bounded by its tiles). Scorers and the empty-document rule as
    :class:`MultiVectorMultipleNegativesRankingLoss`; ``group`` and ``backend`` likewise.
    """

    @mirrors(st_losses.CachedMultiVectorMultipleNegativesRankingLoss)
    def __init__(self, arguments: Dict[str, Any], group, backend: str) -> None:
        super().__init__(**arguments)
        keep_options(self, group, backend)

    def calculate_loss(
        self, reps: List[List[Tensor]], masks_chunks: List[List[Tensor]], *, with_backward: bool = False
    ) -> Tensor:
        """The mean loss of the cached mini-batch embeddings (``reps[column][mini-batch]`` [b, T, D], their masks
        alike); with ``with_backward``, back-propagated to them (their ``.grad`` is the cache) and detached."""
        catted = [cat_padded_token_embeddings(r, m) for r, m in zip(reps, masks_chunks)]
        (queries, query_mask), docs = catted[0], catted[1:]
        loss = maxsim_ranking_loss(self, queries, query_mask, [e for e, _ in docs], [m for _, m in docs])
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss
