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


def test_bench_ids_on_the_native_kernel_against_its_own_plain_run(tmp_path, monkeypatch):
    import pytest
    import torch

    from infcl.backends.native import unavailable_reason

    if unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(f"native kernel unavailable: {unavailable_reason(torch.device('cpu'))}")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")
    argv = ["--batch-sizes", "64", "--dims", "8", "--repeats", "1", "--methods", "cpu", "--modes", "forward+backward",
            "--ids", "--threads", "1", "--out", str(tmp_path), "--name", "native-masks"]
    assert main(argv) == 0
    with open(tmp_path / "native-masks.csv", newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    # The native kernel is its own baseline: no torch run joins.
    assert set(rows) == {"cpu", "cpu+ids"}
    assert rows["cpu+ids"]["status"] == "ok", rows["cpu+ids"]
    ratio = float(rows["cpu+ids"]["time_vs_plain"])
    # Against the cpu row's own time (up to the CSV's rounding), not the torch tiles'.
    assert ratio == pytest.approx(float(rows["cpu+ids"]["time_s"]) / float(rows["cpu"]["time_s"]), rel=1e-3)
