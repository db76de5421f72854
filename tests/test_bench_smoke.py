"""Smoke test of the benchmark CLI: one tiny configuration end to end (no timing assertions)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"forward", "backward", "forward+backward"}


def test_bench_cli_writes_csv_and_plot(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "bench", "--batch-sizes", "64", "--dims", "8", "--repeats", "1",
           "--methods", "torch,vanilla", "--threads", "1", "--out", str(tmp_path), "--name", "smoke"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    from bench.report import COLUMNS

    with open(tmp_path / "smoke.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == COLUMNS
        rows = list(reader)
    measured = [r for r in rows if r["method"] in ("torch", "vanilla")]
    assert {(r["method"], r["mode"]) for r in measured} == {(m, mode) for m in ("torch", "vanilla") for mode in MODES}
    for row in measured:
        assert row["status"] == "ok", row
        assert (row["batch"], row["dim"], row["symmetric"], row["dtype"]) == ("64", "8", "True", "float32")
        assert float(row["time_s"]) > 0 and float(row["peak_extra_mib"]) >= 0
        assert float(row["gemm_gflops"]) > 0 and float(row["time_vs_gemm_bound"]) > 0
        assert float(row["time_vs_vanilla"]) > 0
    assert len(rows) == len(measured), "only the requested methods appear"
    assert (tmp_path / "smoke.png").stat().st_size > 0
