"""The arguments of ``mine_hard_negatives``, checked and resolved as sentence-transformers 6.3 resolves them.

Same order of checks, same messages and warnings (the deprecated ``as_triplets``, ``margin`` and
``"n-tuple-scores"``; ``include_positives`` forcing ``"n-tuple"``), the same derived ``range_max``; plus the
checks of what infcl adds or refuses (``score_dtype``, ``sampling_strategy``, manhattan similarity).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, fields

import numpy as np
import torch

logger = logging.getLogger("infcl.sentence_transformers.mining")

OUTPUT_FORMATS = ("triplet", "n-tuple", "labeled-pair", "labeled-list")
SAMPLING_STRATEGIES = ("top", "random")
# Similarities that order unit vectors as their dot product does (the embeddings are always normalized):
# cosine and dot are the dot product, euclidean is -sqrt(2 - 2 dot). Manhattan distance is not a function of it.
RANKED_BY_DOT = ("cosine", "dot", "euclidean")


def as_list(values) -> list:
    """A list of texts from a list, a NumPy array or a ``datasets`` column (read in one batch), as upstream
    reads the dataset's columns and the ``corpus`` argument."""
    if isinstance(values, np.ndarray):
        return values.tolist()
    try:
        from datasets import Column  # datasets >= 4: a lazy column, read row by row unless sliced
    except ImportError:
        return list(values)
    return list(values[:] if isinstance(values, Column) else values)


