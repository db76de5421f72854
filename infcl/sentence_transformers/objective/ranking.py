"""sentence-transformers' MultipleNegativesRankingLoss objective: :func:`ranking_loss`, every direction,
partition and hardness option, as the cheapest exact ``cal_inf_loss`` call(s).

Each direction is a block of key columns read from :data:`DIRECTIONS` (the row segment its keys meet, the
columns it takes, which of the row's own entries it leaves out); the exclusions are ``cal_inf_loss``'s O(B)
ids. The math, and why each setting maps onto the call it does: docs/integrations.md, "How the objectives
map onto cal_inf_loss".
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ...api import cal_inf_loss
from ...modules import scale_gradient
from .features import KeyBlocks, prepare, segments
from .groups import global_rows, positive_columns

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
    matryoshka=None,
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
        matryoshka: ``cal_inf_loss``'s Matryoshka prefixes (infcl.sentence_transformers.MatryoshkaLoss), only
            where :func:`plain_calls` holds (else ValueError): the weighted sum of every prefix's loss.
    """
    if matryoshka is not None and not plain_calls(directions, partition_mode, hardness_mode, hardness_strength, docs):
        raise ValueError(
            "matryoshka prefixes fuse only into the plain MultipleNegativesRankingLoss calls (plain_calls)"
        )
    opts = {"group": group, "backend": backend, "matryoshka": matryoshka}
    q = prepare(queries, similarity)
    docs: List[torch.Tensor] = [prepare(d, similarity) for d in docs]
    positives = docs[0]
    hardness = _effective_hardness(hardness_mode, hardness_strength, len(docs) - 1)
    terms = set(directions)

    if partition_mode == "per_direction" and terms != {QUERY_TO_DOC}:
        if terms != {QUERY_TO_DOC, DOC_TO_QUERY}:
            raise ValueError(f"partition_mode='per_direction' takes query_to_doc and doc_to_query, got {directions}")
        if hardness is None and len(docs) == 1:
            return cal_inf_loss(q, positives, None, scale, symmetric=True, **opts)
        q2d = _joint_loss(q, docs, {QUERY_TO_DOC}, hardness, hardness_strength, scale, group, backend, matryoshka)
        return (q2d + cal_inf_loss(positives, q, None, scale, **opts)) / 2
    return _joint_loss(q, docs, terms, hardness, hardness_strength, scale, group, backend, matryoshka)


def plain_calls(directions, partition_mode: str, hardness_mode, hardness_strength: float, docs) -> bool:
    """Whether :func:`ranking_loss` is plain ``cal_inf_loss`` calls (no ids, no hardness) for these options and
    ``docs`` (the positives, then the negative columns): query_to_doc alone, or both of query_to_doc and
    doc_to_query per direction, without an effective hardness."""
    terms = set(directions)
    if _effective_hardness(hardness_mode, hardness_strength, len(docs) - 1) is not None:
        return False
    return terms == {QUERY_TO_DOC} or (partition_mode == "per_direction" and terms == {QUERY_TO_DOC, DOC_TO_QUERY})


def _joint_loss(q, docs, terms, hardness, alpha, scale, group, backend, matryoshka=None) -> torch.Tensor:
    """One softmax over the selected directions' terms, on prepared features: the cheapest exact call."""
    if hardness is None and terms <= {QUERY_TO_DOC, DOC_TO_QUERY}:  # no ids: the plain loss, any backend
        if terms == {QUERY_TO_DOC}:
            candidates = torch.cat(docs) if len(docs) > 1 else docs[0]
            labels = positive_columns(q, candidates, group)
            return cal_inf_loss(q, candidates, labels, scale, group=group, backend=backend, matryoshka=matryoshka)
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


def _padded_loss(q, docs, terms, hardness, alpha, scale, group, backend) -> torch.Tensor:
    """One call whose rows are x_i = [q_i | p_i | stop_grad(q_i)] (segments present only when a direction or the
    hardness reads them) and whose keys are each direction's columns in its segment (docs/integrations.md)."""
    b, dim = q.shape
    positives, negatives = docs[0], docs[1:]
    penalized = hardness in IN_BATCH_HARDNESS
    wide = any(direction.segment == DOC_SEGMENT for _, direction in _selected(terms))
    widths = [dim, dim if wide else 0, dim if penalized else 0]
    penalty = alpha / float(scale) if penalized else 0.0
    first_row, owner = global_rows(b, group, q.device)
    keys = KeyBlocks(owner)
    for _, direction in _selected(terms):
        for index, column in enumerate(_columns(direction, q, docs)):
            parts = [None, None, None]
            parts[direction.segment] = column
            if penalized and direction.penalized:
                parts[PENALTY_SEGMENT] = penalty * column.detach()
            keys.add(segments(parts, widths), own_excluded=direction.excludes_own(index, hardness))
    rows = segments([q, positives if wide else None, q.detach() if penalized else None], widths)
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
    first_row, owner = global_rows(q.shape[0], group, q.device)
    row_losses = []
    for segment, rows in ((QUERY_SEGMENT, q), (DOC_SEGMENT, docs[0])):
        keys = KeyBlocks(owner)
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
        first_row, owner = global_rows(q.shape[0], group, q.device)
        keys = KeyBlocks(owner)
        for index, column in enumerate(docs):
            keys.add(column, own_excluded=index > 0)
        key_feats, ids, labels = keys.build(first_row)
    else:
        key_feats = torch.cat(docs) if negatives else positives
        labels, ids = positive_columns(q, key_feats, group), {}
    rows = cal_inf_loss(q, key_feats, labels, boosted, reduction="none", group=group, backend=backend, **ids)
    rows = scale_gradient(rows, s / boosted)
    with torch.no_grad():
        positive_penalty = alpha * (q * positives).sum(dim=1)
    parts = [torch.zeros_like(rows), _others_than_positive(rows, positive_penalty)]
    if own_apart:  # the own negatives' unpenalized logits relative to the positive's, [B, negatives]
        parts += (s * torch.einsum("bd,bnd->bn", q, torch.stack(negatives, dim=1) - positives.unsqueeze(1))).unbind(1)
    return torch.logsumexp(torch.stack(parts, dim=1), dim=1).mean()
