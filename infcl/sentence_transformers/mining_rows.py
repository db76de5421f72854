"""The rows ``mine_hard_negatives`` returns, in each of upstream's output formats, and its verbose report.

Inputs are per unique query (``negatives`` / ``negative_scores``: ``[queries, num_negatives]``, -inf where no
negative was found) and per (query, positive) pair (``pair_query``, ``pair_positive``, ``positive_scores``:
``[pairs]``, grouped by query in first-seen order). Every format is sentence-transformers 6.3's, row for row:

- ``"triplet"``: one row per pair and found negative: (anchor, positive, negative[, scores=[pos, neg]]).
- ``"n-tuple"``: one row per pair whose query has all ``num_negatives``: (anchor, positive, negative_1, ...,
  negative_n[, scores=[pos, neg_1, ..., neg_n]]).
- ``"labeled-pair"``: per query, its positives then its found negatives: (anchor, document, label 1/0 or score).
- ``"labeled-list"``: one row per pair whose query has a negative: (anchor, [positive, negatives...],
  labels [1, 0, ...] or scores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Rows:
    """The columns of the output dataset, and what the verbose report counts over them."""

    data: dict[str, list[Any]]
    negative_scores: torch.Tensor  # the negatives that made it into rows, flat (per pair where a format repeats)
    difference_scores: torch.Tensor  # positive minus negative score, aligned with negative_scores
    maximum_possible_samples: int


def build_rows(
    output_format: str,
    *,
    output_scores: bool,
    anchor_column_name: str,
    positive_column_name: str,
    queries: list[str],
    corpus: list[str],
    pair_query: torch.Tensor,
    pair_positive: torch.Tensor,
    positive_scores: torch.Tensor,
    negatives: torch.Tensor,
    negative_scores: torch.Tensor,
    dataset_length: int,
) -> Rows:
    """The dataset's columns (a dict for ``datasets.Dataset.from_dict``) in ``output_format``."""
    num_negatives = negatives.shape[1]
    # Every pair carries its query's negatives (upstream repeats them per positive).
    pair_negatives, pair_negative_scores = negatives[pair_query], negative_scores[pair_query]
    found = pair_negative_scores != -float("inf")
    pair_anchors = [queries[q] for q in pair_query.tolist()]
    pair_positives = [corpus[p] for p in pair_positive.tolist()]
    pair_positive_scores = positive_scores.unsqueeze(1).expand(-1, num_negatives)

    if output_format == "labeled-pair":
        return _labeled_pair(
            output_scores, anchor_column_name, positive_column_name, queries, corpus, pair_query, pair_positive,
            positive_scores, negatives, negative_scores, found, pair_negative_scores, pair_positive_scores,
            dataset_length,
        )  # fmt: skip

    if output_format == "triplet":
        pair_idx, slot = found.nonzero(as_tuple=True)
        kept_scores = pair_negative_scores[pair_idx, slot]
        data = {
            anchor_column_name: [pair_anchors[p] for p in pair_idx.tolist()],
            positive_column_name: [pair_positives[p] for p in pair_idx.tolist()],
            "negative": [corpus[n] for n in pair_negatives[pair_idx, slot].tolist()],
        }
        if output_scores:
            data["scores"] = [[float(p), float(n)] for p, n in zip(positive_scores[pair_idx].tolist(), kept_scores)]
        return Rows(data, kept_scores, positive_scores[pair_idx] - kept_scores, found.numel())

    if output_format == "n-tuple":
        complete = found.all(dim=1)
        rows = complete.nonzero(as_tuple=True)[0].tolist()
        data = {
            anchor_column_name: [pair_anchors[p] for p in rows],
            positive_column_name: [pair_positives[p] for p in rows],
        }
        for slot in range(num_negatives):
            data[f"negative_{slot + 1}"] = [corpus[n] for n in pair_negatives[complete, slot].tolist()]
        kept = pair_negative_scores[complete]
        if output_scores:
            data["scores"] = torch.cat([positive_scores[complete].unsqueeze(-1), kept], dim=1).tolist()
        return Rows(data, kept.flatten(), (pair_positive_scores[complete] - kept).flatten(), len(pair_query))

    if output_format == "labeled-list":
        rows = found.any(dim=1).nonzero(as_tuple=True)[0].tolist()
        data = {
            anchor_column_name: [pair_anchors[p] for p in rows],
            positive_column_name: [
                [pair_positives[p]] + [corpus[n] for n in pair_negatives[p][found[p]].tolist()] for p in rows
            ],
        }
        if output_scores:
            data["scores"] = [[positive_scores[p].item()] + pair_negative_scores[p][found[p]].tolist() for p in rows]
        else:
            data["labels"] = [[1] + [0] * int(found[p].sum()) for p in rows]
        kept = pair_negative_scores[found]
        return Rows(data, kept, pair_positive_scores[found] - kept, len(pair_query))

    raise AssertionError(f"unresolved output_format {output_format!r}")  # _Plan.resolve checked it


