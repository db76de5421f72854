"""Float64 truth of sentence-transformers' hard-negative selection rules, written without infcl.

``mine_hard_negatives`` (upstream's and infcl's) keeps, for each unique query, the window of the
``range_max + max_positives + 1`` best corpus entries, drops the query's own text, the positives and the entries
a margin or score bound rules out, keeps window ranks ``range_min:range_max`` and takes ``num_negatives`` from
the top or at random.
Here each of those steps is a plain Python loop over exactly rounded float64 scores of the float32 embeddings
(tests/helpers/exact_scores.py: equal embeddings tie wherever they sit), with ties by lower corpus index, so the
tests can hold both implementations to the rules themselves.
"""

from __future__ import annotations

import numpy as np

from helpers.exact_scores import truth_scores

INF = float("inf")


def exact_scores(queries: np.ndarray, corpus: np.ndarray) -> np.ndarray:
    """``[Q, C]`` float64 dot products of the embeddings, each exactly rounded (whatever the summation order:
    equal embeddings give equal scores)."""
    return truth_scores(queries, corpus).numpy()


def window_of(row: np.ndarray, width: int) -> list[int]:
    """The ``width`` best columns of a row, equal scores by lower column first."""
    return sorted(range(len(row)), key=lambda c: (-row[c], c))[:width]


def select(
    scores: np.ndarray,
    positives: list[list[int]],
    own_text: list[int | None],
    *,
    range_min: int,
    range_max: int,
    num_negatives: int,
    max_positives: int,
    absolute_margin: float | None = None,
    relative_margin: float | None = None,
    max_score: float | None = None,
    min_score: float | None = None,
    include_positives: bool = False,
    sampling_strategy: str = "top",
    rng=None,
) -> list[list[tuple[int, float]]]:
    """Per query (row of ``scores``), the selected negatives as ``(corpus index, score)``, best first.

    ``own_text``: each query's own corpus index (None: the corpus lacks it, or it is a kept positive), never
    a negative.

    ``rng`` (for "random"): an object with ``sample``, drawn from once per query in query order, over the
    first ``max(kept candidates, num_negatives)`` ranks, as sentence-transformers does.
    """
    width = range_max + max_positives + 1
    selected = []
    for q, row in enumerate(scores):
        lowest = min(row[p] for p in positives[q])
        ruled_out = [
            c == own_text[q]
            or (not include_positives and c in positives[q])
            or (absolute_margin is not None and row[c] + absolute_margin > lowest)
            or (relative_margin is not None and row[c] > lowest - abs(lowest) * relative_margin)
            or (max_score is not None and row[c] > max_score)
            or (min_score is not None and row[c] < min_score)
            for c in range(len(row))
        ]
        ranked = [c for c in window_of(row, width) if not ruled_out[c]]
        ranked = (ranked + [None] * width)[:width][range_min:range_max]  # ruled out: at the end, as -inf
        if sampling_strategy == "top":
            picks = range(num_negatives)
        else:
            options = max(sum(c is not None for c in ranked), num_negatives)
            picks = sorted(rng.sample(range(options), k=num_negatives))
        selected.append([(ranked[i], float(row[ranked[i]])) for i in picks if ranked[i] is not None])
    return selected


def smallest_gap(
    scores: np.ndarray,
    positives: list[list[int]],
    width: int,
    *,
    absolute_margin=None,
    relative_margin=None,
    max_score=None,
    min_score=None,
) -> float:
    """How far the data is from a tie that float32 could decide either way: the smallest distance between
    consecutive scores in a query's window (one past it included) and between a window score and a bound the
    rules compare it with (positives left out: they leave by index, not by score)."""
    gap = INF
    for q, row in enumerate(scores):
        columns = window_of(row, width + 1)
        ordered = np.sort(row[columns])
        if len(ordered) > 1:
            gap = min(gap, float(np.min(np.diff(ordered))))
        window = row[[c for c in columns if c not in positives[q]]]
        lowest = min(row[p] for p in positives[q])
        bounds = [max_score, min_score]
        bounds.append(None if absolute_margin is None else lowest - absolute_margin)
        bounds.append(None if relative_margin is None else lowest - abs(lowest) * relative_margin)
        for bound in bounds:
            if bound is not None and len(window):
                gap = min(gap, float(np.min(np.abs(window - bound))))
    return gap


def truth_negatives(queries, answers, corpus, embed_queries, embed_documents, rng=None, **rules):
    """The float64 truth's ``{anchor: [negative texts]}`` for a dataset's (anchor, positive) columns, on the
    corpus as ``mine_hard_negatives`` builds it (``corpus`` or the positives, then the positives, deduplicated).

    ``embed_queries`` / ``embed_documents``: text list -> float32 ``[n, D]`` (the embeddings the run used);
    ``rules``: mine_hard_negatives' selection arguments (``range_max`` derived as it derives it).
    """
    full_corpus = list(dict.fromkeys(list(corpus or answers) + list(answers)))
    position = {text: i for i, text in enumerate(full_corpus)}
    unique = list(dict.fromkeys(queries))
    row_of = {q: i for i, q in enumerate(unique)}
    positives = [[] for _ in unique]
    for q, p in zip(queries, answers):
        if position[p] not in positives[row_of[q]]:
            positives[row_of[q]].append(position[p])
    include = rules.get("include_positives", False)
    kept_self = {q for q, p in zip(queries, answers) if include and q == p}
    own_text = [None if q in kept_self else position.get(q) for q in unique]
    scores = exact_scores(embed_queries(unique), embed_documents(full_corpus))
    max_positives = max(list(queries).count(q) for q in unique)  # rows per anchor, repeated pairs included
    num_negatives = rules.pop("num_negatives", 3)
    range_min = rules.pop("range_min", 0)
    range_max = rules.pop("range_max", None)
    if range_max is None:
        bounded = any(rules.get(r) is not None for r in ("absolute_margin", "relative_margin", "max_score"))
        range_max = range_min + num_negatives * (10 if bounded else 1) + max_positives
    chosen = select(
        scores, positives, own_text, range_min=range_min, range_max=range_max, num_negatives=num_negatives,
        max_positives=max_positives, rng=rng, **rules,
    )  # fmt: skip
    return {unique[q]: [full_corpus[c] for c, _ in picks] for q, picks in enumerate(chosen)}
