"""Smoke test of the benchmark CLI: one tiny configuration end to end (no timing assertions).

It calls ``bench.__main__.main`` with command-line arguments in this process (the worker processes
are still forked per configuration), which saves a second ``import torch``.
"""

import csv

import pytest

from bench.__main__ import main
from bench.report import COLUMNS

MODES = {"forward", "backward", "forward+backward"}
METHODS = ("torch", "vanilla")


@pytest.mark.parametrize("loss,symmetric", (("clip", "True"), ("siglip", "False")))
def test_bench_cli_writes_csv_and_plot(tmp_path, monkeypatch, capsys, loss, symmetric):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")  # the CLI sets these for its workers; restored afterwards
    argv = ["--batch-sizes", "64", "--dims", "8", "--repeats", "1", "--methods", ",".join(METHODS),
            "--threads", "1", "--out", str(tmp_path), "--name", "smoke", "--loss", loss]
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().out

    with open(tmp_path / "smoke.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    assert sorted((r["method"], r["mode"]) for r in rows) == sorted((m, mode) for m in METHODS for mode in MODES)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["loss"] == loss
        assert (row["batch"], row["dim"], row["symmetric"], row["dtype"]) == ("64", "8", symmetric, "float32")
        assert float(row["time_s"]) > 0 and float(row["peak_extra_mib"]) >= 0
        assert float(row["gemm_gflops"]) > 0 and float(row["time_vs_gemm_bound"]) > 0
        assert float(row["time_vs_vanilla"]) > 0
    assert all(float(r["time_vs_vanilla"]) == 1 for r in rows if r["method"] == "vanilla")
    assert (tmp_path / "smoke.png").stat().st_size > 0
