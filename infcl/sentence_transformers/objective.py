"""sentence-transformers' MultipleNegativesRankingLoss objective, computed by ``cal_inf_loss``.

Their loss, for local anchors (queries) q_i, their positives p_i, every document d_j (the positive
column, then each hard-negative column) and every query q_j, with scale s and similarity sim:

    loss = mean_i [ log Z_i - s * sim(q_i, p_i) ]

    query_to_doc   Z_i over s * sim(q_i, d_j), every document j
    doc_to_query   Z_i over s * sim(p_i, q_j), every query j
    joint          one log-sum-exp over the union of the selected directions' terms
    per_direction  the mean of the selected directions' log-sum-exps

With ``gather_across_devices`` the documents and queries j are the whole world's, i only this
rank's. How each supported combination maps onto ``cal_inf_loss`` (labels: the global column of
row i's positive, i.e. this rank's first key row + i):

    (query_to_doc,)                        cal_inf_loss(q, cat(docs), labels)
    (query_to_doc, doc_to_query)
      per_direction, pairs                 cal_inf_loss(q, p, symmetric=True)
      per_direction, hard negatives        (cal_inf_loss(q, cat(docs), labels) + cal_inf_loss(p, q)) / 2
      joint                                cal_inf_loss([q | p], [[docs | 0]; [0 | q]], labels)

The joint row [q_i | p_i] (2D features) against the keys [d_j | 0] and [0 | q_j] has exactly the
dot products q_i·d_j and p_i·q_j, so one log-sum-exp covers both directions. With one direction,
joint and per_direction are the same loss.

Not supported (they raise ValueError): ``query_to_query`` and ``doc_to_doc``, which take single
entries out of the softmax (q_i with itself, d with its own query's documents) and cal_inf_loss
has no mask; ``hardness_mode`` with ``hardness_strength > 0``, which adds a per-entry term to the
logits; any ``similarity_fct`` other than cosine or dot product.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sentence_transformers import util
from sentence_transformers.util.similarity import SimilarityFunction

from ..api import cal_inf_loss

QUERY_TO_DOC, DOC_TO_QUERY = "query_to_doc", "doc_to_query"
SUPPORTED_DIRECTIONS = frozenset({QUERY_TO_DOC, DOC_TO_QUERY})
COSINE, DOT = "cosine", "dot"
SUPPORTED_SIMILARITIES = (
    "sentence_transformers.util.cos_sim, util.dot_score, or model.similarity with similarity_fn_name 'cosine' or 'dot'"
)


def similarity_kind(similarity_fct) -> str:
    """"cosine" or "dot" for the similarity functions the loss maps onto; ValueError otherwise."""
    owner = getattr(similarity_fct, "__self__", None)
    if getattr(similarity_fct, "__name__", None) == "similarity" and hasattr(owner, "similarity_fn_name"):
        # model.similarity dispatches on the model's similarity_fn_name at call time: resolve it now.
        similarity_fct = SimilarityFunction.to_similarity_fn(owner.similarity_fn_name)
    if similarity_fct is util.cos_sim or similarity_fct is util.pytorch_cos_sim:  # the latter calls the former
        return COSINE
    if similarity_fct is util.dot_score:
        return DOT
    raise ValueError(
        f"similarity_fct={util.similarity_fct_name(similarity_fct)} is not supported by infcl's losses; "
        f"supported: {SUPPORTED_SIMILARITIES} (or use sentence-transformers' own loss)"
    )


def check_supported(loss, group=None) -> None:
    """ValueError when ``loss``'s settings ask for something ``ranking_loss`` does not compute."""
    similarity_kind(loss.similarity_fct)
    extra = set(loss.directions) - SUPPORTED_DIRECTIONS
    if extra:
        raise ValueError(
            f"directions {sorted(extra)} are not supported by infcl's losses: they drop single entries from the "
            "softmax, and cal_inf_loss has no mask. Supported: ('query_to_doc',) and ('query_to_doc', "
            "'doc_to_query') with partition_mode 'joint' or 'per_direction'"
        )
    if loss.hardness_mode is not None and loss.hardness_strength > 0:
        raise ValueError(
            f"hardness_mode={loss.hardness_mode!r} with hardness_strength={loss.hardness_strength} is not supported "
            "by infcl's losses (it adds a per-entry penalty to the logits); use sentence-transformers' own loss"
        )
    if group is not None and not loss.gather_across_devices:
        raise ValueError("group is the process group to gather across: it needs gather_across_devices=True")


# The arguments of sentence-transformers' MultipleNegativesRankingLoss that define the objective: what the
# other classes' constructors hand on to it.
OBJECTIVE_ARGUMENTS = (
    "scale",
    "similarity_fct",
    "gather_across_devices",
    "directions",
    "partition_mode",
    "hardness_mode",
    "hardness_strength",
)
# What the deprecated symmetric classes fix: both directions, one log-sum-exp each.
SYMMETRIC_SETTINGS = {"directions": (QUERY_TO_DOC, DOC_TO_QUERY), "partition_mode": "per_direction"}


