"""sentence-transformers' MultipleNegativesRankingLoss and GISTEmbedLoss objectives, computed by ``cal_inf_loss``.

:func:`ranking_loss` (every direction, partition and hardness option) and :func:`gist_loss` take embeddings
and give the local mean loss, O(B·D) memory: nothing B x B is built. Each direction is a block of key
columns read from :data:`DIRECTIONS` (the row segment its keys meet, the columns it takes, which of the
row's own entries it leaves out); the exclusions are ``cal_inf_loss``'s O(B) ids. The math, and why each
setting maps onto the call it does: docs/integrations.md, "How the objectives map onto cal_inf_loss".
"""

from dataclasses import dataclass
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
# The hardness modes that penalize the in-batch entries (other rows' documents), not only the own negatives.
IN_BATCH_HARDNESS = ("in_batch_negatives", "all_negatives")
# The modes whose penalty reaches the row's own hard negatives.
OWN_NEGATIVE_HARDNESS = ("hard_negatives", "all_negatives")

# Segments of a padded row x_i = [q_i | p_i | stop_grad(q_i)]: a key placed in segment s meets that part only.
QUERY_SEGMENT, DOC_SEGMENT, PENALTY_SEGMENT = 0, 1, 2
# The columns a direction takes: every document column (positives, then each negative column), or the queries.
DOCS, QUERIES = "docs", "queries"
# Which of row i's own entries (owner(j) == i) a direction leaves out of the softmax. The label (the row's
# positive) is never left out.
KEEP_OWN = "keep own"  # every entry is a term (doc_to_query: p_i . q_i is one)
EXCLUDE_OWN = "exclude own"  # same-type directions: q_i . q_i, p_i . d_i are not terms
OWN_NEGATIVES_APART = "own negatives apart"  # under hardness the own negatives leave the tiles (added back outside)


@dataclass(frozen=True)
class Direction:
    """One of sentence-transformers' directions as key blocks of one ``cal_inf_loss`` call."""

    segment: int  # the row segment the keys meet: QUERY_SEGMENT (rows q_i) or DOC_SEGMENT (rows p_i)
    columns: str  # DOCS or QUERIES
    own: str  # KEEP_OWN, EXCLUDE_OWN or OWN_NEGATIVES_APART
    penalized: bool = False  # in-batch hardness adds alpha * stop_grad(sim) to its entries

    def excludes_own(self, column: int, hardness) -> bool:
        """Whether the row's own entries of document column ``column`` (0: the positives) leave the softmax."""
        if self.own == OWN_NEGATIVES_APART:
            return hardness is not None and column > 0
        return self.own == EXCLUDE_OWN


# The table the loops read, in key-block order: query_to_doc's positives lead (its first block holds the labels).
DIRECTIONS = {
    QUERY_TO_DOC: Direction(QUERY_SEGMENT, DOCS, OWN_NEGATIVES_APART, penalized=True),
    QUERY_TO_QUERY: Direction(QUERY_SEGMENT, QUERIES, EXCLUDE_OWN),
    DOC_TO_QUERY: Direction(DOC_SEGMENT, QUERIES, KEEP_OWN),
    DOC_TO_DOC: Direction(DOC_SEGMENT, DOCS, EXCLUDE_OWN),
}
COSINE, DOT = "cosine", "dot"
SUPPORTED_SIMILARITIES = (
    "sentence_transformers.util.cos_sim, util.dot_score, or model.similarity with similarity_fn_name 'cosine' or 'dot'"
)
# GIST's relative rule divides each guide row by |g_i|; rows with |g_i| below this (a guide positive
# similarity of exactly zero) keep a finite scale (their threshold is then -margin instead of 0).
MIN_GUIDE_POSITIVE = 1e-12


def similarity_kind(similarity_fct) -> str:
    """ "cosine" or "dot" for the similarity functions the loss maps onto; ValueError otherwise."""
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
    return torch.cat([p if p is not None else rows.new_zeros(rows.shape[0], w) for p, w in zip(parts, widths)], dim=1)


