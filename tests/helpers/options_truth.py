"""Float64 truths of issue 56's options built without infcl: label smoothing with ids and a guide."""

import torch
import torch.nn.functional as F


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


def kept_truth(q, k, labels, scale, q_ids, k_ids, multi_positive, guide, margin, strategy, eps, symmetric):
    """Per-row (symmetric: per pair) float64 losses of label smoothing with any mask options, row by row:
    ``F.cross_entropy`` on the row's logits with its excluded columns removed (infcl/masks.py's rule: the same-id
    non-positives under None, and the columns whose guide score G = guide_q @ guide_k.T is above the threshold
    t = G[i, labels[i]] - margin ("absolute") or G[i, labels[i]] * (1 - margin) ("relative"), never a positive).
    None: ``label_smoothing=eps`` on the label; "mean": the probability target (1 - eps) / |P| on the positives
    plus eps / n on each of the n kept columns; "sum": (1 - eps) * (-log of the positives' total probability)
    + eps * the cross-entropy of the uniform target over the kept columns. NaN for rows without a positive.
    ``guide``: (guide_q, guide_k) or None; G is exact for integer-valued guide features (ties compare equal)."""
    q, k, scale = q.double(), k.double(), scale.double()

    def direction(logits, lab, ids_a, ids_b, g_a, g_b):
        n, m = logits.shape
        positive = torch.zeros(n, m, dtype=torch.bool).scatter_(1, lab[:, None], True)
        excluded = torch.zeros_like(positive)
        if ids_a is not None:
            same = ids_a[:, None] == ids_b[None, :]
            positive = positive if multi_positive is None else same
            excluded = same.clone() if multi_positive is None else excluded
        if g_a is not None:
            scores = g_a.double() @ g_b.double().T
            at_label = scores.gather(1, lab[:, None])
            threshold = at_label - margin if strategy == "absolute" else at_label * (1 - margin)
            excluded |= scores > threshold
        excluded &= ~positive
        losses = []
        for i in range(n):
            kept = ~excluded[i]
            z, pos = logits[i][kept], positive[i][kept]
            if not bool(pos.any()):
                losses.append(torch.tensor(float("nan"), dtype=torch.float64))
                continue
            if multi_positive is None:
                losses.append(F.cross_entropy(z[None], pos.nonzero()[0], label_smoothing=eps))
            elif multi_positive == "mean":
                target = (1 - eps) * pos.double() / pos.sum() + eps / z.numel()
                losses.append(F.cross_entropy(z[None], target[None]))
            else:
                uniform = F.cross_entropy(z[None], torch.full((1, z.numel()), 1.0 / z.numel(), dtype=torch.float64))
                mil = -torch.logsumexp(F.log_softmax(z, dim=0)[pos], dim=0)
                losses.append((1 - eps) * mil + eps * uniform)
        return torch.stack(losses)

    gq, gk = (None, None) if guide is None else guide
    logits = scale * q @ k.T
    rows = direction(logits, labels, q_ids, k_ids, gq, gk)
    if not symmetric:
        return rows, None
    return rows, direction(logits.T, torch.argsort(labels), k_ids, q_ids, gk, gq)