def objective_arguments(arguments: Mapping[str, Any]) -> Dict[str, Any]:
    """The :data:`OBJECTIVE_ARGUMENTS` among ``arguments`` (a constructor's ``locals()``), to hand on by
    keyword: one forwarding for every class, whatever subset of the objective its signature mirrors."""
    return {name: arguments[name] for name in OBJECTIVE_ARGUMENTS if name in arguments}


# ---- process groups --------------------------------------------------------------------------

_OWN_RANK_GROUPS = {}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def loss_group(gather_across_devices: bool, group):
    """The group ``cal_inf_loss`` rings over: ``group`` (None: the world) when gathering; without
    gathering, a group of this rank alone, since ``cal_inf_loss`` would ring over an initialized
    world by default."""
    if gather_across_devices:
        return group
    if not _distributed() or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if world not in _OWN_RANK_GROUPS:  # created once per process group; only this rank takes part
        _OWN_RANK_GROUPS[world] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _OWN_RANK_GROUPS[world]


def _rows_before(rows: int, group, device: torch.device) -> int:
    """How many key rows the ranks before this one in ``group`` hold (one all_gather of an int)."""
    if not _distributed():
        return 0
    ring = dist.group.WORLD if group is None else group
    world = dist.get_world_size(ring)
    if world == 1:
        return 0
    # A CPU tensor wherever the group has gloo (also 'cpu:gloo,cuda:nccl'); else the features' device.
    comm_device = torch.device("cpu") if "gloo" in str(dist.get_backend(ring)) else device
    sizes = [torch.zeros(1, dtype=torch.int64, device=comm_device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([rows], dtype=torch.int64, device=comm_device), group=ring)
    return int(sum(int(s) for s in sizes[: dist.get_rank(ring)]))


def _positive_columns(rows: torch.Tensor, keys: torch.Tensor, group) -> Optional[torch.Tensor]:
    """Global column of each row's positive, which is the local key row of the same index; None
    (the diagonal, which cal_inf_loss places itself) when there are as many keys as rows."""
    if keys.shape[0] == rows.shape[0]:
        return None
    offset = _rows_before(keys.shape[0], group, keys.device)
    return torch.arange(offset, offset + rows.shape[0], device=rows.device)


# ---- the loss ------------------------------------------------------------------------------


def _prepare(embeddings: torch.Tensor, similarity: str) -> torch.Tensor:
    # sentence-transformers' similarity functions compute in float32 for 16-bit inputs; so do we.
    if embeddings.dtype in (torch.float16, torch.bfloat16):
        embeddings = embeddings.float()
    return F.normalize(embeddings, p=2, dim=-1) if similarity == COSINE else embeddings


def ranking_loss(
    queries: torch.Tensor,
    docs: Sequence[torch.Tensor],
    *,
    scale,
    similarity: str,
    directions: Sequence[str],
    partition_mode: str,
    group=None,
    backend: str = "auto",
) -> torch.Tensor:
    """The local mean MultipleNegativesRankingLoss (module docstring), O(B·D) memory.

    Args:
        queries: [B, D] anchors of this rank.
        docs: [B, D] tensors: the positives, then each hard-negative column.
        scale: logit scale (float or 0-d tensor).
        similarity: "cosine" or "dot" (:func:`similarity_kind`).
        directions: a subset of ``SUPPORTED_DIRECTIONS`` containing "query_to_doc".
        partition_mode: "joint" or "per_direction".
        group: the process group to ring over (:func:`loss_group`), None for a single process.
        backend: ``cal_inf_loss``'s backend.
    """
    q = _prepare(queries, similarity)
    docs: List[torch.Tensor] = [_prepare(d, similarity) for d in docs]
    positives = docs[0]
    candidates = torch.cat(docs) if len(docs) > 1 else positives

    def loss(rows, keys, labels=None, symmetric=False):
        return cal_inf_loss(rows, keys, labels, scale, symmetric=symmetric, group=group, backend=backend)

    terms = set(directions)
    if terms == {QUERY_TO_DOC}:
        return loss(q, candidates, _positive_columns(q, candidates, group))
    if partition_mode == "per_direction":
        if len(docs) == 1:
            return loss(q, positives, symmetric=True)
        return (loss(q, candidates, _positive_columns(q, candidates, group)) + loss(positives, q)) / 2
    dim = q.shape[1]
    rows = torch.cat([q, positives], dim=1)
    keys = torch.cat([F.pad(candidates, (0, dim)), F.pad(q, (dim, 0))])
    return loss(rows, keys, _positive_columns(rows, keys, group))