class _Keys:
    """The key columns of one call: blocks of B columns each (B: this rank's rows), with their ids.

    Ids: the owner (the global index of the query a column belongs to) excludes the row's own entries;
    a unique negative id (no row has one) keeps every entry.
    """

    def __init__(self, owner: torch.Tensor):
        self.owner = owner  # [B] global row indices of this rank
        self.blocks: List[torch.Tensor] = []
        self.own_excluded: List[bool] = []

    def add(self, feats: torch.Tensor, own_excluded: bool) -> None:
        self.blocks.append(feats)
        self.own_excluded.append(own_excluded)

    def first_key(self, first_row: int) -> int:
        """This rank's first global key column: every rank holds the same blocks of its own B rows."""
        return first_row * len(self.blocks)

    def build(self, first_row: int):
        """(keys [blocks * B, width], the ids ``cal_inf_loss`` takes (q_ids, k_ids; none when no block excludes),
        the labels [B]: the diagonal of the first block, which holds each row's positive)."""
        b = self.owner.shape[0]
        labels = self.first_key(first_row) + torch.arange(b, device=self.owner.device)
        if not any(self.own_excluded):
            return torch.cat(self.blocks), {}, labels
        unique = -(1 + self.first_key(first_row) + torch.arange(b * len(self.blocks), device=self.owner.device))
        ids = [self.owner if own else unique[i * b : (i + 1) * b] for i, own in enumerate(self.own_excluded)]
        return torch.cat(self.blocks), dict(q_ids=self.owner, k_ids=torch.cat(ids)), labels


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
    """The local mean MultipleNegativesRankingLoss (docs/integrations.md), O(B·D) memory.

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
        backend: ``cal_inf_loss``'s backend.
    """
    q = _prepare(queries, similarity)
    docs: List[torch.Tensor] = [_prepare(d, similarity) for d in docs]
    positives = docs[0]
    hardness = _effective_hardness(hardness_mode, hardness_strength, len(docs) - 1)
    terms = set(directions)

    if partition_mode == "per_direction" and terms != {QUERY_TO_DOC}:
        if terms != {QUERY_TO_DOC, DOC_TO_QUERY}:
            raise ValueError(f"partition_mode='per_direction' takes query_to_doc and doc_to_query, got {directions}")
        if hardness is None and len(docs) == 1:
            return cal_inf_loss(q, positives, None, scale, symmetric=True, group=group, backend=backend)
        q2d = _joint_loss(q, docs, {QUERY_TO_DOC}, hardness, hardness_strength, scale, group, backend)
        return (q2d + cal_inf_loss(positives, q, None, scale, group=group, backend=backend)) / 2
    return _joint_loss(q, docs, terms, hardness, hardness_strength, scale, group, backend)


def _joint_loss(q, docs, terms, hardness, alpha, scale, group, backend) -> torch.Tensor:
    """One softmax over the selected directions' terms, on prepared features: the cheapest exact call."""
    if hardness is None and terms <= {QUERY_TO_DOC, DOC_TO_QUERY}:  # no ids: the plain loss, any backend
        if terms == {QUERY_TO_DOC}:
            candidates = torch.cat(docs) if len(docs) > 1 else docs[0]
            return cal_inf_loss(
                q, candidates, _positive_columns(q, candidates, group), scale, group=group, backend=backend
            )
        return _padded_loss(q, docs, terms, None, alpha, scale, group, backend)
    if terms == {QUERY_TO_DOC} and hardness in IN_BATCH_HARDNESS:
        return _boosted_query_to_doc_loss(q, docs, hardness, alpha, scale, group, backend)
    if hardness is None and DOC_TO_QUERY in terms:  # with a same-type direction: two calls of width D
        return _query_and_doc_rows_loss(q, docs, terms, scale, group, backend)
    return _padded_loss(q, docs, terms, hardness, alpha, scale, group, backend)


def _selected(terms):
    """(name, Direction) of the selected directions, in the table's (key-block) order."""
    return [(name, direction) for name, direction in DIRECTIONS.items() if name in terms]


