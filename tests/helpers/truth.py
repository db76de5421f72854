"""The float64 truth of the masked softmax loss, written with nothing from infcl: the property suites' truth.

:func:`truth_directions` materializes the float64 logits and applies the rules of ``infcl.masks`` row by row:
positives, false-negative ids, the guide rule ``G[i, j] > G[i, label] - margin`` (or ``* (1 - margin)``) from
exactly rounded guide scores (tests/helpers/exact_scores.py: an exact duplicate ties its threshold wherever it
sits, on any CPU), NaN for rows without a positive and for rows whose guide holds NaN/inf. Differentiable in q,
k and a tensor scale.
(support.masked_truth_directions is the other, cancellation-free one, for confident rows.)
"""

import torch

from helpers.exact_scores import truth_scores


def _direction_truth(logits, labels, ids, other_ids, guide, other_guide, multi_positive, margin, strategy):
    """Per-row losses [n] of ``logits`` [n, m] (float64), the rules of infcl.masks applied row by row."""
    scores = None if guide is None else truth_scores(guide, other_guide)
    rows = []
    for i in range(logits.shape[0]):
        if multi_positive is None:
            positive = {int(labels[i])}
        else:
            positive = {j for j in range(logits.shape[1]) if ids[i] == other_ids[j]}
        excluded = set()
        if ids is not None:
            excluded |= {j for j in range(logits.shape[1]) if ids[i] == other_ids[j]}
        poisoned = False
        if guide is not None:
            g = scores[i].tolist()
            poisoned = not (torch.isfinite(guide[i]).all() and torch.isfinite(other_guide).all())
            at = g[int(labels[i])]
            threshold = at - margin if strategy == "absolute" else at * (1 - margin)
            excluded |= {j for j in range(logits.shape[1]) if g[j] > threshold}
        excluded -= positive
        kept = [j for j in range(logits.shape[1]) if j not in excluded]
        if not positive or poisoned:
            rows.append(logits.new_tensor(float("nan")) + 0 * logits[i].sum())
            continue
        lse = torch.logsumexp(logits[i, kept], dim=0)
        pos = sorted(positive)
        if multi_positive == "sum":
            rows.append(lse - torch.logsumexp(logits[i, pos], dim=0))
        else:
            rows.append(lse - logits[i, pos].mean())
    return torch.stack(rows)


def truth_directions(
    q,
    k,
    labels,
    scale,
    symmetric=False,
    q_ids=None,
    k_ids=None,
    multi_positive=None,
    guide=None,
    margin=0.0,
    strategy="absolute",
):
    """(rows [Bq], columns [Bk] or None): each direction's losses in float64 (differentiable in q, k, scale)."""
    q, k = q.to(torch.float64), k.to(torch.float64)
    logits = scale * q @ k.T
    labels = torch.arange(q.shape[0]) if labels is None else labels.to(torch.int64)
    q_ids = None if q_ids is None else [int(v) for v in q_ids.to(torch.int64)]
    k_ids = None if k_ids is None else [int(v) for v in k_ids.to(torch.int64)]
    gq, gk = (None, None) if guide is None else (guide[0].to(torch.float64), guide[1].to(torch.float64))
    rows = _direction_truth(logits, labels, q_ids, k_ids, gq, gk, multi_positive, margin, strategy)
    if not symmetric:
        return rows, None
    return rows, _direction_truth(
        logits.T, torch.argsort(labels), k_ids, q_ids, gk, gq, multi_positive, margin, strategy
    )


def truth_losses(*args, **kwargs):
    """reduction="none" losses in float64: per row, or (symmetric) per pair (row i + column i) / 2."""
    rows, cols = truth_directions(*args, **kwargs)
    return rows if cols is None else (rows + cols) / 2
