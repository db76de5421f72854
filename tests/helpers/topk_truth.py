"""The float64 truth of ``infcl.topk_scores``, written with nothing from infcl, and the test data it is held to.

:func:`topk_truth` materializes S = q @ k.T exactly rounded in float64 (tests/helpers/exact_scores.py: equal
columns tie wherever they sit, on any CPU) and, row by row, sorts the eligible columns stably by score (ties
keep the lower column first), as docs/topk.md states the rules: labels and ids leave columns out,
a row with a NaN among its eligible scores is NaN with index -1, slots past the eligible columns are
(-inf or +inf, -1).
"""

import torch

from helpers.exact_scores import truth_scores


def quarter_features(rows: int, dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, dim] multiples of 1/4 in [-1, 1]: exact in every float dtype, and every dot product of two
    rows (a multiple of 1/16 below 2^6) is exact in float32, so the scores tie exactly where they tie in
    float64, on every backend."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-4, 5, (rows, dim), generator=gen).to(torch.float64) / 4).to(dtype)


def eligible_columns(bq: int, bk: int, labels=None, q_ids=None, k_ids=None) -> torch.Tensor:
    """[bq, bk] bool: the columns each row may return."""
    eligible = torch.ones(bq, bk, dtype=torch.bool)
    if labels is not None:
        rows = torch.nonzero(labels >= 0).flatten()
        eligible[rows, labels[rows]] = False
    if q_ids is not None:
        eligible &= q_ids[:, None] != k_ids[None, :]
    return eligible


def topk_truth(q, k, n, labels=None, q_ids=None, k_ids=None, largest=True):
    """(scores [Bq, n] float64, indices [Bq, n] int64)."""
    scores = truth_scores(q, k)
    bq, bk = scores.shape
    eligible = eligible_columns(bq, bk, labels, q_ids, k_ids)
    empty = float("-inf") if largest else float("inf")
    out_scores = torch.full((bq, n), empty, dtype=torch.float64)
    out_index = torch.full((bq, n), -1, dtype=torch.int64)
    for i in range(bq):
        columns = torch.nonzero(eligible[i]).flatten()
        values = scores[i, columns]
        if bool(torch.isnan(values).any()):
            out_scores[i] = float("nan")
            continue
        ordered = torch.sort(values, descending=largest, stable=True)
        m = min(n, columns.numel())
        out_scores[i, :m] = ordered.values[:m]
        out_index[i, :m] = columns[ordered.indices[:m]]
    return out_scores, out_index


def separated_rows(truth_scores: torch.Tensor, tolerance: float) -> torch.Tensor:
    """[Bq] bool: rows whose n + 1 best scores (the n returned and the next: pass scores of width n + 1)
    are at least ``tolerance`` apart, so a score computed within it cannot reorder them."""
    gaps = (truth_scores[:, :-1] - truth_scores[:, 1:]).abs()
    return (gaps.nan_to_num(float("inf")) > tolerance).all(dim=1)
