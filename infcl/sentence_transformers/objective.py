"""sentence-transformers' MultipleNegativesRankingLoss and GISTEmbedLoss objectives, computed by ``cal_inf_loss``.

MultipleNegativesRankingLoss, for local anchors (queries) q_i, their positives p_i, every document d_j
(the positive column, then each hard-negative column; owner(j) is the query it belongs to), every
query q_j, scale s, similarity sim and hardness strength alpha:

    loss = mean_i [ log Z_i - s * sim(q_i, p_i) ]

    query_to_doc    s * sim(q_i, d_j) (+ alpha * stop_grad(sim(q_i, d_j)) on the hardness-selected entries)
    query_to_query  s * sim(q_i, q_j), j != i
    doc_to_query    s * sim(p_i, q_j), every j
    doc_to_doc      s * sim(p_i, d_j), owner(j) != i
    joint           Z_i: one sum over the union of the selected directions' terms
    per_direction   log Z_i: the mean of the selected directions' log-sum-exps (query_to_doc, doc_to_query)

Hardness (the entries of query_to_doc that get the penalty): "in_batch_negatives" owner(j) != i;
"hard_negatives" the row's own hard negatives; "all_negatives" every entry but the positive. With
``gather_across_devices`` the documents and queries j are the whole world's, i only this rank's.

**One call over padded features.** Every direction becomes a block of key columns of one
``cal_inf_loss`` call whose rows are x_i = [q_i | p_i] (2D wide): query_to_doc keys [d_j | 0],
query_to_query [q_j | 0], doc_to_query [0 | q_j], doc_to_doc [0 | d_j], so x_i · key_j is exactly the
term above and the call's single softmax is the joint partition. The entries left out are
``cal_inf_loss``'s id exclusions (O(B), inside the tiles): q_ids = owner (the global row index),
k_ids = owner(j) for the columns whose own entries must go (query_to_query, doc_to_doc), a unique
negative id for the columns that must stay (doc_to_query, whose own entry p_i·q_i is a term). Only
directions that read p_i widen the rows. Without query_to_query, doc_to_doc and hardness no id is
needed: query_to_doc alone is cal_inf_loss(q, cat(docs), labels), and with doc_to_query the same
padded rows against [docs | 0] and [0 | q] (the plain loss, every backend). Without hardness, doc_to_query
with a same-type direction runs unpadded as two calls (query rows, document rows) whose labels both hold
the positive's logit, merged by logaddexp (``_query_and_doc_rows_loss``).

**Hardness** (logit s * sim + alpha * stop_grad(sim)) without a new kernel. query_to_doc alone (the usual
setting, and per_direction's first half) with in-batch hardness needs no padding: the tiles run at scale
s + alpha on the plain features, the row losses' gradient is scaled by s / (s + alpha), and the positive's
penalty is taken back out of each row's loss in O(B) (``_boosted_query_to_doc_loss``). With more directions:

- In-batch entries (in_batch_negatives, all_negatives): the rows get a third segment stop_grad(q_i)
  and the query_to_doc keys (alpha / s) * stop_grad(d_j), so the tile's logit is the penalized one and
  only s * sim carries a gradient. The row's own documents must not carry it (in_batch_negatives) or
  not on the positive (both): they are excluded by id (k_ids = owner), and the positive comes back as
  an extra block of unpenalized copies [p_j | 0 | 0] holding the label, which a width-1 guide (1 on
  these columns, 0 elsewhere, absolute margin 1/2) excludes from every row but its own (a label is
  never excluded).
- Each row's own hard negatives (all modes, when hardness is on and there are negatives): excluded by
  id and added back outside the tiles, where their (penalized or not) logits are O(B * negatives):
  loss_i = logaddexp(lse_tiles_i, logsumexp_k own_ik) - pos_i, with lse_tiles_i = the call's row loss
  (reduction "none") + pos_i.

Cost: the row (and key) width is D, 2D when a direction reads p_i (doc_to_query, doc_to_doc), + D
for in-batch hardness; the keys are blocks of B columns: one per document column (query_to_doc), one
for query_to_query, one for doc_to_query, one per document column for doc_to_doc, one of unpenalized
positives for in-batch hardness. The calls with ids or a guide run on the torch tiles. Memory stays
O(B * D): nothing B x B is built.

per_direction (only query_to_doc and doc_to_query, as upstream allows): (the query_to_doc loss above,
hardness included, + cal_inf_loss(p, q)) / 2; for pairs without hardness, ``cal_inf_loss(q, p,
symmetric=True)``.

**GISTEmbedLoss** (anchors a_i, positives p_i, negatives n_j, guide features g*, temperature t; all
cosine; only the candidates are gathered across devices, the anchors are not):
rows [a_i | p_i], keys ap [p_j | 0], an [n_j | 0], aa [a_j | 0] (contrast_anchors; this rank's anchors
only), pp [0 | p_j] (contrast_positives), scale 1 / t; the guide features padded the same way, so
G[i, label] = sim(ga_i, gp_i) and ``cal_inf_loss``'s guide rule (absolute) is GIST's. GIST's relative
threshold g - |g| * margin is the absolute rule on guide rows divided by |g_i|. Under a ring, the
other ranks' anchor columns are excluded by extra guide dimensions (rank one-hots, a large value
against the other ranks' aa columns).
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sentence_transformers import util
from sentence_transformers.util.similarity import SimilarityFunction

from ..api import cal_inf_loss
from ..modules import scale_gradient

QUERY_TO_DOC, QUERY_TO_QUERY, DOC_TO_QUERY, DOC_TO_DOC = "query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"
HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")
COSINE, DOT = "cosine", "dot"
SUPPORTED_SIMILARITIES = (
    "sentence_transformers.util.cos_sim, util.dot_score, or model.similarity with similarity_fn_name 'cosine' or 'dot'"
)
# The width-1 guide that keeps each unpenalized positive copy for its own row only scores 1 on those
# columns and 0 elsewhere; with this absolute margin the threshold, 1/2, lies halfway between.
COPY_GUIDE_MARGIN = 0.5
# GIST's relative rule divides each guide row by |g_i|; rows with |g_i| below this (a guide positive
# similarity of exactly zero) keep a finite scale (their threshold is then -margin instead of 0).
MIN_GUIDE_POSITIVE = 1e-12


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
    """ValueError when ``loss``'s settings ask for something ``ranking_loss`` does not compute (the
    directions, partition and hardness options are sentence-transformers' to check)."""
    similarity_kind(loss.similarity_fct)
    check_group(loss.gather_across_devices, group)


