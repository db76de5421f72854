"""The float64 MaxSim contrastive loss truth, built without infcl: the token scores materialized (small shapes only).

Each (query token, document) keeps its *lowest-index* maximal real document token, found by exact comparison of the
float64 token products (a gather, so autograd routes the whole gradient there, as the stated rule says; ``amax``'s
backward would split it between ties). Tests that decide ties use data whose products are exact in float64 (small
integers), so the truth's ties are the data's.
"""

import torch
import torch.nn.functional as F


def maxsim_scores(q, docs, q_mask=None, docs_mask=None, length_normalize=False):
    """R [Bq, Bk] float64 (differentiable in q and docs), with the rules of ``cal_maxsim_loss``'s docstring."""
    q, docs = q.double(), docs.double()
    bq, lq, _ = q.shape
    bk, lk, _ = docs.shape
    q_real = torch.ones(bq, lq, dtype=torch.bool) if q_mask is None else q_mask != 0
    d_real = torch.ones(bk, lk, dtype=torch.bool) if docs_mask is None else docs_mask != 0
    q = torch.where(q_real[..., None], q, 0.0)
    docs = torch.where(d_real[..., None], docs, 0.0)
    tokens = torch.einsum("itd,jud->ijtu", q, docs)  # [Bq, Bk, Lq, Lk]
    ranked = tokens.detach().masked_fill(~d_real[None, :, None, :], float("-inf"))
    best = ranked.amax(dim=-1, keepdim=True)
    is_best = (ranked == best) | torch.isnan(ranked)
    first = torch.argmax(is_best.to(torch.int8), dim=-1, keepdim=True)  # argmax returns the first of equal maxima
    maxima = tokens.gather(-1, first).squeeze(-1)  # [Bq, Bk, Lq]
    empty = ~d_real.any(dim=1)
    maxima = maxima.masked_fill(empty[None, :, None], 0.0)
    weight = q_real.double()
    if length_normalize:
        weight = weight / weight.sum(dim=1, keepdim=True).clamp(min=1)
    scores = (maxima * weight[:, None, :]).sum(dim=-1)
    weighted = q_real.any(dim=1)
    return scores.masked_fill(empty[None, :] & weighted[:, None], float("-inf"))


def maxsim_loss(
    q,
    docs,
    labels=None,
    scale=1.0,
    q_mask=None,
    docs_mask=None,
    length_normalize=False,
    q_ids=None,
    k_ids=None,
    reduction="mean",
):
    """The loss in float64 over :func:`maxsim_scores` (false negatives: same id, not the positive, left out)."""
    scores = maxsim_scores(q, docs, q_mask, docs_mask, length_normalize) * scale
    bq = scores.shape[0]
    labels = torch.arange(bq) if labels is None else labels
    if q_ids is not None:
        same = q_ids[:, None] == k_ids[None, :]
        same[torch.arange(bq), labels] = False
        scores = scores.masked_fill(same, float("-inf"))
    return F.cross_entropy(scores, labels, reduction=reduction)
