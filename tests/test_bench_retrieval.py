"""Smoke test of ``python -m bench.retrieval scale --rows``: a slice of rows ranked against every column, its
metrics those of the slice (ids make each image's own text its positive), and the time scaled to the whole."""

import ast
import sys

import pytest

from bench import retrieval
from helpers.exact_scores import truth_scores


@pytest.mark.parametrize("rows", [64, 256])
def test_scale_rows_ranks_a_slice_and_extrapolates(rows, monkeypatch, capsys, tmp_path):
    out = tmp_path / "scale.csv"
    argv = ["bench.retrieval", "scale", "--n", "256", "--dim", "16", "--rows", str(rows), "--backend", "torch"]
    monkeypatch.setattr(sys, "argv", argv + ["--threads", "1", "--csv", str(out)])
    retrieval.main()
    printed = capsys.readouterr().out
    metrics = ast.literal_eval(printed.splitlines()[0])
    image, text = retrieval._features(256, 16)
    scores = truth_scores(image[:rows], text)  # exactly rounded float64
    rank = (scores > scores.diagonal()[:, None]).sum(1).double()  # float64 truth: no ties in random features
    assert metrics["image_to_text_mean_rank"] == pytest.approx(float(rank.mean()) + 1, abs=1e-6)
    for k in (1, 5, 10):
        assert metrics[f"image_to_text_R@{k}"] == pytest.approx(float((rank < k).double().mean()), abs=1e-6)
    lines = out.read_text().splitlines()
    assert lines[1].split(",")[4] == f"retrieval_metrics torch {rows} x 256"
    timed = float(lines[1].split(",")[5])
    if rows < 256:
        assert "extrapolated 256 x 256" in lines[2]
        assert float(lines[2].split(",")[5]) == pytest.approx(timed * 256 / rows)
    else:
        assert len(lines) == 2


def test_scale_rows_out_of_range(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench.retrieval", "scale", "--n", "32", "--rows", "33"])
    with pytest.raises(SystemExit, match="--rows"):
        retrieval.main()