def check_group(gather_across_devices: bool, group) -> None:
    if group is not None and not gather_across_devices:
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


# What a mirrored constructor's ``locals()`` holds beside sentence-transformers' keyword arguments: the
# instance, the zero-argument super() cell, the positional models, and infcl's keyword-only extras.
NOT_FORWARDED = ("self", "__class__", "model", "guide", "group", "backend")


def mirrored_arguments(arguments: Mapping[str, Any]) -> Dict[str, Any]:
    """Every sentence-transformers keyword argument among ``arguments`` (a constructor's ``locals()`` whose
    signature mirrors theirs), to hand on to their constructor by keyword."""
    return {name: value for name, value in arguments.items() if name not in NOT_FORWARDED}


def keep_options(loss, group, backend) -> None:
    """Check and keep infcl's keyword-only constructor arguments on ``loss`` (after sentence-transformers'
    constructor, which sets ``gather_across_devices``)."""
    check_group(loss.gather_across_devices, group)
    loss.group, loss.backend = group, backend


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


def _ring(group):
    """(world size, this rank) of the group ``cal_inf_loss`` rings over; (1, 0) for a single process."""
    if not _distributed():
        return 1, 0
    ring = dist.group.WORLD if group is None else group
    return dist.get_world_size(ring), dist.get_rank(ring)


