"""The selection rules of ``mine_hard_negatives`` on each query's window of candidates.

Input: ``[queries, window]`` corpus indices (``MISSING`` past the corpus' end) and their scores; output: the
``[queries, num_negatives]`` negatives and scores (-inf where none was found). Memory: O(queries x window).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .mining_plan import MiningPlan

MISSING = -1  # topk_scores' index of an empty slot (and upstream's padding index)
# Window entries compared with the padded positives per masking step (bools): 4 MiB whatever the data.
MASK_STEP_ELEMENTS = 1 << 22


def select_negatives(plan: MiningPlan, scores, windows, positive_indices, pair_query, positive_scores):
    """Upstream's selection on the ``[queries, window]`` scores: ``(negatives, negative_scores, log_counters)``.

    Rules, in upstream's order (the query's own text is already out, at -inf): positives out (unless
    ``include_positives``); a candidate out if ``score + absolute_margin > p`` or ``score > p - |p| *
    relative_margin`` (p: the query's lowest positive score); out if ``score > max_score`` or ``score < min_score``.
    Then the window sorted by score (equal scores: lower corpus index first), ranks ``range_min:range_max`` kept,
    and ``num_negatives`` of them taken from the top or sampled with Python's ``random`` exactly as upstream samples
    (one ``random.sample`` per query, in query order, over the candidates that are not -inf, or ``num_negatives`` if
    fewer). Out means -inf; the row builders drop -inf negatives.
    """
    inf = float("inf")
    scores = scores.clone()
    if not plan.include_positives:
        scores[_positive_mask(windows, positive_indices)] = -inf
    log_counters = {}
    num_candidates = scores.numel()

    def drop(name, removed, ratio_of):
        nonlocal scores
        skipped = int(removed.sum())
        scores = scores.masked_fill(removed, -inf)
        if skipped:
            log_counters[name] = {"skipped": skipped, "ratio": skipped / ratio_of}
        return skipped

    if plan.absolute_margin is not None or plan.relative_margin is not None:
        n_queries = windows.shape[0]
        # the lowest ("hardest") positive score of each query: upstream's max_positive_scores
        lowest = torch.full((n_queries,), inf, dtype=positive_scores.dtype)
        lowest = lowest.scatter_reduce(0, pair_query, positive_scores, "amin").unsqueeze(1)
        if plan.absolute_margin is not None:
            num_candidates -= drop("absolute_margin", scores + plan.absolute_margin > lowest, num_candidates)
        if plan.relative_margin is not None:
            threshold = lowest - lowest.abs() * plan.relative_margin
            num_candidates -= drop("relative_margin", scores > threshold, num_candidates)
    if plan.max_score is not None:
        drop("max_score", scores > plan.max_score, num_candidates)
    if plan.min_score is not None:  # counts only the candidates still in (not those already at -inf)
        drop("min_score", (scores < plan.min_score) & (scores != -inf), num_candidates)

    # Stable sorts: by corpus index (empty slots last), then by score, descending.
    last = torch.iinfo(torch.long).max
    by_index = torch.argsort(windows.masked_fill(windows == MISSING, last), dim=1, stable=True)
    scores, windows = scores.gather(1, by_index), windows.gather(1, by_index)
    by_score = torch.argsort(scores, dim=1, descending=True, stable=True)
    keep = by_score[:, plan.range_min : plan.range_max]
    scores, windows = scores.gather(1, keep), windows.gather(1, keep)

    n = plan.num_negatives
    if plan.sampling_strategy == "top":
        return windows[:, :n], scores[:, :n], log_counters
    # "random": the ranks upstream samples, in upstream's calls; sorted positions keep the descending order.
    options = (scores.shape[1] - scores.isinf().sum(1)).clamp(min=n)
    picks = torch.tensor([sorted(random.sample(range(o), k=n)) for o in options.tolist()], dtype=torch.long)
    picks = picks.view(-1, n)
    return windows.gather(1, picks), scores.gather(1, picks), log_counters


def _positive_mask(windows, positive_indices):
    """Bool ``[queries, window]``: the entry is one of its query's positives (steps of ``MASK_STEP_ELEMENTS``)."""
    n_queries, width = windows.shape
    most = max(len(p) for p in positive_indices)
    padded = torch.full((n_queries, most), MISSING - 1, dtype=torch.long)  # a value no window entry holds
    for q, row in enumerate(positive_indices):
        padded[q, : len(row)] = torch.tensor(row, dtype=torch.long)
    mask = torch.empty((n_queries, width), dtype=torch.bool)
    step = max(1, MASK_STEP_ELEMENTS // (width * most))
    for start in range(0, n_queries, step):
        block = windows[start : start + step].unsqueeze(2) == padded[start : start + step].unsqueeze(1)
        mask[start : start + step] = block.any(2)
    return mask
