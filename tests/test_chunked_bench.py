"""``python -m bench.gpu_ab --dry-run``: the chunked route's GPU A/B command runs its whole control flow on CPU at toy
sizes, writes every step's rows and records how each step ended; the modelled time prints its assumptions."""

import csv
import subprocess
import sys
from pathlib import Path

from bench import chunked_model, gpu_ab, gpu_first

REPO = Path(__file__).resolve().parent.parent


def _rows(path: Path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_dry_run_covers_every_step(tmp_path):
    gpu_ab.main(["--dry-run", "--in-process", "--out", str(tmp_path)])
    steps = {row["step"]: row["status"] for row in _rows(tmp_path / "steps.csv")}
    assert steps == {name: "ok" for name, _, _ in gpu_ab.STEPS}
    rows = _rows(tmp_path / "ab.csv")
    assert {row["step"] for row in rows} == set(steps)
    by = {(row["step"], row["case"], row["metric"]): row["value"] for row in rows}
    assert by["bits", f"B={gpu_ab.DRY.bits}", "rerun identical"] == "1"
    assert any(
        step == "bits" and metric == "S fwd == bwd bits" and value == "1" for (step, _, metric), value in by.items()
    )
    errors = [row for row in rows if row["step"] == "errors" and row["metric"].endswith("rel err")]
    cases = {row["case"].split(" chunked")[0] for row in errors if " chunked" in row["case"]}
    assert cases == {name for name, *_ in gpu_ab.cases(None, 4, 4)}
    assert all(float(row["value"]) < 0.05 for row in errors), "a dry-run error beyond bf16's class"
    assert {row["metric"] for row in rows if row["step"] == "gemm"} >= {"scores", "dq", "dk"}
    assert [row["value"] for row in rows if row["step"] == "million" and row["metric"] == "chunk plan"] == ["C=128"]


def test_steps_run_in_their_own_processes_within_the_budget(tmp_path):
    gpu_ab.main(["--dry-run", "--only", "env", "bits", "--out", str(tmp_path)])
    steps = _rows(tmp_path / "steps.csv")
    assert [(row["step"], row["status"]) for row in steps] == [("env", "ok"), ("bits", "ok")]
    assert "==== env ====" in (tmp_path / "logs.txt").read_text()
    gpu_ab.main(["--dry-run", "--only", "env", "--budget-s", "1", "--out", str(tmp_path / "spent")])
    assert _rows(tmp_path / "spent" / "steps.csv")[0]["status"] == "skipped: budget spent"


def test_gpu_first_runs_the_ab_within_its_timeout(tmp_path):
    """The one bounded GPU command (python -m bench --preset gpu-first) ends with the A/B, into out/ab, on a budget
    that its seven timed steps fit and that ends before the step's timeout; the same arguments in a dry run."""
    (ab,) = gpu_first.plan(tmp_path)[-1]
    assert ab.name == "ab" and ab.argv[1:] == ("-m", "bench.gpu_first", "--step", "ab", "--out", str(tmp_path))
    command = gpu_first.ab_command(tmp_path)  # what that step runs
    assert command[1:3] == ("-m", "bench.gpu_ab")
    args = list(command[3:])
    assert args[:2] == ["--out", str(tmp_path / "ab")]
    budget = float(args[args.index("--budget-s") + 1])
    assert sum(timeout for _, _, timeout in gpu_ab.STEPS[:-1]) <= budget < ab.timeout_s
    gpu_ab.main(args + ["--dry-run", "--only", "env"])
    assert [(row["step"], row["status"]) for row in _rows(tmp_path / "ab" / "steps.csv")] == [("env", "ok")]


def test_model_prints_its_assumptions():
    out = subprocess.run(
        [sys.executable, "-m", "bench.chunked_model"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "MODEL" in out and "652" in out and "4.1" in out
    times = chunked_model.modelled_ms(65536, 512, chunk_rows=2048)
    assert 30 < times["overlapped"] <= times["serial"] + 1e-9 < 60, times
