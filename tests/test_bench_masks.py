"""Smoke test of ``python -m bench --ids --guide``: the mask options' rows and their cost columns (no timing
assertions; see tests/test_bench_smoke.py for the CLI's common path)."""

import csv

from bench.__main__ import main


def test_bench_ids_and_guide_rows(tmp_path, monkeypatch, capsys):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")
    argv = ["--batch-sizes", "64", "--dims", "8", "--repeats", "1", "--methods", "vanilla", "--modes",
            "forward+backward", "--ids", "--guide", "--threads", "1", "--out", str(tmp_path), "--name", "masks"]
    assert main(argv) == 0
    assert "time_vs_plain" in capsys.readouterr().out
    with open(tmp_path / "masks.csv", newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    # "torch" joins the run as the mask options' baseline even though --methods named only vanilla.
    assert set(rows) == {"vanilla", "torch", "torch+ids", "torch+guide"}
    for name in ("torch+ids", "torch+guide"):
        assert rows[name]["status"] == "ok", rows[name]
        assert float(rows[name]["time_vs_plain"]) > 0
        # memory_vs_plain is empty where the plain run's extra memory rounds to 0 MiB (tiny B)
        assert rows[name]["memory_vs_plain"] == "" or float(rows[name]["memory_vs_plain"]) > 0
    assert rows["torch"]["time_vs_plain"] == "" and rows["vanilla"]["time_vs_plain"] == ""
