"""Smoke test of the benchmark CLI: one tiny configuration end to end (no timing assertions).

It calls ``bench.__main__.main`` with command-line arguments in this process (the worker processes
are still forked per configuration), which saves a second ``import torch``.
"""

import csv

import pytest
import torch

from bench import machine, measure
from bench.__main__ import main
from bench.gemm import best_route, gemm_routes, probe_rates
from bench.measure import Step, time_interleaved
from bench.report import COLUMNS

MODES = {"forward", "backward", "forward+backward"}
METHODS = ("torch", "vanilla")


@pytest.mark.parametrize("loss,symmetric", (("clip", "True"), ("siglip", "False")))
def test_bench_cli_writes_csv_and_plot(tmp_path, monkeypatch, capsys, loss, symmetric):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")  # the CLI sets these for its workers; restored afterwards
    argv = [
        "--batch-sizes",
        "64",
        "--dims",
        "8",
        "--repeats",
        "1",
        "--methods",
        ",".join(METHODS),
        "--threads",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "smoke",
        "--loss",
        loss,
    ]
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


def _run(tmp_path, monkeypatch, *extra):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")
    argv = [
        "--batch-sizes",
        "64",
        "--dims",
        "8",
        "--repeats",
        "1",
        "--modes",
        "forward",
        "--methods",
        ",".join(METHODS),
        "--threads",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "smoke",
        *extra,
    ]
    assert main(argv) == 0
    with open(tmp_path / "smoke.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_bf16_bound_takes_the_faster_matmul_route_and_says_which(tmp_path, monkeypatch):
    rows = _run(tmp_path, monkeypatch, "--dtype", "bfloat16")
    assert sorted(r["method"] for r in rows) == sorted(METHODS)
    for row in rows:
        assert row["status"] == "ok", row
        assert row["gemm_route"] in ("bfloat16", "float32") and float(row["gemm_gflops"]) > 0


def test_configuration_over_the_time_budget_is_skipped_with_its_estimate(tmp_path, monkeypatch):
    for var in machine.AVX2_PROXY_ENV:
        monkeypatch.setenv(var, "")  # --avx2-proxy sets them; monkeypatch restores them afterwards
    rows = _run(tmp_path, monkeypatch, "--dtype", "bfloat16", "--time-budget", "1e-9", "--avx2-proxy")
    assert sorted(r["method"] for r in rows) == sorted(METHODS)
    for row in rows:
        assert row["status"] == "skipped" and "estimated" in row["note"] and "--time-budget" in row["note"], row
        assert row["device_name"].endswith("[AVX2 proxy]")


def test_probe_rates_and_route_choice():
    assert gemm_routes(torch.float32) == [torch.float32]
    assert gemm_routes(torch.bfloat16) == [torch.bfloat16, torch.float32]
    assert best_route({"bfloat16": 0.5, "float32": 150.0}) == "float32"
    assert best_route({"bfloat16": 900.0, "float32": 150.0}) == "bfloat16"
    assert best_route({"float32": float("nan")}) == "float32"
    rates = probe_rates(64, 8, torch.bfloat16, torch.device("cpu"))
    assert set(rates) == {"bfloat16", "float32"} and all(r > 0 for r in rates.values())


def test_long_runs_print_progress(monkeypatch):
    monkeypatch.setattr(measure, "PROGRESS_AFTER_S", 0.0)
    lines = []
    step = Step(lambda: None, lambda _: None)
    times = time_interleaved({"a": step, "b": step}, torch.device("cpu"), warmup=1, repeats=2, progress=lines.append)
    assert [len(t) for t in times.values()] == [2, 2]
    assert len(lines) == 3 and lines[0].startswith("warmup round 1/3: a ") and lines[-1].startswith("timed round 3/3")


def test_avx2_proxy_is_named_in_the_machine(monkeypatch):
    for var in machine.AVX2_PROXY_ENV:
        monkeypatch.delenv(var, raising=False)
    assert "AVX2 proxy" not in machine.cpu_name()
    for var, value in machine.AVX2_PROXY_ENV.items():
        monkeypatch.setenv(var, value)
    assert machine.cpu_name().endswith("[AVX2 proxy]")
