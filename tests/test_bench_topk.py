"""Smoke test of ``python -m bench.topk scale``: topk_scores and the emulation of sentence-transformers'
chunked search run on the same embeddings, their rows agree, and upstream's search is the float64 truth's
(tie-free random embeddings: torch.topk's arbitrary tie order cannot show)."""

import sys

import pytest
import torch

from bench import topk
from helpers.topk_truth import topk_truth

pytestmark = pytest.mark.slow  # imports sentence-transformers: ~30 s on 2 shared cores


def test_scale_runs_both_searches(monkeypatch, capsys, tmp_path):
    out = tmp_path / "scale.csv"
    argv = ["bench.topk", "scale", "--queries", "70", "--corpus", "300", "--dim", "16", "--n", "5"]
    monkeypatch.setattr(sys, "argv", argv + ["--upstream-batch", "32", "--threads", "1", "--csv", str(out)])
    topk.main()
    assert "100.0000% rows agree" in capsys.readouterr().out
    lines = out.read_text().splitlines()
    assert [line.split(",")[6] for line in lines[1:]] == [
        "infcl topk_scores auto",
        "upstream chunked (batch 32)",
        "  upstream / infcl",
    ]


def test_upstream_search_is_the_truth_on_tie_free_rows():
    queries, corpus = topk.embeddings(40, 12, 0, "cpu"), topk.embeddings(90, 12, 1, "cpu")
    scores, indices = topk.upstream_search(queries, corpus, 7, batch=16)
    want_scores, want_index = topk_truth(queries, corpus, 7)
    assert torch.equal(indices, want_index)
    torch.testing.assert_close(scores.double(), want_scores, atol=1e-5, rtol=0)
