"""Hard-negative mining on infcl's exact top-k: a drop-in for sentence-transformers' ``mine_hard_negatives``.

    # from sentence_transformers.util import mine_hard_negatives
    from infcl.sentence_transformers import mine_hard_negatives

    dataset = mine_hard_negatives(dataset, model, range_min=10, range_max=50, relative_margin=0.05)

It takes sentence-transformers 6.3's arguments (every one, same names, defaults and order) and returns the same dataset
for the same arguments: upstream's steps in upstream's order (deduplicate, embed, take a window of the ``range_max +
max_positives + 1`` best corpus entries per query, drop the query's own text and its positives, apply the margins and
score bounds, keep ranks ``range_min:range_max``, sample, build the rows). Only the window differs in how it is found:
``infcl.topk_scores`` walks the corpus in tiles and keeps ``O(range_max + positives)`` candidates per query, never a
``faiss_batch_size x len(corpus)`` score matrix and never FAISS. The phases, in reading order:

1. ``MiningPlan`` (:mod:`.mining_plan`): the arguments, checked and resolved as upstream resolves them
   (deprecations, ``range_max``).
2. ``_embed``: upstream's ``encode_document`` / ``encode_query`` calls and its embedding cache, unchanged.
3. ``_search_windows``: the exact top-k search, one ``topk_scores`` call per ``faiss_batch_size`` queries (the
   progress bar's step).
4. ``_pair_scores``: every window score and every positive score from one arithmetic, the model's
   ``similarity_pairwise``, so a threshold (a positive's score) and the scores compared with it are computed
   alike; the cross-encoder, when given, rescores the window and the positives in upstream's loop.
5. ``select_negatives`` (:mod:`.mining_select`): the selection rules on the ``[queries, window]`` scores;
   ties: lower corpus index first.
6. :mod:`infcl.sentence_transformers.mining_rows`: the output formats and upstream's verbose report.

Differences from upstream, all by design (docs/mining.md):

- Ties: where upstream's ``torch.topk`` orders equal scores arbitrarily, equal scores here rank the lower
  index of the deduplicated corpus first (the order in which texts first appear in ``corpus + positives``).
- ``use_faiss``: accepted and ignored; the exact search runs either way (so no ``faiss`` import, and no cap of
  ``range_max`` at FAISS-on-GPU's 2048). Upstream with ``use_faiss=False`` is the function this one equals.
- ``faiss_batch_size``: queries per ``topk_scores`` call; it bounds the ``[batch, window]`` results only.
- ``similarity_fn_name="manhattan"`` raises: the search ranks the normalized embeddings by dot product, which
  orders them as cosine, dot and euclidean similarity do, but not as manhattan distance does.
- Keyword-only extras: ``backend`` (``topk_scores``' backend) and ``score_dtype`` (``torch.float64`` scores
  the float32 embeddings in float64: every selection rule then equals a float64 evaluation of upstream's rules).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from .mining_plan import MiningPlan, as_list
from .mining_rows import build_rows, report
from .mining_select import MISSING, select_negatives

if TYPE_CHECKING:  # sentence-transformers and datasets are imported inside the function, never by `import infcl`
    from datasets import Dataset
    from sentence_transformers import CrossEncoder, SentenceTransformer

# Embedding elements gathered per side in one _pair_scores step: 16 MiB of float32, whatever the corpus size.
PAIR_STEP_ELEMENTS = 1 << 22


def mine_hard_negatives(
    dataset: Dataset,
    model: SentenceTransformer,
    anchor_column_name: str | None = None,
    positive_column_name: str | None = None,
    corpus: list[str] | None = None,
    cross_encoder: CrossEncoder | None = None,
    range_min: int = 0,
    range_max: int | None = None,
    max_score: float | None = None,
    min_score: float | None = None,
    absolute_margin: float | None = None,
    relative_margin: float | None = None,
    num_negatives: int = 3,
    sampling_strategy: Literal["random", "top"] = "top",
    query_prompt_name: str | None = None,
    query_prompt: str | None = None,
    corpus_prompt_name: str | None = None,
    corpus_prompt: str | None = None,
    include_positives: bool = False,
    output_format: Literal["triplet", "n-tuple", "labeled-pair", "labeled-list"] = "triplet",
    output_scores: bool = False,
    batch_size: int = 32,
    faiss_batch_size: int = 16384,
    use_faiss: bool = False,
    use_multi_process: list[str] | bool = False,
    verbose: bool = True,
    cache_folder: str | None = None,
    as_triplets: bool | None = None,
    margin: float | None = None,
    *,
    backend: str = "auto",
    score_dtype: torch.dtype | None = None,
) -> Dataset:
    """Add hard negatives to a dataset of (anchor, positive) pairs: ``sentence_transformers.util.mine_hard_negatives``.

    Every argument is sentence-transformers 6.3's, with its meaning and default (see its docstring); the
    returned ``datasets.Dataset`` has upstream's columns and rows. Extras (keyword-only):

    - ``backend``: the ``infcl.topk_scores`` backend of the corpus search (``"auto"``, ``"torch"``, ``"cpu"``,
      ``"triton"``).
    - ``score_dtype``: dtype of every score (search, window, positives). ``None`` keeps the embeddings' dtype
      (float32, as upstream); ``torch.float64`` decides near-ties as a float64 evaluation of the rules does.

    Search: for each unique query, the ``range_max + max_positives + 1`` corpus entries with the highest ``q . c``
    (normalized embeddings), exactly, equal scores by lower corpus index; memory beyond the embeddings is O(queries x
    window). A query's own text, where the corpus holds it, is never its negative (unless it is also its positive and
    ``include_positives`` keeps it), as in upstream 6.3. ``use_faiss`` is accepted and has no effect (the search is
    exact either way); ``similarity_fn_name="manhattan"`` raises ``ValueError``.
    """
    try:
        from datasets import Dataset
    except ImportError as exc:
        raise ImportError("Please install `datasets` to use this function: `pip install datasets`.") from exc

    plan = MiningPlan.resolve(
        dataset=dataset,
        model=model,
        anchor_column_name=anchor_column_name,
        positive_column_name=positive_column_name,
        cross_encoder=cross_encoder,
        range_min=range_min,
        range_max=range_max,
        max_score=max_score,
        min_score=min_score,
        absolute_margin=absolute_margin,
        relative_margin=relative_margin,
        num_negatives=num_negatives,
        sampling_strategy=sampling_strategy,
        include_positives=include_positives,
        output_format=output_format,
        output_scores=output_scores,
        faiss_batch_size=faiss_batch_size,
        use_faiss=use_faiss,
        verbose=verbose,
        as_triplets=as_triplets,
        margin=margin,
        score_dtype=score_dtype,
    )
    anchor_column_name, positive_column_name = plan.anchor_column_name, plan.positive_column_name

    queries = as_list(dataset[anchor_column_name])
    positives = as_list(dataset[positive_column_name])
    # Upstream's corpus: the given one (a list or a dataset column; else the positives), then the positives,
    # deduplicated in first-seen order. A text's index here is the tie-break order of the search.
    corpus = list(dict.fromkeys((as_list(corpus) if corpus is not None else positives) + positives))
    corpus_idx = {text: idx for idx, text in enumerate(corpus)}
    all_queries = queries
    queries = list(dict.fromkeys(queries))
    queries_idx = {query: idx for idx, query in enumerate(queries)}
    n_queries = len(queries)
    if n_queries != len(all_queries) and verbose:
        print(f"Found {n_queries} unique queries out of {len(all_queries)} total queries.")
    if plan.max_positives > 1 and verbose:
        print(f"Found an average of {np.mean(plan.positives_per_query):.3f} positives per query.")

    query_embeddings, corpus_embeddings = _embed(
        model,
        queries,
        corpus,
        batch_size=batch_size,
        use_multi_process=use_multi_process,
        verbose=verbose,
        cache_folder=cache_folder,
        query_prompt_name=query_prompt_name,
        query_prompt=query_prompt,
        corpus_prompt_name=corpus_prompt_name,
        corpus_prompt=corpus_prompt,
    )
    dtype = score_dtype or torch.as_tensor(query_embeddings[:0]).dtype
    query_embeddings = torch.as_tensor(query_embeddings).to(dtype)
    corpus_embeddings = torch.as_tensor(corpus_embeddings).to(dtype)

    width = plan.window
    windows = _search_windows(
        query_embeddings, corpus_embeddings, width, step=faiss_batch_size, device=model.device, backend=backend
    )

    # Each unique query's positives, as corpus indices in first-seen order (a repeated pair counts once), and
    # the corpus index of its own text (MISSING where the corpus lacks it, or where include_positives keeps a
    # pair whose positive is the query's text).
    positive_indices: list[list[int]] = [[] for _ in range(n_queries)]
    own_text = [corpus_idx.get(query, MISSING) for query in queries]
    for query, positive in zip(all_queries, positives):
        row = positive_indices[queries_idx[query]]
        if corpus_idx[positive] not in row:
            row.append(corpus_idx[positive])
        if plan.include_positives and query == positive:
            own_text[queries_idx[query]] = MISSING
    n_positives = torch.tensor([len(p) for p in positive_indices])
    pair_query = torch.arange(n_queries).repeat_interleave(n_positives)  # the query of each (query, positive) pair
    pair_positive = torch.tensor([idx for row in positive_indices for idx in row], dtype=torch.long)

    window_query = torch.arange(n_queries).repeat_interleave(width)
    scores = _pair_scores(model, query_embeddings, corpus_embeddings, window_query, windows.flatten())
    scores = scores.view(n_queries, width)
    positive_scores = _pair_scores(model, query_embeddings, corpus_embeddings, pair_query, pair_positive)
    del query_embeddings, corpus_embeddings

    if cross_encoder is not None:
        scores, positive_scores = _rescore(
            cross_encoder, queries, corpus, windows, pair_query, pair_positive, scores, batch_size, use_multi_process
        )
    own_text = torch.tensor(own_text, dtype=torch.long).unsqueeze(1)
    scores = scores.masked_fill((windows == MISSING) | (windows == own_text), -float("inf"))

    negatives, negative_scores, log_counters = select_negatives(
        plan, scores, windows, positive_indices, pair_query, positive_scores
    )
    if verbose:
        print("Negative candidates mined, preparing dataset...")

    rows = build_rows(
        plan.output_format,
        output_scores=plan.output_scores,
        anchor_column_name=anchor_column_name,
        positive_column_name=positive_column_name,
        queries=queries,
        corpus=corpus,
        pair_query=pair_query,
        pair_positive=pair_positive,
        positive_scores=positive_scores,
        negatives=negatives,
        negative_scores=negative_scores,
        dataset_length=len(dataset),
    )
    output_dataset = Dataset.from_dict(rows.data)
    if verbose:
        report(plan, rows, positive_scores, log_counters, len(output_dataset))
    return output_dataset


def _embed(model, queries, corpus, *, batch_size, use_multi_process, verbose, cache_folder, **prompts):
    """Upstream's embedding step: its cache files (same names: caches are shared with upstream) and encode calls."""
    query_embeddings = corpus_embeddings = None
    if cache_folder:
        os.makedirs(cache_folder, exist_ok=True)
        model_name = model.model_card_data.base_model or ""
        query_key = (model_name, prompts["query_prompt"], prompts["query_prompt_name"], queries)
        corpus_key = (model_name, prompts["corpus_prompt"], prompts["corpus_prompt_name"], corpus)
        query_cache_file = os.path.join(cache_folder, f"query_embeddings_{_sha256(query_key)}.npy")
        corpus_cache_file = os.path.join(cache_folder, f"corpus_embeddings_{_sha256(corpus_key)}.npy")
        if os.path.exists(query_cache_file):
            query_embeddings = np.load(query_cache_file)
            if verbose:
                print(f"[Cache] Loaded query embeddings from {query_cache_file} (shape={query_embeddings.shape})")
        if os.path.exists(corpus_cache_file):
            corpus_embeddings = np.load(corpus_cache_file)
            if verbose:
                print(f"[Cache] Loaded corpus embeddings from {corpus_cache_file} (shape={corpus_embeddings.shape})")

    if corpus_embeddings is None or query_embeddings is None:
        devices = None if isinstance(use_multi_process, bool) else use_multi_process
        pool = model.start_multi_process_pool(target_devices=devices) if use_multi_process else None
        options = dict(pool=pool, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)

        def encode(method, texts, side: str):
            prompt = dict(prompt_name=prompts[f"{side}_prompt_name"], prompt=prompts[f"{side}_prompt"])
            return method(texts, **options, show_progress_bar=True, **prompt)

        try:
            if corpus_embeddings is None:
                corpus_embeddings = encode(model.encode_document, corpus, "corpus")
            if query_embeddings is None:
                query_embeddings = encode(model.encode_query, queries, "query")
        finally:
            if use_multi_process:
                model.stop_multi_process_pool(pool)

    if cache_folder:
        for path, embeddings, what in (
            (query_cache_file, query_embeddings, "query"),
            (corpus_cache_file, corpus_embeddings, "corpus"),
        ):
            if not os.path.exists(path):
                np.save(path, embeddings)
                if verbose:
                    print(f"[Cache] Saved {what} embeddings to {path}")
    return query_embeddings, corpus_embeddings