def _labeled_pair(
    output_scores, anchor_column_name, positive_column_name, queries, corpus, pair_query, pair_positive,
    positive_scores, negatives, negative_scores, found, pair_negative_scores, pair_positive_scores, dataset_length,
) -> Rows:  # fmt: skip
    """Per query: a row per positive (label 1 or its score), then a row per found negative (label 0 or score)."""
    data = {anchor_column_name: [], positive_column_name: []}
    value_column = "score" if output_scores else "label"
    data[value_column] = []
    pairs_of = [[] for _ in queries]
    for pair, q in enumerate(pair_query.tolist()):
        pairs_of[q].append(pair)
    positives, scores = pair_positive.tolist(), positive_scores.tolist()
    for q, query in enumerate(queries):
        for pair in pairs_of[q]:
            data[anchor_column_name].append(query)
            data[positive_column_name].append(corpus[positives[pair]])
            data[value_column].append(scores[pair] if output_scores else 1)
        for n, score in zip(negatives[q].tolist(), negative_scores[q].tolist()):
            if score == -float("inf"):
                continue
            data[anchor_column_name].append(query)
            data[positive_column_name].append(corpus[n])
            data[value_column].append(score if output_scores else 0)
    kept = pair_negative_scores[found]
    maximum = len(queries) * negatives.shape[1] + dataset_length
    return Rows(data, kept, pair_positive_scores[found] - kept, maximum)


def report(plan, rows: Rows, positive_scores: torch.Tensor, log_counters: dict, output_length: int) -> None:
    """Upstream's verbose report, line for line: score statistics, what each rule skipped, what is missing."""
    row_format = "{:<6} {:>14} {:>14} {:>14}"

    def formatter(value):
        return f"{value.item():.4f}" if isinstance(value, torch.Tensor) else f"{value:,}"

    negative_scores, difference_scores = rows.negative_scores, rows.difference_scores
    print(row_format.format("Metric", "Positive", "Negative", "Difference"))
    print(row_format.format("Count", formatter(len(positive_scores)), formatter(len(negative_scores)), ""))
    statistics = [
        ("mean", torch.mean),
        ("median", torch.median),
        ("std", torch.std),
        ("min", lambda s: torch.min(s) if s.numel() > 0 else float("inf")),
        ("25%", lambda s: torch.quantile(s.float(), q=0.25) if s.numel() > 0 else float("inf")),
        ("50%", lambda s: torch.quantile(s.float(), q=0.5) if s.numel() > 0 else float("inf")),
        ("75%", lambda s: torch.quantile(s.float(), q=0.75) if s.numel() > 0 else float("inf")),
        ("max", lambda s: torch.max(s) if s.numel() > 0 else float("-inf")),
    ]
    for metric, function in statistics:
        values = (function(positive_scores), function(negative_scores), function(difference_scores))
        print(row_format.format(metric.capitalize(), *(formatter(v) for v in values)))

    for name in ("absolute_margin", "relative_margin", "max_score", "min_score"):
        if name in log_counters:
            skipped, ratio = log_counters[name]["skipped"], log_counters[name]["ratio"]
            print(f"Skipped {skipped:,} potential negatives ({ratio:.2%}) due to the {name} of {getattr(plan, name)}.")

    missing_samples = rows.maximum_possible_samples - output_length
    if missing_samples > 0:
        solutions = ["range_max"]
        if plan.range_min > 0:
            solutions.append("range_min")
        solutions += [name for name in ("absolute_margin", "relative_margin", "max_score") if getattr(plan, name)
                      is not None]  # fmt: skip
        considerations = ", ".join(solutions[:-1]) + " and " + solutions[-1] if len(solutions) > 1 else solutions[0]
        print(
            f"Could not find enough negatives for {missing_samples} samples "
            f"({missing_samples / rows.maximum_possible_samples:.2%}). Consider adjusting the {considerations} "
            f"parameter{'s' if len(solutions) > 1 else ''} if you'd like to find more valid negatives."
        )