def _rows_before(rows: int, group, device: torch.device) -> int:
    """How many rows the ranks before this one in ``group`` hold (one all_gather of an int)."""
    world, rank = _ring(group)
    if world == 1:
        return 0
    ring = dist.group.WORLD if group is None else group
    # A CPU tensor wherever the group has gloo (also 'cpu:gloo,cuda:nccl'); else the features' device.
    comm_device = torch.device("cpu") if "gloo" in str(dist.get_backend(ring)) else device
    sizes = [torch.zeros(1, dtype=torch.int64, device=comm_device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([rows], dtype=torch.int64, device=comm_device), group=ring)
    return int(sum(int(s) for s in sizes[:rank]))


def _positive_columns(rows: torch.Tensor, keys: torch.Tensor, group) -> Optional[torch.Tensor]:
    """Global column of each row's positive, which is the local key row of the same index; None
    (the diagonal, which cal_inf_loss places itself) when there are as many keys as rows."""
    if keys.shape[0] == rows.shape[0]:
        return None
    offset = _rows_before(keys.shape[0], group, keys.device)
    return torch.arange(offset, offset + rows.shape[0], device=rows.device)


# ---- padded features -------------------------------------------------------------------------


def _prepare(embeddings: torch.Tensor, similarity: str) -> torch.Tensor:
    # sentence-transformers' similarity functions compute in float32 for 16-bit inputs; so do we.
    if embeddings.dtype in (torch.float16, torch.bfloat16):
        embeddings = embeddings.float()
    return F.normalize(embeddings, p=2, dim=-1) if similarity == COSINE else embeddings


def _segments(parts: Sequence[Optional[torch.Tensor]], widths: Sequence[int]) -> torch.Tensor:
    """[B, sum(widths)]: the parts side by side, zeros where a part is None."""
    rows = next(p for p in parts if p is not None)
    return torch.cat(
        [p if p is not None else rows.new_zeros(rows.shape[0], w) for p, w in zip(parts, widths)], dim=1
    )


class _Keys:
    """The key columns of one padded call: blocks of B columns each (B: this rank's rows), with their ids
    and a per-block guide value (module docstring).

    Ids: the owner (the global index of the query a column belongs to) excludes the row's own entries;
    a unique negative id (no row has one) keeps every entry.
    """

    def __init__(self, owner: torch.Tensor):
        self.owner = owner  # [B] global row indices of this rank
        self.blocks: List[torch.Tensor] = []
        self.own_excluded: List[bool] = []
        self.guide_values: List[float] = []

    def add(self, feats: torch.Tensor, own_excluded: bool, guide_value: float = 0.0) -> int:
        """Append a block of B columns; return its first local column."""
        self.blocks.append(feats)
        self.own_excluded.append(own_excluded)
        self.guide_values.append(guide_value)
        return (len(self.blocks) - 1) * self.owner.shape[0]

    def first_key(self, first_row: int) -> int:
        """This rank's first global key column: every rank holds the same blocks of its own B rows."""
        return first_row * len(self.blocks)

    def build(self, first_row: int):
        """(keys [blocks * B, width], k_ids [blocks * B], guide [blocks * B, 1])."""
        b = self.owner.shape[0]
        unique = -(1 + self.first_key(first_row) + torch.arange(b * len(self.blocks), device=self.owner.device))
        ids = [self.owner if own else unique[i * b : (i + 1) * b] for i, own in enumerate(self.own_excluded)]
        guide = torch.cat([self.blocks[0].new_full((b, 1), value) for value in self.guide_values])
        return torch.cat(self.blocks), torch.cat(ids), guide


def _effective_hardness(hardness_mode, hardness_strength: float, negatives: int):
    """The hardness mode that changes the loss (None when it has no effect: no mode, no strength, or
    hard_negatives without negatives)."""
    if hardness_mode is None or not hardness_strength > 0:
        return None
    if hardness_mode == "hard_negatives" and negatives == 0:
        return None
    return hardness_mode


def ranking_loss(
    queries: torch.Tensor,
    docs: Sequence[torch.Tensor],
    *,
    scale,
    similarity: str,
    directions: Sequence[str],
    partition_mode: str,
    hardness_mode: Optional[str] = None,
    hardness_strength: float = 0.0,
    group=None,
    backend: str = "auto",
) -> torch.Tensor:
    """The local mean MultipleNegativesRankingLoss (module docstring), O(B·D) memory.

    Args:
        queries: [B, D] anchors of this rank.
        docs: [B, D] tensors: the positives, then each hard-negative column.
        scale: logit scale (float or 0-d tensor; with hardness, a constant: the penalty is alpha / scale
            times the keys).
        similarity: "cosine" or "dot" (:func:`similarity_kind`).
        directions: sentence-transformers' directions (containing "query_to_doc").
        partition_mode: "joint" or "per_direction" (with query_to_doc and doc_to_query only).
        hardness_mode, hardness_strength: sentence-transformers' hardness weighting.
        group: the process group to ring over (:func:`loss_group`), None for a single process.
        backend: ``cal_inf_loss``'s backend (the ids and guide of the padded call run on "torch").
    """
    q = _prepare(queries, similarity)
    docs: List[torch.Tensor] = [_prepare(d, similarity) for d in docs]
    positives = docs[0]
    hardness = _effective_hardness(hardness_mode, hardness_strength, len(docs) - 1)
    terms = set(directions)

    def loss(rows, keys, labels=None, symmetric=False):
        return cal_inf_loss(rows, keys, labels, scale, symmetric=symmetric, group=group, backend=backend)

    if partition_mode == "per_direction" and terms != {QUERY_TO_DOC}:
        if terms != {QUERY_TO_DOC, DOC_TO_QUERY}:
            raise ValueError(f"partition_mode='per_direction' takes query_to_doc and doc_to_query, got {directions}")
        if hardness is None and len(docs) == 1:
            return loss(q, positives, symmetric=True)
        q2d = _joint_loss(q, docs, {QUERY_TO_DOC}, hardness, hardness_strength, scale, group, backend)
        return (q2d + loss(positives, q)) / 2
    return _joint_loss(q, docs, terms, hardness, hardness_strength, scale, group, backend)


def _joint_loss(q, docs, terms, hardness, alpha, scale, group, backend) -> torch.Tensor:
    """One softmax over the selected directions' terms (module docstring), on prepared features."""
    positives, negatives = docs[0], docs[1:]
    candidates = torch.cat(docs) if negatives else positives
    if hardness is None and terms <= {QUERY_TO_DOC, DOC_TO_QUERY}:  # no ids: the plain loss, any backend
        if terms == {QUERY_TO_DOC}:
            return cal_inf_loss(q, candidates, _positive_columns(q, candidates, group), scale, group=group,
                                backend=backend)
        dim = q.shape[1]
        rows = torch.cat([q, positives], dim=1)
        keys = torch.cat([F.pad(candidates, (0, dim)), F.pad(q, (dim, 0))])
        return cal_inf_loss(rows, keys, _positive_columns(rows, keys, group), scale, group=group, backend=backend)

    if terms == {QUERY_TO_DOC} and hardness in ("in_batch_negatives", "all_negatives"):
        return _boosted_query_to_doc_loss(q, docs, hardness, alpha, scale, group, backend)
    if hardness is None and DOC_TO_QUERY in terms:
        return _query_and_doc_rows_loss(q, docs, terms, scale, group, backend)

    b, dim = q.shape
    penalize_in_batch = hardness in ("in_batch_negatives", "all_negatives")
    own_negatives_apart = hardness is not None and bool(negatives)
    wide = bool(terms & {DOC_TO_QUERY, DOC_TO_DOC})
    widths = [dim, dim if wide else 0, dim if penalize_in_batch else 0]
    alpha_over_scale = alpha / float(scale) if penalize_in_batch else 0.0

    def left(x):  # a key in the query segment
        return _segments([x, None, None], widths)

    def right(x):  # a key in the positive segment
        return _segments([None, x, None], widths)

    def penalized(x):  # a query_to_doc key whose entries carry alpha * stop_grad(sim)
        return _segments([x, None, alpha_over_scale * x.detach()], widths)

    rows = _segments([q, positives if wide else None, q.detach() if penalize_in_batch else None], widths)
    first_row = _rows_before(b, group, q.device)
    keys = _Keys(torch.arange(first_row, first_row + b, device=q.device))
    if penalize_in_batch:  # the unpenalized positives hold the labels; the guide keeps each for its own row
        label_block = keys.add(left(positives), own_excluded=False, guide_value=1.0)
        keys.add(penalized(positives), own_excluded=True)
    else:
        label_block = keys.add(left(positives), own_excluded=True)
    for negative in negatives:
        keys.add(penalized(negative) if penalize_in_batch else left(negative), own_excluded=own_negatives_apart)
    if QUERY_TO_QUERY in terms:
        keys.add(left(q), own_excluded=True)
    if DOC_TO_QUERY in terms:
        keys.add(right(q), own_excluded=False)
    if DOC_TO_DOC in terms:
        for doc in docs:
            keys.add(right(doc), own_excluded=True)
    key_feats, k_ids, key_guide = keys.build(first_row)
    labels = keys.first_key(first_row) + label_block + torch.arange(b, device=q.device)
    options = {}
    if penalize_in_batch:
        options = dict(guide=(q.new_ones(b, 1), key_guide), guide_margin=COPY_GUIDE_MARGIN)
    reduction = "none" if own_negatives_apart else "mean"
    row_loss = cal_inf_loss(rows, key_feats, labels, scale, reduction=reduction, q_ids=keys.owner, k_ids=k_ids,
                            group=group, backend=backend, **options)
    if not own_negatives_apart:
        return row_loss
    # The row's own hard negatives, left out of the tiles by id: merged here, O(B * negatives).
    positive_logit = scale * (q * positives).sum(dim=1)
    own = torch.stack([(q * negative).sum(dim=1) for negative in negatives], dim=1)  # [B, negatives]
    own_logits = scale * own + (alpha * own.detach() if hardness in ("hard_negatives", "all_negatives") else 0.0)
    lse = torch.logaddexp(row_loss + positive_logit, torch.logsumexp(own_logits, dim=1))
    return (lse - positive_logit).mean()


def _query_and_doc_rows_loss(q, docs, terms, scale, group, backend) -> torch.Tensor:
    """The joint partition of query_to_doc, doc_to_query and any of query_to_query, doc_to_doc, without hardness,
    as two calls of width D instead of one padded to 2D (module docstring).

    The query rows q_i take the query_to_doc and query_to_query columns, the document rows p_i the doc_to_query
    and doc_to_doc ones. Each call's label is an entry with the positive's logit, s * sim(q_i, p_i): the
    query_to_doc positive in the first, the doc_to_query entry p_i . q_i (one of its terms) in the second. Their
    row losses r = lse - positive therefore merge into the joint one: loss_i = logaddexp(r_query_i, r_doc_i).
    """
    b = q.shape[0]
    first_row = _rows_before(b, group, q.device)
    owner = torch.arange(first_row, first_row + b, device=q.device)
    query_keys, doc_keys = _Keys(owner), _Keys(owner)
    query_label = query_keys.add(docs[0], own_excluded=False)
    for negative in docs[1:]:
        query_keys.add(negative, own_excluded=False)
    if QUERY_TO_QUERY in terms:
        query_keys.add(q, own_excluded=True)
    doc_label = doc_keys.add(q, own_excluded=False)
    if DOC_TO_DOC in terms:
        for doc in docs:
            doc_keys.add(doc, own_excluded=True)
    row_losses = []
    for rows, keys, label_block in ((q, query_keys, query_label), (docs[0], doc_keys, doc_label)):
        key_feats, k_ids, _ = keys.build(first_row)
        labels = keys.first_key(first_row) + label_block + torch.arange(b, device=q.device)
        masks = dict(q_ids=owner, k_ids=k_ids) if any(keys.own_excluded) else {}
        row_losses.append(cal_inf_loss(rows, key_feats, labels, scale, reduction="none", group=group,
                                       backend=backend, **masks))
    return torch.logaddexp(*row_losses).mean()


def _boosted_query_to_doc_loss(q, docs, hardness, alpha, scale, group, backend) -> torch.Tensor:
    """query_to_doc alone with in-batch hardness (module docstring), at width D on the plain tiles.

    The tiles run at scale s + alpha: every entry's logit is the penalized one, s * sim + alpha * stop_grad(sim),
    and the gradient of the row losses r_i is scaled by s / (s + alpha), so each entry's gradient is that of
    s * sim. Only the row's positive should not carry the penalty: its tile logit is L_pos + c_i with
    c_i = alpha * stop_grad(pos_i). With N_i the log-sum-exp of the row's other tile entries,
    r_i = log(1 + exp(N_i - L_pos - c_i)), so N_i - L_pos = c_i + log(expm1(r_i)) (r_i keeps its relative
    digits however small: numerics.md), and loss_i = log(1 + exp(N_i - L_pos) + sum_k exp(o_ik)) where o_ik are
    the row's own hard negatives' unpenalized logits minus L_pos, kept out of the tiles by id for
    "in_batch_negatives" (for "all_negatives" they are penalized like every other entry and stay in the tiles).
    """
    s = float(scale)
    boosted = s + alpha
    positives, negatives = docs[0], docs[1:]
    own_apart = hardness == "in_batch_negatives" and bool(negatives)
    if own_apart:
        first_row = _rows_before(q.shape[0], group, q.device)
        keys = _Keys(torch.arange(first_row, first_row + q.shape[0], device=q.device))
        label_block = keys.add(positives, own_excluded=False)
        for negative in negatives:
            keys.add(negative, own_excluded=True)
        key_feats, k_ids, _ = keys.build(first_row)
        labels = keys.first_key(first_row) + label_block + torch.arange(q.shape[0], device=q.device)
        masks = dict(q_ids=keys.owner, k_ids=k_ids)
    else:
        key_feats = torch.cat(docs) if negatives else positives
        labels, masks = _positive_columns(q, key_feats, group), {}
    rows = cal_inf_loss(q, key_feats, labels, boosted, reduction="none", group=group, backend=backend, **masks)
    rows = scale_gradient(rows, s / boosted)
    positive_sim = (q * positives).sum(dim=1)
    # log(expm1(r)) is -inf at r = 0 (every other entry underflowed), where its derivative is not finite.
    others = torch.where(rows > 0, torch.log(torch.expm1(torch.where(rows > 0, rows, 1.0))), float("-inf"))
    parts = [torch.zeros_like(others), alpha * positive_sim.detach() + others]
    if own_apart:
        parts += [s * ((q * negative).sum(dim=1) - positive_sim) for negative in negatives]
    return torch.logsumexp(torch.stack(parts, dim=1), dim=1).mean()


def gist_loss(
    anchors: torch.Tensor,
    candidates: Sequence[torch.Tensor],
    guide_anchors: torch.Tensor,
    guide_candidates: Sequence[torch.Tensor],
    *,
    temperature: float,
    margin_strategy: str,
    margin: float,
    contrast_anchors: bool,
    contrast_positives: bool,
    group=None,
    backend: str = "auto",
) -> torch.Tensor:
    """The local mean GISTEmbedLoss (module docstring), O(B·D) memory.

    Args:
        anchors: [B, D] this rank's anchors (the model's embeddings).
        candidates: [B, D] tensors: the positives, then each negative column.
        guide_anchors, guide_candidates: the guide model's embeddings of the same columns ([B, D'] each).
        temperature: the scores are cosine similarities / temperature.
        margin_strategy, margin: GIST's false-negative rule: a candidate j is left out of row i when
            sim(ga_i, gc_j) > g_i - margin ("absolute") or > g_i - |g_i| * margin ("relative"),
            g_i = sim(ga_i, gp_i), except row i's own positive.
        contrast_anchors, contrast_positives: add the anchor-anchor (this rank's anchors only) and
            positive-positive (every rank's positives) columns.
        group: the process group to ring over (:func:`loss_group`), None for a single process.
        backend: ``cal_inf_loss``'s backend (the guide runs on "torch").
    """
    a = _prepare(anchors, COSINE)
    docs = [_prepare(c, COSINE) for c in candidates]
    ga = _prepare(guide_anchors.detach(), COSINE)
    gdocs = [_prepare(c.detach(), COSINE) for c in guide_candidates]
    positives, gp = docs[0], gdocs[0]
    b, dim = a.shape
    gdim = ga.shape[1]
    widths, gwidths = [dim, dim if contrast_positives else 0], [gdim, gdim if contrast_positives else 0]
    world, rank = _ring(group)
    extra = world if (contrast_anchors and world > 1) else 0  # rank one-hots that keep aa columns local

    def block(x, gx, segment, local_only=False):
        parts, gparts = [None, None], [None, None]
        parts[segment], gparts[segment] = x, gx
        tag = gx.new_zeros(b, extra)
        if local_only and extra:
            tag[:, rank] = 1.0
        return _segments(parts, widths), torch.cat([_segments(gparts, gwidths), tag], dim=1)

    blocks = [block(positives, gp, 0)] + [block(n, gn, 0) for n, gn in zip(docs[1:], gdocs[1:])]
    if contrast_anchors:
        blocks.append(block(a, ga, 0, local_only=True))
    if contrast_positives:
        blocks.append(block(positives, gp, 1))
    keys = torch.cat([k for k, _ in blocks])
    guide_keys = torch.cat([g for _, g in blocks])
    rows = _segments([a, positives if contrast_positives else None], widths)
    guide_rows = _segments([ga, gp if contrast_positives else None], gwidths)
    row_scale = None
    if margin_strategy == "relative":
        # g - |g| * margin is the absolute rule on G / |g|: divide each guide row by |g_i|.
        row_scale = 1.0 / (ga * gp).sum(dim=1, keepdim=True).abs().clamp_min(MIN_GUIDE_POSITIVE)
        guide_rows = guide_rows * row_scale
    if extra:
        # Against another rank's aa columns, a value above any threshold: |G_ij| <= scale_i (unit
        # features), the threshold at most scale_i + |margin|.
        bound = row_scale if row_scale is not None else guide_rows.new_ones(b, 1)
        far = 2.0 * bound + abs(margin) + 1.0
        tag = far.expand(b, extra).clone()
        tag[:, rank] = 0.0
        guide_rows = torch.cat([guide_rows, tag], dim=1)
    first_row = _rows_before(b, group, a.device)
    labels = torch.arange(b, device=a.device) + first_row * len(blocks)  # the ap block leads every rank's keys
    return cal_inf_loss(
        rows, keys, labels, 1.0 / temperature, guide=(guide_rows, guide_keys), guide_margin=margin,
        guide_margin_strategy="absolute", group=group, backend=backend,
    )