@dataclass(frozen=True)
class MiningPlan:
    """The arguments after upstream's resolution: deprecated aliases applied, ``range_max`` derived."""

    anchor_column_name: str
    positive_column_name: str
    range_min: int
    range_max: int
    max_score: float | None
    min_score: float | None
    absolute_margin: float | None
    relative_margin: float | None
    num_negatives: int
    sampling_strategy: str
    include_positives: bool
    output_format: str
    output_scores: bool
    positives_per_query: tuple[int, ...]

    @property
    def max_positives(self) -> int:
        return max(self.positives_per_query)

    @property
    def window(self) -> int:
        """Candidates searched per query: ``range_max`` plus room for what leaves by index, not by score (the
        query's positives, and its own text where the corpus holds it): upstream 6.3's ``candidate_count``."""
        return self.range_max + self.max_positives + 1

    @classmethod
    def resolve(cls, *, dataset, model, cross_encoder, verbose, use_faiss, faiss_batch_size, score_dtype, **args):
        """Upstream's checks and resolution, in upstream's order (same messages and warnings), plus ours."""
        if len(dataset) == 0:
            raise ValueError("The dataset is empty. Please provide a non-empty dataset.")
        if faiss_batch_size <= 0:
            raise ValueError(f"faiss_batch_size must be a positive integer, got {faiss_batch_size}.")
        if use_faiss:
            logger.info("use_faiss=True: infcl's exact top-k search is used instead of FAISS (same result as without)")
        if score_dtype is not None and score_dtype not in (torch.float32, torch.float64):
            raise TypeError(f"score_dtype must be None, torch.float32 or torch.float64, got {score_dtype}")
        if model.similarity_fn_name not in RANKED_BY_DOT:
            raise ValueError(
                f"model.similarity_fn_name={model.similarity_fn_name!r} is not supported: the exact search ranks the "
                f"normalized embeddings by dot product, which orders them as {', '.join(RANKED_BY_DOT)} do"
            )

        columns = dataset.column_names
        anchor, positive = args["anchor_column_name"], args["positive_column_name"]
        if not anchor or anchor not in columns:
            anchor = columns[0]
        if not positive or positive not in columns:
            if len(columns) < 2:
                raise ValueError(
                    "Dataset must contain at least two columns to select the positive column automatically."
                )
            positive = columns[1]

        output_format, output_scores = args["output_format"], args["output_scores"]
        if args["as_triplets"] is not None:
            output_format = "triplet" if args["as_triplets"] else "n-tuple"
            logger.warning(
                "The `as_triplets` parameter is deprecated. Use the `output_format` parameter instead. "
                f"Setting `output_format` to `{output_format}`."
            )
        range_min, range_max = args["range_min"], args["range_max"]
        max_score, min_score = args["max_score"], args["min_score"]
        absolute_margin, relative_margin = args["absolute_margin"], args["relative_margin"]
        sampling_strategy, num_negatives = args["sampling_strategy"], args["num_negatives"]
        if args["include_positives"]:
            changed = (range_min, range_max, max_score, min_score, absolute_margin, relative_margin, args["margin"])
            if changed != (0,) + (None,) * 6 or sampling_strategy != "top":
                logger.warning(
                    "When using `include_positives=True`, updating `range_min`, `range_max`, `max_score`, "
                    "`min_score`, `absolute_margin`, `relative_margin`, or `sampling_strategy` from the default "
                    "values may still discard the positive values."
                )
            if output_format != "n-tuple":
                logger.warning(
                    'When using `include_positives=True`, `output_format` will be set to `"n-tuple"` to ensure '
                    "that the ranking order is preserved."
                )
                output_format = "n-tuple"
        if output_format == "n-tuple-scores":
            logger.warning(
                '`output_format="n-tuple-scores"` is deprecated. Use `output_format="n-tuple"` with '
                "`output_scores=True` instead for equivalent output formats."
            )
            output_format, output_scores = "n-tuple", True
        if output_format not in OUTPUT_FORMATS:
            raise ValueError(
                f"Invalid output_format: {output_format}. Must be one of 'triplet', 'n-tuple', 'labeled-pair', "
                "or 'labeled-list'."
            )
        if sampling_strategy not in SAMPLING_STRATEGIES:  # upstream would fail later, on a shape mismatch
            raise ValueError(f"sampling_strategy must be 'top' or 'random', got {sampling_strategy!r}")
        if args["margin"] is not None:
            absolute_margin = args["margin"]
            logger.warning(
                "The `margin` parameter is deprecated. Use the `absolute_margin` and/or `relative_margin` parameter "
                f"instead. Setting `absolute_margin` to `{absolute_margin}`."
            )

        # Rows per anchor with a positive, repeated pairs included (upstream's pandas groupby(anchor).count()).
        per_query = Counter(q for q, p in zip(dataset[anchor], dataset[positive]) if q is not None and p is not None)
        positives_per_query = tuple(per_query.values())
        if num_negatives < 1:
            raise ValueError(f"num_negatives must be at least 1, got num_negatives={num_negatives}.")
        bounded = absolute_margin is not None or relative_margin is not None or max_score is not None
        if range_max is None:
            max_positives = max(positives_per_query)
            if bounded or (cross_encoder is not None and min_score is not None):
                # room for candidates the margins or bounds skip (upstream's 10x)
                range_max = range_min + (num_negatives * 10) + max_positives
            else:
                range_max = range_min + num_negatives + max_positives
            if verbose:
                print(f"Setting range_max to {range_max} based on the provided parameters.")
        if range_min < 0:
            raise ValueError(f"range_min must be non-negative, got range_min={range_min}.")
        if range_min >= range_max:
            raise ValueError(
                f"range_min must be smaller than range_max, got range_min={range_min} and range_max={range_max}."
            )
        if num_negatives > range_max - range_min:
            raise ValueError(
                f"Cannot mine {num_negatives} negatives per query: only {range_max - range_min} candidates remain "
                f"after skipping the first range_min={range_min} of range_max={range_max}. Consider decreasing "
                "num_negatives or range_min, or increasing range_max."
            )
        resolved = dict(
            args,
            anchor_column_name=anchor,
            positive_column_name=positive,
            range_max=range_max,
            absolute_margin=absolute_margin,
            output_format=output_format,
            output_scores=output_scores,
            positives_per_query=positives_per_query,
        )
        return cls(**{field.name: resolved[field.name] for field in fields(cls)})
