"""bench.gpu_first's control flow on CPU: the plan and its files, the stage runner's handling of a failing, a hanging
and a healthy step and of a spent budget, and the summary built from rows as the steps append them (with the static
time model from the stored report). Seconds. The dry run of every step: tests/test_chunked_bench.py."""

import csv
import sys

import pytest

from bench import gpu_first


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_plan_names_every_step_and_a_fresh_run_writes_the_headers(tmp_path, capsys):
    """The plan printed, every file's header written, nothing run (--steps names no step)."""
    assert gpu_first.main(["--dry-run", "--in-process", "--steps", "none", "--out", str(tmp_path)]) == 0
    for name, columns in gpu_first.FILES.items():
        with open(tmp_path / name, newline="") as f:
            assert next(csv.reader(f)) == list(columns), name
        assert _rows(tmp_path / name) == [], name
    assert (tmp_path / "summary.md").exists()
    stages = gpu_first.plan(tmp_path, dry=True)
    printed = [step.name for stage in stages for step in stage]
    assert printed == ["env", "speed", "kernels", *(f"correctness-{p}" for p in gpu_first.CORRECTNESS_PARTS),
                       "static", "route", "million", "peers", "autotable"]  # fmt: skip
    assert all("--dry-run" in step.argv for stage in stages for step in stage)
    assert len(gpu_first.FILES) + 3 <= 9  # with static-model.csv, summary.md and logs.txt


def test_plan_orders_timed_steps_alone_and_filters():
    stages = gpu_first.plan(gpu_first.DEFAULT_OUT)
    names = [[step.name for step in stage] for stage in stages]
    assert names[:3] == [["env"], ["speed"], ["kernels"]]  # nothing runs beside a timed step
    assert set(names[3]) == {f"correctness-{p}" for p in gpu_first.CORRECTNESS_PARTS} | {"static"}
    assert names[4:] == [["route"], ["million"], ["peers"], ["autotable"]]  # the route's timed steps: alone
    only = gpu_first.plan(gpu_first.DEFAULT_OUT, steps=["speed", "correctness"])
    assert [[s.name for s in stage] for stage in only][0] == ["speed"]
    assert len(only) == 2 and len(only[1]) == len(gpu_first.CORRECTNESS_PARTS)


def test_stage_timeouts_add_up_within_seven_minutes():
    """Every step gets its whole timeout (a stage's is its longest step's) and the run ends within 7 minutes, with
    20 s for the processes' starts and the summary."""
    stages = gpu_first.plan(gpu_first.DEFAULT_OUT)
    assert sum(max(step.timeout_s for step in stage) for stage in stages) <= gpu_first.BUDGET_S <= 420 - 20
    assert set(gpu_first.STEPS) == {step.kind for stage in stages for step in stage}


def _python(code):
    return (sys.executable, "-c", code)


def test_run_stages_records_a_failure_and_a_timeout_and_goes_on(tmp_path):
    stages = [
        (
            gpu_first.Step("fails", "fails", "", _python("import sys; print('it broke'); sys.exit(3)"), 30),
            gpu_first.Step("hangs", "hangs", "", _python("import time; time.sleep(60)"), 1),
        ),
        (gpu_first.Step("works", "works", "", _python("print('fine')"), 30),),
    ]
    summaries = []
    gpu_first.run_stages(stages, tmp_path, budget_s=60, after_stage=lambda: summaries.append(1))
    steps = {r["step"]: r for r in _rows(tmp_path / "steps.csv")}
    assert steps["fails"]["status"] == "error" and steps["fails"]["rc"] == "3"
    assert steps["fails"]["note"] == "it broke"  # the log's last line
    assert steps["hangs"]["status"] == "timeout" and float(steps["hangs"]["wall_s"]) < 30
    assert steps["works"]["status"] == "ok"
    logs = (tmp_path / "logs.txt").read_text()
    assert "==== works: ok ====\nfine" in logs and "==== fails: error ====\nit broke" in logs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.txt", "steps.csv"]
    assert summaries == [1, 1]  # after every stage


def test_run_stages_skips_what_the_budget_does_not_cover(tmp_path):
    stages = [(gpu_first.Step("never", "never", "", _python("pass"), 30),)]
    gpu_first.run_stages(stages, tmp_path, budget_s=0)
    (row,) = _rows(tmp_path / "steps.csv")
    assert row["step"] == "never" and row["status"] == "skipped"


def test_summary_from_appended_rows_with_the_stored_model(tmp_path):
    pytest.importorskip("triton")  # bench.static reads the compile-only driver's module
    out = tmp_path
    gpu_first.append_row(out / "env.csv", {"key": "device", "value": "NVIDIA H100 80GB HBM3"})
    gpu_first.append_row(out / "env.csv", {"key": "sms", "value": 132})
    speed = {"loss": "clip", "batch": 32768, "dim": 512, "dtype": "bfloat16", "status": "ok", "bound_ms": 7.3}
    gpu_first.append_row(out / "speed.csv", {"method": "torch.mm bf16 (q @ k.T)", "gemm_tflops": 750.0, **speed})
    gpu_first.append_row(out / "speed.csv", {"method": "triton", "time_ms": 47.9, "x_bound": 6.5, **speed})
    gpu_first.append_row(
        out / "speed.csv", {"method": "triton", "time_ms": 12.0, "first_call_s": 20.012, **speed, "batch": 16384}
    )
    gpu_first.append_row(out / "speed.csv", {"method": "vanilla", "time_ms": 31.8, "x_bound": 4.4, **speed})
    for kernel, ms in (("forward", 7.2), ("dq", 20.2), ("dk", 18.6)):
        gpu_first.append_row(
            out / "kernels.csv",
            {
                "target": "sm_90",
                "dtype": "bf16",
                "D": 512,
                "batch": 32768,
                "kernel": kernel,
                "calls_per_step": 1,
                "measured_ms": ms,
            },
        )
    gpu_first.append_row(
        out / "correctness.csv",
        {
            "case": "plain",
            "backend": "triton",
            "batch": 4096,
            "dtype": "float16",
            "symmetric": True,
            "status": "ok",
            "dq_err": 8.2e-3,
            "within_tol": False,
            "bit_identical": True,
        },
    )
    text = gpu_first.write_summary(out).read_text()
    assert "NVIDIA H100 80GB HBM3" in text
    assert "| clip | 32768 | triton | 47.9 | 1.51 |" in text  # x vanilla = 47.9 / 31.8
    assert "stored bench/results/static.csv" in text
    dq = next(line for line in text.splitlines() if line.startswith("| 32768 | dq |"))
    assert "%" in dq, dq  # the model's estimate and its error beside the measured time
    assert "| plain | triton | 4096 | float16 | sym |" in text and "8.2e-03" in text
    assert "| triton clip bf16 fwd+bwd, B=16384 | 20.01 | 0.012 | 20.00 |" in text
