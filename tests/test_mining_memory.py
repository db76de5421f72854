"""The memory claim of ``mine_hard_negatives``: no queries x corpus scores, only per-query windows.

Each measurement runs in a fresh subprocess (the resident set's high-water mark, as tests/test_memory.py):
the embeddings, the model stand-in and the dataset exist before the probe; the probe covers one call.
2000 queries x 40000 documents: the scores would be 320 MB of float32 (sentence-transformers' search holds
them, chunked by faiss_batch_size = 16384 queries); the drop-in's windows are 2000 x 4 entries.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers.support import PEAK_PROBE

pytestmark = pytest.mark.slow
pytest.importorskip("datasets")
pytest.importorskip("sentence_transformers")

N_QUERIES, N_CORPUS, DIM = 2000, 40000, 32
MATRIX_BYTES = N_QUERIES * N_CORPUS * 4

_MEASURE = (
    PEAK_PROBE
    + r"""
import json, sys
import numpy as np, torch
from types import SimpleNamespace
import datasets
from sentence_transformers import util

which, n_queries, n_corpus, dim = sys.argv[1], *map(int, sys.argv[2:5])
torch.set_num_threads(1)
rng = np.random.default_rng(0)
def unit(n):
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)
query_embeddings, corpus_embeddings = unit(n_queries), unit(n_corpus)
queries = [f"q{i}" for i in range(n_queries)]
corpus = [f"d{i}" for i in range(n_corpus)]

class Model:  # encode returns the prepared arrays: the probe sees the search, not the embedding
    similarity_fn_name = "dot"
    device = torch.device("cpu")
    model_card_data = SimpleNamespace(base_model=None)
    def encode_query(self, texts, **kwargs):
        return query_embeddings[: len(texts)]  # a view
    def encode_document(self, texts, **kwargs):
        return corpus_embeddings[: len(texts)]
    similarity = staticmethod(util.dot_score)
    similarity_pairwise = staticmethod(util.pairwise_dot_score)

dataset = datasets.Dataset.from_dict({"query": queries, "answer": corpus[:n_queries]})
if which == "infcl":
    from infcl.sentence_transformers import mine_hard_negatives
else:
    mine_hard_negatives = util.mine_hard_negatives
small = datasets.Dataset.from_dict({"query": queries[:8], "answer": corpus[:8]})
mine_hard_negatives(small, Model(), corpus=corpus[:64], verbose=False)  # warm-up: imports, thread pools, kernels
print(json.dumps({"extra_bytes": peak_extra_bytes(
    lambda: mine_hard_negatives(dataset, Model(), corpus=corpus, verbose=False))}))
"""
)


def peak_extra_bytes(which):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [which, str(N_QUERIES), str(N_CORPUS), str(DIM)]
    out = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]


def test_no_queries_x_corpus_scores():
    ours = peak_extra_bytes("infcl")
    upstream = peak_extra_bytes("sentence_transformers")
    # upstream holds the 2000 x 40000 scores (the measurement sees them); ours stays far below them
    assert upstream >= MATRIX_BYTES * 0.9, (upstream, MATRIX_BYTES)
    assert ours <= MATRIX_BYTES / 8, (ours, MATRIX_BYTES)
