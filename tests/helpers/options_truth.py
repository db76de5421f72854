"""Float64 truths of issue 56's options built without infcl: label smoothing with ids."""

import torch


def masked_truth(q, k, labels, scale, q_ids, k_ids, multi_positive, eps, symmetric):
    """Per-row (symmetric: per pair) float64 losses with ids: (1 - eps) * the masked loss + eps * (lse - the mean
    logit over the kept columns), the kept columns every column but the same-id non-positives (None) or all
    ("mean", "sum"); the masked loss lse - the positives' mean logit (None, "mean") or lse - their logsumexp
    ("sum"); NaN for rows without a positive."""
    q, k, scale = q.double(), k.double(), scale.double()

    def direction(logits, lab, ids_a, ids_b):
        same = ids_a[:, None] == ids_b[None, :]
        one_hot = torch.zeros_like(same).scatter_(1, lab[:, None], True)
        positive = one_hot if multi_positive is None else same
        excluded = same & ~positive if multi_positive is None else torch.zeros_like(same)
        lse = torch.logsumexp(logits.masked_fill(excluded, float("-inf")), dim=1)
        count = positive.sum(dim=1)
        if multi_positive == "sum":  # MIL-NCE: -log of the positives' total probability
            some = positive | (count == 0)[:, None]  # rows without a positive: finite, so no NaN gradient
            base = lse - torch.logsumexp(logits.masked_fill(~some, float("-inf")), dim=1)
        else:
            base = lse - torch.where(positive, logits, 0).sum(dim=1) / count
        uniform = lse - torch.where(excluded, 0, logits).sum(dim=1) / (~excluded).sum(dim=1)
        return torch.where(count > 0, (1 - eps) * base + eps * uniform, float("nan"))

    logits = scale * q @ k.T
    rows = direction(logits, labels, q_ids, k_ids)
    if not symmetric:
        return rows, None
    return rows, direction(logits.T, torch.argsort(labels), k_ids, q_ids)