def _sha256(key) -> str:
    return hashlib.sha256(repr(key).encode(), usedforsecurity=False).hexdigest()


def _search_windows(query_embeddings, corpus_embeddings, width, *, step, device, backend):
    """``[queries, width]`` corpus indices: each query's ``width`` best entries by dot product, exactly.

    Equal scores: lower corpus index first (``topk_scores``' rule). Slots past the corpus' end hold ``MISSING``.
    One ``topk_scores`` call per ``step`` queries, for the progress bar (upstream's "Computing similarity
    scores", one step per ``faiss_batch_size`` queries).
    """
    from tqdm import trange

    from ..topk import topk_scores

    n_queries, n_corpus = query_embeddings.shape[0], corpus_embeddings.shape[0]
    found = min(width, n_corpus)  # upstream caps its torch.topk at the corpus size and pads the rest
    windows = torch.full((n_queries, width), MISSING, dtype=torch.long)
    corpus_embeddings = corpus_embeddings.to(device)
    for start in trange(0, n_queries, step, desc="Computing similarity scores"):
        chunk = query_embeddings[start : start + step].to(device)
        top = topk_scores(chunk, corpus_embeddings, found, backend=backend)
        windows[start : start + chunk.shape[0], :found] = top.indices.cpu()
    return windows