def _columns(direction: Direction, q: torch.Tensor, docs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    return docs if direction.columns == DOCS else (q,)


def _owner(b: int, group, device: torch.device):
    """(the global index of this rank's first row, the global index of each row [B])."""
    first_row = _rows_before(b, group, device)
    return first_row, torch.arange(first_row, first_row + b, device=device)


def _padded_loss(q, docs, terms, hardness, alpha, scale, group, backend) -> torch.Tensor:
    """One call whose rows are x_i = [q_i | p_i | stop_grad(q_i)] (segments present only when a direction or the
    hardness reads them) and whose keys are each direction's columns in its segment (docs/integrations.md)."""
    b, dim = q.shape
    positives, negatives = docs[0], docs[1:]
    penalized = hardness in IN_BATCH_HARDNESS
    wide = any(direction.segment == DOC_SEGMENT for _, direction in _selected(terms))
    widths = [dim, dim if wide else 0, dim if penalized else 0]
    penalty = alpha / float(scale) if penalized else 0.0
    first_row, owner = _owner(b, group, q.device)
    keys = _Keys(owner)
    for _, direction in _selected(terms):
        for index, column in enumerate(_columns(direction, q, docs)):
            parts = [None, None, None]
            parts[direction.segment] = column
            if penalized and direction.penalized:
                parts[PENALTY_SEGMENT] = penalty * column.detach()
            keys.add(_segments(parts, widths), own_excluded=direction.excludes_own(index, hardness))
    rows = _segments([q, positives if wide else None, q.detach() if penalized else None], widths)
    key_feats, ids, labels = keys.build(first_row)
    if hardness is None:
        return cal_inf_loss(rows, key_feats, labels, scale, group=group, backend=backend, **ids)
    row_loss = cal_inf_loss(rows, key_feats, labels, scale, reduction="none", group=group, backend=backend, **ids)
    positive_sim = (q * positives).sum(dim=1)
    own = [(q * negative).sum(dim=1) for negative in negatives]  # the own negatives, left out of the tiles
    own_logits = [scale * o + (alpha * o.detach() if hardness in OWN_NEGATIVE_HARDNESS else 0.0) for o in own]
    if not penalized:
        positive_logit = scale * positive_sim
        lse = torch.logaddexp(row_loss + positive_logit, torch.logsumexp(torch.stack(own_logits, dim=1), dim=1))
        return (lse - positive_logit).mean()
    # The label carries the penalty too: take it back out (docs/integrations.md, "Hardness").
    others = _others_than_positive(row_loss, alpha * positive_sim.detach())
    parts = [torch.zeros_like(others), others] + [o - scale * positive_sim for o in own_logits]
    return torch.logsumexp(torch.stack(parts, dim=1), dim=1).mean()


def _others_than_positive(row_loss: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """log-sum-exp of a row's tile entries other than its positive, relative to the positive's unpenalized
    logit, from a row loss r_i = lse_i - (positive logit + ``penalty``): penalty + log(expm1(r_i)), exact where
    the tiles keep a confident row's small r_i to full relative precision (numerics.md)."""
    # log(expm1(r)) is -inf at r = 0 (every other entry underflowed), where its derivative is not finite.
    safe = torch.where(row_loss > 0, row_loss, 1.0)
    return torch.where(row_loss > 0, torch.log(torch.expm1(safe)), float("-inf")) + penalty


def _query_and_doc_rows_loss(q, docs, terms, scale, group, backend) -> torch.Tensor:
    """The joint partition of query_to_doc, doc_to_query and any of query_to_query, doc_to_doc, without hardness,
    as two calls of width D instead of one padded to 2D (docs/integrations.md, "Query rows and document rows").

    The query rows q_i take the directions of the query segment, the document rows p_i those of the document
    segment. Each call's label, its first block's diagonal, holds the positive's logit, s * sim(q_i, p_i): the
    query_to_doc positive in the first, the doc_to_query entry p_i . q_i in the second. Their row losses
    r = lse - positive therefore merge into the joint one: loss_i = logaddexp(r_query_i, r_doc_i).
    """
    first_row, owner = _owner(q.shape[0], group, q.device)
    row_losses = []
    for segment, rows in ((QUERY_SEGMENT, q), (DOC_SEGMENT, docs[0])):
        keys = _Keys(owner)
        for _, direction in _selected(terms):
            if direction.segment == segment:
                for index, column in enumerate(_columns(direction, q, docs)):
                    keys.add(column, own_excluded=direction.excludes_own(index, None))
        key_feats, ids, labels = keys.build(first_row)
        row_losses.append(
            cal_inf_loss(rows, key_feats, labels, scale, reduction="none", group=group, backend=backend, **ids)
        )
    return torch.logaddexp(*row_losses).mean()


def _boosted_query_to_doc_loss(q, docs, hardness, alpha, scale, group, backend) -> torch.Tensor:
    """query_to_doc alone with in-batch hardness, at width D on the plain tiles (docs/integrations.md, "Hardness").

    The tiles run at scale s + alpha, so every entry's logit is the penalized one, s * sim + alpha * stop_grad(sim),
    and the gradient of the row losses is scaled by s / (s + alpha), so each entry's gradient is that of s * sim.
    The positive's penalty is taken back out (:func:`_others_than_positive`); for "in_batch_negatives" the row's
    own hard negatives, unpenalized, leave the tiles by id and are added back here.
    """
    s = float(scale)
    boosted = s + alpha
    positives, negatives = docs[0], docs[1:]
    # The tiles penalize every entry: the own negatives leave them where their logit is the unpenalized one.
    own_apart = hardness not in OWN_NEGATIVE_HARDNESS and bool(negatives)
    if own_apart:
        first_row, owner = _owner(q.shape[0], group, q.device)
        keys = _Keys(owner)
        for index, column in enumerate(docs):
            keys.add(column, own_excluded=index > 0)
        key_feats, ids, labels = keys.build(first_row)
    else:
        key_feats = torch.cat(docs) if negatives else positives
        labels, ids = _positive_columns(q, key_feats, group), {}
    rows = cal_inf_loss(q, key_feats, labels, boosted, reduction="none", group=group, backend=backend, **ids)
    rows = scale_gradient(rows, s / boosted)
    with torch.no_grad():
        positive_penalty = alpha * (q * positives).sum(dim=1)
    parts = [torch.zeros_like(rows), _others_than_positive(rows, positive_penalty)]
    if own_apart:  # the own negatives' unpenalized logits relative to the positive's, [B, negatives]
        parts += (s * torch.einsum("bd,bnd->bn", q, torch.stack(negatives, dim=1) - positives.unsqueeze(1))).unbind(1)
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
        rows,
        keys,
        labels,
        1.0 / temperature,
        guide=(guide_rows, guide_keys),
        guide_margin=margin,
        guide_margin_strategy="absolute",
        group=group,
        backend=backend,
    )
