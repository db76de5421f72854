"""Which columns are a row's positives and which are left out of its softmax: ids, multiple positives, a guide.

For row i and global column j, with ``same(i, j) = q_ids[i] == k_ids[j]`` (the same item, or the same class):

- Positives P(i): ``{labels[i]}`` when ``multi_positive`` is None (the diagonal when labels are None),
  else ``{j : same(i, j)}``.
- Excluded E(i), left out of the softmax denominator: ``{j not in P(i) : same(i, j)}`` (the false
  negatives) and, with a guide (gq, gk) and G = gq @ gk.T (another model's scores, no gradient),
  ``{j not in P(i) : G[i, j] > t_i}`` with the threshold t_i = G[i, labels[i]] - margin ("absolute") or
  G[i, labels[i]] * (1 - margin) ("relative"): sentence-transformers' GISTEmbedLoss rule (GIST's relative
  form is G - |G| * margin, the same where G[i, labels[i]] >= 0; infcl.sentence_transformers' GIST classes
  get it exactly as the "absolute" rule on guide rows divided by |G[i, labels[i]]|).
- Row loss, with lse_i over the columns not in E(i): ``None``: lse_i - S[i, labels[i]]; ``"mean"``:
  the mean over p in P(i) of lse_i - S[i, p] (SupCon's L_out); ``"sum"``: lse_i - logsumexp_{p in P(i)}
  S[i, p] (MIL-NCE). A row with no positive (possible under "mean"/"sum") has no loss: it is NaN under
  reduction="none" and left out of the "mean" reduction's count.
- Symmetric: the same with q and k (their ids, gq and gk) exchanged; column j's threshold uses the row
  whose label is j (labels are a permutation).

Everything here is O(B): ids and guide features travel with their rows, and every backend that supports
these options forms P and E inside its tiles. The options are one value, :class:`MaskOptions`
(:mod:`infcl.contract`), from the API to the kernels' launch (``Block.masks``).
"""

from typing import Tuple

import torch

from .contract import MaskOptions as MaskOptions  # re-exported: defined on the ground floor, in Block
from .lse import MAX, REL, empty_stats, lse_merge

Tensor = torch.Tensor

MULTI_POSITIVE = (None, "mean", "sum")
# Rows of a backend's masked forward result ([6, n], rows and columns alike; the loss layer reads it as
# infcl.losses.softmax.MaskedPartials): the stats over the columns not excluded (MAX, REL of infcl.lse),
# the positives' max and log-sum relative to it (only "sum" fills POS_REL), the sum of the positives'
# logits and their number.
POS_MAX, POS_REL, POS_SUM, POS_COUNT = 2, 3, 4, 5
MASKED_ROWS = 6
# With Block.kept_sums (label smoothing's uniform part, infcl.losses.smoothing) two more rows: the sum of the
# logits over the columns not excluded and their number.
KEPT_SUM, KEPT_COUNT = 6, 7
KEPT_ROWS = 8
MARGIN_STRATEGIES = ("absolute", "relative")


def guide_threshold(positive_score: Tensor, margin: float, strategy: str) -> Tensor:
    """t = G[i, labels[i]] - margin ("absolute") or G[i, labels[i]] * (1 - margin) ("relative")."""
    if strategy == "absolute":
        return positive_score - margin
    return positive_score * (1.0 - margin)


def guide_dtype(guide: Tensor) -> torch.dtype:
    """Guide scores are computed in float64 for float64 guides, in float32 otherwise (like the logits)."""
    return torch.float64 if guide.dtype == torch.float64 else torch.float32


def empty_masked(n: int, dtype: torch.dtype, device: torch.device, kept_sums: bool = False) -> Tensor:
    """``[6, n]`` masked forward partials of n empty sets (the identity of :func:`merge_masked`); ``[8, n]`` with
    ``kept_sums`` (the kept logits' sum and number, 0)."""
    sums = torch.zeros(4 if kept_sums else 2, n, dtype=dtype, device=device)
    return torch.cat((empty_stats(n, dtype, device), empty_stats(n, dtype, device), sums))


def masked_fields(packed: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Views (stats [2, n], the positives' stats [2, n], their logits' sum [n], their count [n]) of a packed
    ``[6, n]`` masked forward result: the fields of :class:`infcl.losses.softmax.MaskedPartials`."""
    return packed[MAX : REL + 1], packed[POS_MAX : POS_REL + 1], packed[POS_SUM], packed[POS_COUNT]


def merge_masked_fields(acc, part, loss_kind: str) -> None:
    """Merge masked forward partials over disjoint column sets, given as their fields (:func:`masked_fields`
    or a ``MaskedPartials``), into ``acc`` in place.

    The stats merge with :func:`infcl.lse.lse_merge`; the positives' stats too for "sum", while "mean"
    keeps only their max (the top-1 check); sums and counts add.
    """
    (stats, pos_stats, pos_sum, pos_count), (p_stats, p_pos_stats, p_pos_sum, p_pos_count) = acc, part
    lse_merge(stats, p_stats)
    if loss_kind == "sum":
        lse_merge(pos_stats, p_pos_stats)
    else:
        torch.maximum(pos_stats[MAX], p_pos_stats[MAX], out=pos_stats[MAX])
    pos_sum.add_(p_pos_sum)
    pos_count.add_(p_pos_count)


def merge_masked(acc: Tensor, part: Tensor, loss_kind: str) -> Tensor:
    """:func:`merge_masked_fields` on packed ``[6, n]`` results (a backend merging its split partials);
    returns ``acc``."""
    merge_masked_fields(masked_fields(acc), masked_fields(part), loss_kind)
    return acc