def _pair_scores(model, query_embeddings, corpus_embeddings, query_rows, corpus_rows):
    """``model.similarity_pairwise(query_embeddings[query_rows], corpus_embeddings[corpus_rows])``, [M].

    In steps of ``PAIR_STEP_ELEMENTS`` gathered elements, so no ``[M, D]`` copy exists. The pairwise function
    scores each pair on its own, so a pair's score does not depend on the step it falls in: a window entry
    and a positive with the same embedding get the same bits. ``MISSING`` corpus rows get -inf.
    """
    dim = query_embeddings.shape[1]
    step = max(1, PAIR_STEP_ELEMENTS // dim)
    parts = []
    for start in range(0, query_rows.numel(), step):
        rows = corpus_rows[start : start + step]
        scores = model.similarity_pairwise(
            query_embeddings[query_rows[start : start + step]], corpus_embeddings[rows.clamp(min=0)]
        ).cpu()
        parts.append(scores.masked_fill(rows == MISSING, -float("inf")))
    if not parts:
        return torch.empty(0, dtype=query_embeddings.dtype)
    return torch.cat(parts)


def _rescore(cross_encoder, queries, corpus, windows, pair_query, pair_positive, scores, batch_size, multi_process):
    """Upstream's cross-encoder rescoring, call for call: one ``predict`` per query over its window, then one over
    every (query, positive) pair. A window slot past the corpus' end is scored as upstream scores it (index -1:
    the last corpus text), so every ``predict`` batch is upstream's; its score is set to -inf afterwards."""
    from tqdm.autonotebook import tqdm

    devices = None if isinstance(multi_process, bool) else multi_process
    pool = cross_encoder.start_multi_process_pool(target_devices=devices) if multi_process else None
    scores = scores.clone()
    try:
        for idx, window in tqdm(enumerate(windows.tolist()), desc="Rescoring with CrossEncoder", total=len(windows)):
            pairs = [(queries[idx], corpus[candidate]) for candidate in window]
            predicted = cross_encoder.predict(pairs, batch_size=batch_size, convert_to_tensor=True, pool=pool)
            scores[idx] = predicted.cpu()
        pairs = [(queries[q], corpus[p]) for q, p in zip(pair_query.tolist(), pair_positive.tolist())]
        positive_scores = cross_encoder.predict(pairs, batch_size=batch_size, convert_to_tensor=True, pool=pool)
    finally:
        if multi_process:
            cross_encoder.stop_multi_process_pool(pool)
    return scores, positive_scores.cpu().to(scores.dtype)
