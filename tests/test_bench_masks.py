"""Smoke test of ``python -m bench --ids --guide``: the mask options' rows and their cost columns (no timing
assertions; see tests/test_bench_smoke.py for the CLI's common path)."""

import csv

import pytest

from bench.__main__ import main


def test_bench_ids_and_guide_rows(tmp_path, monkeypatch, capsys):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")
    argv = [
        "--batch-sizes",
        "64",
        "--dims",
        "8",
        "--repeats",
        "1",
        "--methods",
        "vanilla",
        "--modes",
        "forward+backward",
        "--ids",
        "--guide",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "masks",
    ]
    assert main(argv) == 0
    assert "time_vs_plain" in capsys.readouterr().out
    with open(tmp_path / "masks.csv", newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    # "torch" joins the run as the mask options' baseline even though --methods named only vanilla.
    assert set(rows) == {"vanilla", "torch", "torch+ids", "torch+guide"}
    for name in ("torch+ids", "torch+guide"):
        assert rows[name]["status"] == "ok", rows[name]
        assert float(rows[name]["time_vs_plain"]) > 0
        # memory_vs_plain: this row's peak extra memory over the plain torch row's, empty where that rounds to
        # 0 MiB; at this tiny B either can (allocator noise), so only the ratio's source is checked.
        plain_mib, mib = float(rows["torch"]["peak_extra_mib"]), float(rows[name]["peak_extra_mib"])
        if plain_mib == 0:
            assert rows[name]["memory_vs_plain"] == "", rows[name]
        else:
            assert float(rows[name]["memory_vs_plain"]) == pytest.approx(mib / plain_mib, rel=1e-3, abs=1e-6)
    assert rows["torch"]["time_vs_plain"] == "" and rows["vanilla"]["time_vs_plain"] == ""


def test_bench_ids_on_the_native_kernel_against_its_own_plain_run(tmp_path, monkeypatch):
    import torch

    from infcl.backends.native import unavailable_reason

    if unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(f"native kernel unavailable: {unavailable_reason(torch.device('cpu'))}")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")
    argv = [
        "--batch-sizes",
        "64",
        "--dims",
        "8",
        "--repeats",
        "1",
        "--methods",
        "cpu",
        "--modes",
        "forward+backward",
        "--ids",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
        "--name",
        "native-masks",
    ]
    assert main(argv) == 0
    with open(tmp_path / "native-masks.csv", newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    # The native kernel is its own baseline: no torch run joins.
    assert set(rows) == {"cpu", "cpu+ids"}
    assert rows["cpu+ids"]["status"] == "ok", rows["cpu+ids"]
    ratio = float(rows["cpu+ids"]["time_vs_plain"])
    # Against the cpu row's own time (up to the CSV's rounding), not the torch tiles'.
    assert ratio == pytest.approx(float(rows["cpu+ids"]["time_s"]) / float(rows["cpu"]["time_s"]), rel=1e-3)


_TRITON_GEMMS = r"""
import json, sys, torch
sys.path[:0] = [".", "tests"]  # run from the repository root: bench and the tests' helpers
from helpers import triton_compile
from bench.methods import gemm_equivalents
with triton_compile.compile_only(90):  # sm_90's default configs, as on an H100
    device, names = torch.device("cuda"), ("triton", "triton+ids", "triton+guide")
    print(json.dumps({name: [gemm_equivalents(name, "clip", mode, device, torch.bfloat16, 256, True)
                             for mode in ("forward", "backward")] for name in names}))
"""


@pytest.mark.compile
def test_triton_mask_methods_count_the_masked_kernels_products():
    # Run apart: the compile-only stand-in stays Triton's active driver once set.
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_GEMMS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    # D = 256: one 256-wide dq (dk) slice each, ids or not: S once forward, S twice and two products backward.
    assert counts["triton"] == counts["triton+ids"] == [1, 4]
    # A guide of width D adds its product wherever S is formed: forward 2; backward 2 per slice plus the two
    # products, whatever the masked configs' slice width.
    forward, backward = counts["triton+guide"]
    assert forward == 2 and backward >= 6 and (backward - 2) % 2 == 0, counts
