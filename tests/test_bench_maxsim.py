"""``python -m bench --preset late-interaction`` at a tiny size: it runs sentence-transformers' loss and infcl's on both
CPU backends (the default) and writes its table and CSV, with the token-product and GEMM rates."""

import csv

import pytest

pytest.importorskip("sentence_transformers")

from bench.__main__ import main  # noqa: E402


@pytest.mark.slow  # importing sentence-transformers takes most of its ~20 s
def test_late_interaction_preset_writes_its_table(tmp_path, capsys):
    out = tmp_path / "maxsim.csv"
    args = ["--preset", "late-interaction", "--batch", "6", "--lq", "3", "--ld", "5", "--dim", "4", "--repeats", "1"]
    assert main(args + ["--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 6 | cpu |" in printed and "| 6 | torch |" in printed
    rows = list(csv.DictReader(open(out)))
    assert [row["backend"] for row in rows] == ["cpu", "torch"]
    for row in rows:
        assert float(row["ours_s"]) > 0 and float(row["theirs_s"]) > 0
        assert float(row["product_gflops"]) > 0 and float(row["gemm_gflops"]) > 0
