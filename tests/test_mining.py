"""``infcl.sentence_transformers.mine_hard_negatives`` on fixed embeddings: the float64 truth of the rules.

A stand-in model (fixed float32 embeddings per text, sentence-transformers' own similarity functions) makes
data where the rules' decisions sit 1e-9 from a tie: twins whose embeddings differ by a few float32 ulps in
one component. There float32 (upstream's arithmetic) decides either way, so the drop-in with
``score_dtype=torch.float64`` is held to the float64 truth of tests/helpers/mining_truth.py, and upstream is
shown to differ from it. Exact ties, sampling, arguments and errors are here too; the comparison with
sentence-transformers on a real MiniLM is tests/test_mining_minilm.py.
"""

import inspect
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import mining_truth

datasets = pytest.importorskip("datasets")
st_util = pytest.importorskip("sentence_transformers.util")

from infcl.sentence_transformers import mine_hard_negatives  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM = 24
N_QUERIES = 12
N_BASE = 60  # random documents; each gets a twin a few ulps away


class FixedModel:
    """What mine_hard_negatives uses of a SentenceTransformer: encode_document / encode_query (a fixed float32
    embedding per text), similarity / similarity_pairwise (sentence-transformers' functions of the name),
    device and model_card_data. ``matrix_calls`` counts full similarity matrices asked for."""

    def __init__(self, table, similarity_fn_name="dot"):
        self.table = table
        self.similarity_fn_name = similarity_fn_name
        self.device = torch.device("cpu")
        self.model_card_data = SimpleNamespace(base_model=None)
        self.matrix_calls = 0
        self._pairwise = st_util.SimilarityFunction.to_similarity_pairwise_fn(similarity_fn_name)
        self._matrix = st_util.SimilarityFunction.to_similarity_fn(similarity_fn_name)

    def encode_document(self, texts, **kwargs):
        return np.stack([self.table[t] for t in texts])

    encode_query = encode_document

    def similarity(self, a, b):
        self.matrix_calls += 1
        return self._matrix(a, b)

    def similarity_pairwise(self, a, b):
        return self._pairwise(a, b)


