"""sentence-transformers' GISTEmbedLoss objective: :func:`gist_loss`, one ``cal_inf_loss`` call whose guide
mask is GIST's false-negative rule, formed inside the tiles (no B x B similarity or guide matrix).

The rows are [anchor | positive] (the positive segment only with ``contrast_positives``), the guide's rows
likewise; the keys are blocks of columns in order: the positives (whose diagonal holds the labels), each
negative column, the anchors (``contrast_anchors``) and the positives against the positive segment
(``contrast_positives``). Across ranks, the anchor-anchor columns stay this rank's: one guide tag column per
rank puts every other rank's anchors above any threshold. A row's own anchor and own positive in those two
blocks are never its negatives (sentence-transformers 6.3), whatever the guide says: ids (each row's global
index, and the same index on its anchor-anchor and positive-positive columns) leave them out.
docs/integrations.md has the math.

Matryoshka prefixes (``matryoshka=``, set by infcl.sentence_transformers.MatryoshkaLoss) fuse into that one call
where the rows are the anchors alone (:func:`prefixes_fuse`: no ``contrast_positives``): every key block then
holds one column of embeddings at width D, so a prefix of the features is a prefix of each embedding. The guide
is never truncated, as under sentence-transformers' MatryoshkaLoss, which shrinks the model's embeddings only.
"""

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch

from ...api import cal_inf_loss
from .features import COSINE, prepare, segments
from .groups import global_rows, world_and_rank

# The id of a column that is no row's own anchor or positive (the row ids are global indices, >= 0).
NOT_OWN = -1

# GIST's relative rule divides each guide row by |g_i|; rows with |g_i| below this (a guide positive
# similarity of exactly zero) keep a finite scale (their threshold is then -margin instead of 0).
MIN_GUIDE_POSITIVE = 1e-12


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
    matryoshka=None,
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
            positive-positive (every rank's positives) columns, each row's own anchor / positive left out.
        group: the process group to ring over (:func:`~.groups.loss_group`), None for a single process.
        backend: ``cal_inf_loss``'s backend (the guide runs on "torch").
        matryoshka: ``cal_inf_loss``'s Matryoshka prefixes of the model's embeddings (the guide's stay whole),
            only where :func:`prefixes_fuse` holds (else ValueError): the weighted sum of every prefix's loss.
    """
    if matryoshka is not None and not prefixes_fuse(contrast_positives):
        raise ValueError(
            "matryoshka prefixes fuse into GISTEmbedLoss's call only without contrast_positives (prefixes_fuse)"
        )
    a = prepare(anchors, COSINE)
    docs = [prepare(c, COSINE) for c in candidates]
    ga = prepare(guide_anchors.detach(), COSINE)
    gdocs = [prepare(c.detach(), COSINE) for c in guide_candidates]
    positives, gp = docs[0], gdocs[0]
    world, rank = world_and_rank(group)
    layout = _Layout(
        widths=(a.shape[1], a.shape[1] if contrast_positives else 0),
        guide_widths=(ga.shape[1], ga.shape[1] if contrast_positives else 0),
        tags=world if (contrast_anchors and world > 1) else 0,
        rank=rank,
    )
    first_row, row_ids = global_rows(a.shape[0], group, a.device)
    not_own = torch.full_like(row_ids, NOT_OWN)
    blocks = [(*layout.block(d, gd, 0), not_own) for d, gd in zip(docs, gdocs)]
    if contrast_anchors:
        blocks.append((*layout.block(a, ga, 0, local_only=True), row_ids))
    if contrast_positives:
        blocks.append((*layout.block(positives, gp, 1), row_ids))
    rows = layout.rows(a, positives)
    guide_rows = _guide_rows(ga, gp, layout, margin_strategy, margin)
    # The anchor-positive block leads every rank's keys: its diagonal holds the labels.
    labels = torch.arange(a.shape[0], device=a.device) + first_row * len(blocks)
    return cal_inf_loss(
        rows,
        torch.cat([k for k, _, _ in blocks]),
        labels,
        1.0 / temperature,
        q_ids=row_ids,
        k_ids=torch.cat([ids for _, _, ids in blocks]),
        guide=(guide_rows, torch.cat([g for _, g, _ in blocks])),
        guide_margin=margin,
        guide_margin_strategy="absolute",
        group=group,
        backend=backend,
        matryoshka=matryoshka,
    )


def prefixes_fuse(contrast_positives: bool) -> bool:
    """Whether :func:`gist_loss` takes Matryoshka prefixes in its one call: without ``contrast_positives``. With
    it the rows are [a_i | p_i], each segment renormalized by its own prefix norm under sentence-transformers'
    MatryoshkaLoss, while a fused prefix has one norm per row."""
    return not contrast_positives


@dataclass(frozen=True)
class _Layout:
    """Where each part of GIST's padded features sits: the model's segments [anchor | positive], the guide's,
    and the guide's rank tags (one column per rank with ``contrast_anchors`` across ranks; 0: none)."""

    widths: Tuple[int, int]
    guide_widths: Tuple[int, int]
    tags: int
    rank: int

    def rows(self, x: torch.Tensor, positive: torch.Tensor, guide: bool = False) -> torch.Tensor:
        """The rows [x | positive], the model's (or the guide's): the positive segment where the layout has one."""
        widths = self.guide_widths if guide else self.widths
        return segments([x, positive if widths[1] else None], widths)

    def block(self, x: torch.Tensor, gx: torch.Tensor, segment: int, local_only: bool = False):
        """(keys, guide keys) of one block of columns: ``x`` (the guide's ``gx``) in ``segment``; ``local_only``:
        tagged as this rank's (the anchor-anchor columns)."""
        parts, gparts = [None, None], [None, None]
        parts[segment], gparts[segment] = x, gx
        tag = gx.new_zeros(gx.shape[0], self.tags)
        if local_only and self.tags:
            tag[:, self.rank] = 1.0
        return segments(parts, self.widths), torch.cat([segments(gparts, self.guide_widths), tag], dim=1)


def _guide_rows(
    ga: torch.Tensor, gp: torch.Tensor, layout: _Layout, margin_strategy: str, margin: float
) -> torch.Tensor:
    """The guide's rows [ga | gp] for the absolute rule ``cal_inf_loss`` applies: divided by |g_i| for the
    relative one, and with a value above any threshold against other ranks' anchor-anchor columns."""
    b = ga.shape[0]
    guide_rows = layout.rows(ga, gp, guide=True)
    row_scale = None
    if margin_strategy == "relative":
        # g - |g| * margin is the absolute rule on G / |g|: divide each guide row by |g_i|.
        row_scale = 1.0 / (ga * gp).sum(dim=1, keepdim=True).abs().clamp_min(MIN_GUIDE_POSITIVE)
        guide_rows = guide_rows * row_scale
    if layout.tags:
        # Against another rank's aa columns, a value above any threshold: |G_ij| <= scale_i (unit
        # features), the threshold at most scale_i + |margin|.
        bound = row_scale if row_scale is not None else guide_rows.new_ones(b, 1)
        far = 2.0 * bound + abs(margin) + 1.0
        tag = far.expand(b, layout.tags).clone()
        tag[:, layout.rank] = 0.0
        guide_rows = torch.cat([guide_rows, tag], dim=1)
    return guide_rows