def _unit(rng, n):
    x = rng.standard_normal((n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _twin(vector, rng):
    """The vector with one component moved 1-3 float32 ulps: scores move by ~1e-9, far below float32's error."""
    twin = vector.copy()
    j = rng.integers(DIM)
    for _ in range(rng.integers(1, 4)):
        twin[j] = np.nextafter(twin[j], np.float32(np.inf if rng.random() < 0.5 else -np.inf))
    return twin


def near_tie_data(seed=0):
    """(dataset, model, query texts, corpus texts): 12 queries (3 with two positives), each positive with a
    near twin in the corpus, 60 documents with near twins."""
    rng = np.random.default_rng(seed)
    table = {}
    queries = [f"q{i}" for i in range(N_QUERIES)]
    for name, vector in zip(queries, _unit(rng, N_QUERIES)):
        table[name] = vector
    rows_q, rows_p = [], []
    for i, q in enumerate(queries):
        # the positive: near the query, so that it ranks high and its twin sits in the window
        for k in range(1 + (i % 4 == 0)):
            p = f"p{i}.{k}"
            mix = table[q] + 0.6 * _unit(rng, 1)[0]
            table[p] = (mix / np.linalg.norm(mix)).astype(np.float32)
            table[p + "~"] = _twin(table[p], rng)
            rows_q.append(q)
            rows_p.append(p)
    corpus = []
    for i, vector in enumerate(_unit(rng, N_BASE)):
        table[f"d{i}"], table[f"d{i}~"] = vector, _twin(vector, rng)
        corpus += [f"d{i}", f"d{i}~"]
    corpus += [p + "~" for p in rows_p]
    dataset = datasets.Dataset.from_dict({"query": rows_q, "answer": rows_p})
    return dataset, FixedModel(table), corpus


def negatives_by_query(dataset, anchor="query", documents="answer"):
    """{anchor: [negative texts]} from a labeled-list dataset (each row: [positive, negatives...])."""
    return {row[anchor]: row[documents][1:] for row in dataset}


def truth_negatives(dataset, model, corpus, rng=None, **rules):
    return mining_truth.truth_negatives(
        dataset["query"], dataset["answer"], corpus, model.encode_query, model.encode_document, rng, **rules
    )


def mine(dataset, model, corpus, **kwargs):
    kwargs.setdefault("output_format", "labeled-list")
    return mine_hard_negatives(dataset, model, corpus=corpus, verbose=False, **kwargs)


def _with_empty(found, dataset):
    return {q: found.get(q, []) for q in dataset["query"]}


NEAR_TIE_RULES = [
    dict(num_negatives=5),
    dict(num_negatives=4, absolute_margin=0.0),
    dict(num_negatives=4, relative_margin=0.0, range_max=16),
    dict(num_negatives=3, absolute_margin=0.02, range_min=1, range_max=12),
    dict(num_negatives=6, range_min=2, range_max=14, sampling_strategy="random"),
]


def test_near_ties_follow_the_float64_truth():
    """score_dtype=float64: every decision equals the float64 truth's, on data where float32 flips some."""
    dataset, model, corpus = near_tie_data()
    upstream_differs = 0
    for rules in NEAR_TIE_RULES:
        random.seed(11)
        ours = _with_empty(
            negatives_by_query(mine(dataset, model, corpus, score_dtype=torch.float64, **rules)), dataset
        )
        truth = truth_negatives(dataset, model, corpus, rng=random.Random(11), **rules)
        assert ours == truth, rules
        random.seed(11)
        upstream = st_util.mine_hard_negatives(
            dataset, model, corpus=corpus, output_format="labeled-list", verbose=False, **rules
        )
        upstream_differs += _with_empty(negatives_by_query(upstream), dataset) != truth
    assert upstream_differs > 0, "the data has no near-tie that float32 decides against the truth"


def test_max_score_near_tie():
    """A bound 1e-10 above a window score keeps it (s > max_score is false in float64)."""
    dataset, model, corpus = near_tie_data()
    scores = mining_truth.exact_scores(model.encode_query(["q0"]), model.encode_document(corpus))[0]
    bound = float(np.sort(scores)[-4]) + 1e-10
    rules = dict(num_negatives=4, max_score=bound, min_score=float(np.sort(scores)[-30]) - 1e-10)
    ours = _with_empty(negatives_by_query(mine(dataset, model, corpus, score_dtype=torch.float64, **rules)), dataset)
    assert ours == truth_negatives(dataset, model, corpus, **rules)


def test_exact_ties_rank_the_lower_corpus_index_first():
    """Identical embeddings under different texts: the earlier text first; an exact copy of the positive ties
    it and survives absolute_margin=0 (``s + 0 > p`` is false), as the truth says. In float32 too: a window
    score and a positive score come from the same pairwise arithmetic, so equal embeddings give equal bits."""
    dataset, model, corpus = tie_free_data()
    table = dict(model.table)
    copies = []
    for i in range(0, len(corpus), 3):
        table[f"d{i}="] = table[f"d{i}"]  # after d{i} in the corpus: ranks right after it
        copies.append(f"d{i}=")
    for p in dataset["answer"][:6]:
        table[p + "="] = table[p]
        copies.append(p + "=")
    model = FixedModel(table)
    corpus = corpus + copies
    for rules in (dict(num_negatives=8), dict(num_negatives=6, absolute_margin=0.0)):
        for dtype in (None, torch.float64):
            ours = negatives_by_query(mine(dataset, model, corpus, score_dtype=dtype, **rules))
            assert _with_empty(ours, dataset) == truth_negatives(dataset, model, corpus, **dict(rules)), (rules, dtype)
    kept = negatives_by_query(mine(dataset, model, corpus, num_negatives=6, absolute_margin=0.0))
    assert any(p + "=" in kept.get(q, []) for q, p in zip(dataset["query"][:6], dataset["answer"][:6]))
    assert any(f"d{i}=" in sum(kept.values(), []) for i in range(0, len(corpus), 3))


def tie_free_data(n_queries=20, n_docs=50, seed=3, similarity_fn_name="dot"):
    rng = np.random.default_rng(seed)
    table = {}
    queries, answers = [], []
    for i, q in enumerate(_unit(rng, n_queries)):
        table[f"q{i}"] = q
        mix = q + 0.8 * _unit(rng, 1)[0]
        table[f"p{i}"] = (mix / np.linalg.norm(mix)).astype(np.float32)
        queries.append(f"q{i}")
        answers.append(f"p{i}")
    corpus = []
    for i, d in enumerate(_unit(rng, n_docs)):
        table[f"d{i}"] = d
        corpus.append(f"d{i}")
    dataset = datasets.Dataset.from_dict({"query": queries, "answer": answers})
    return dataset, FixedModel(table, similarity_fn_name), corpus


@pytest.mark.parametrize("similarity_fn_name", ["dot", "cosine", "euclidean"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(output_format="n-tuple", output_scores=True, num_negatives=4, max_score=0.6, min_score=-0.2),
        dict(output_format="labeled-pair", output_scores=True, relative_margin=0.1, range_min=3, range_max=40),
        dict(output_format="labeled-list", sampling_strategy="random", num_negatives=4, range_max=30),
        dict(output_format="triplet", range_max=80, num_negatives=10),  # window (81) past the corpus (70): -1 slots
    ],
)
def test_same_rows_as_upstream_on_fixed_embeddings(similarity_fn_name, kwargs):
    """Tie-free data: upstream's rows, never a full similarity matrix, any faiss_batch_size."""
    dataset, model, corpus = tie_free_data(similarity_fn_name=similarity_fn_name)
    scores = mining_truth.exact_scores(model.encode_query(dataset["query"]), model.encode_document(corpus))
    bounds = {k: v for k, v in kwargs.items() if k in ("max_score", "min_score", "relative_margin")}
    assert mining_truth.smallest_gap(scores, [[0]] * len(scores), 82, **bounds) > 1e-6  # tie-free: 10x float32 error
    random.seed(5)
    upstream = st_util.mine_hard_negatives(dataset, model, corpus=corpus, verbose=False, **kwargs).to_dict()
    model.matrix_calls = 0
    for step in (16384, 7):
        random.seed(5)
        ours = mine_hard_negatives(dataset, model, corpus=corpus, verbose=False, faiss_batch_size=step, **kwargs)
        assert model.matrix_calls == 0
        ours = ours.to_dict()
        assert list(ours) == list(upstream)
        for column in ours:
            if column in ("scores", "score"):
                np.testing.assert_allclose(np.asarray(ours[column]), np.asarray(upstream[column]), atol=1e-6, rtol=0)
            else:
                assert ours[column] == upstream[column], column


def test_margin_changes_the_rows():
    """The comparison can fail: a different margin or seed gives different rows."""
    dataset, model, corpus = tie_free_data()
    base = mine(dataset, model, corpus, absolute_margin=0.0).to_dict()
    assert mine(dataset, model, corpus, absolute_margin=0.3).to_dict() != base
    random.seed(1)
    one = mine(dataset, model, corpus, sampling_strategy="random", range_max=30).to_dict()
    random.seed(2)
    assert mine(dataset, model, corpus, sampling_strategy="random", range_max=30).to_dict() != one


def test_use_faiss_is_the_exact_search():
    dataset, model, corpus = tie_free_data()
    plain = mine(dataset, model, corpus).to_dict()
    assert mine(dataset, model, corpus, use_faiss=True).to_dict() == plain
    assert "faiss" not in sys.modules


def test_backends_agree():
    dataset, model, corpus = tie_free_data()
    rows = [mine(dataset, model, corpus, backend=b, relative_margin=0.05).to_dict() for b in ("torch", "auto")]
    assert rows[0] == rows[1]


def test_signature_is_upstreams_plus_keyword_extras():
    ours = list(inspect.signature(mine_hard_negatives).parameters.values())
    theirs = list(inspect.signature(st_util.mine_hard_negatives).parameters.values())
    assert [(p.name, p.default, p.kind) for p in ours[: len(theirs)]] == [(p.name, p.default, p.kind) for p in theirs]
    assert [(p.name, p.kind) for p in ours[len(theirs) :]] == [
        ("backend", inspect.Parameter.KEYWORD_ONLY),
        ("score_dtype", inspect.Parameter.KEYWORD_ONLY),
    ]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_negatives=0), ValueError, "num_negatives must be at least 1"),
        (dict(range_min=5, range_max=5), ValueError, "range_min must be smaller than range_max"),
        (dict(range_min=-1, range_max=5), ValueError, "range_min must be non-negative"),
        (dict(range_max=4, num_negatives=5), ValueError, "Cannot mine 5 negatives"),
        (dict(output_format="pairs"), ValueError, "Invalid output_format"),
        (dict(sampling_strategy="best"), ValueError, "sampling_strategy must be"),
        (dict(faiss_batch_size=0), ValueError, "faiss_batch_size must be a positive integer"),
        (dict(score_dtype=torch.float16), TypeError, "score_dtype"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    dataset, model, corpus = tie_free_data()
    with pytest.raises(error, match=match):
        mine(dataset, model, corpus, **kwargs)


def test_manhattan_and_empty_dataset_raise():
    dataset, model, corpus = tie_free_data(similarity_fn_name="manhattan")
    with pytest.raises(ValueError, match="similarity_fn_name='manhattan' is not supported"):
        mine(dataset, model, corpus)
    empty = datasets.Dataset.from_dict({"query": [], "answer": []})
    with pytest.raises(ValueError, match="The dataset is empty"):
        mine(empty, model, corpus)


def test_import_infcl_does_not_import_sentence_transformers():
    code = (
        "import sys, infcl, infcl.topk; assert not {'sentence_transformers', 'datasets'} & set(sys.modules), 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(as_triplets=False, margin=0.1),
        dict(include_positives=True, range_min=1, range_max=10),
        dict(output_format="n-tuple-scores", num_negatives=2),
    ],
)
def test_same_warnings_and_report_as_upstream(kwargs, caplog, capsys):
    """The deprecations and include_positives' notes are logged as upstream logs them; verbose prints the same."""
    dataset, model, corpus = tie_free_data()
    logged = {}
    for name, function in (("upstream", st_util.mine_hard_negatives), ("ours", mine_hard_negatives)):
        caplog.clear()
        capsys.readouterr()
        function(dataset, model, corpus=corpus, verbose=True, **kwargs)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        logged[name] = (warnings, capsys.readouterr().out)
    assert logged["ours"] == logged["upstream"]
    assert logged["ours"][0] and "Metric" in logged["ours"][1]


def test_named_columns_among_others():
    """anchor_column_name / positive_column_name pick the columns; the others are not in the output."""
    dataset, model, corpus = tie_free_data()
    named = datasets.Dataset.from_dict(
        {"id": list(range(len(dataset))), "doc": dataset["answer"], "question": dataset["query"]}
    )
    kwargs = dict(anchor_column_name="question", positive_column_name="doc", output_format="n-tuple", corpus=corpus)
    random.seed(0)
    upstream = st_util.mine_hard_negatives(named, model, verbose=False, **kwargs).to_dict()
    ours = mine_hard_negatives(named, model, verbose=False, **kwargs).to_dict()
    assert ours == upstream and list(ours)[:2] == ["question", "doc"]
