"""The stage runner: each stage's steps side by side, each a process group of its own stopped at its timeout or
at the end of the run's budget, its output appended to logs.txt and its outcome to steps.csv as it ends."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

from .files import append_row
from .plan import REPO, Step


def run_stages(stages: List[Tuple[Step, ...]], out: Path, budget_s: float, after_stage=None, in_process=None) -> None:
    """Run each stage's steps side by side (each a process group, its stdout and stderr in a log of its own
    outside ``out``, appended to out/logs.txt when it ends), each stopped at its timeout or at the end of the
    budget; one steps.csv row per step (ok, error with its exit code and the log's last line, timeout, or
    skipped when the budget is spent). ``after_stage()`` runs after every stage (the summary). ``in_process(step)``:
    run each step by that call in this process instead, one after another (tests: an exception is its step's
    error)."""
    if in_process is not None:
        _run_in_process(stages, out, time.monotonic() + budget_s, after_stage, in_process)
        return
    with tempfile.TemporaryDirectory(prefix="gpu-first-logs-") as logs:
        _run_stages(stages, out, time.monotonic() + budget_s, after_stage, Path(logs))


def _run_in_process(stages, out: Path, end: float, after_stage, run) -> None:
    for stage in stages:
        for step in stage:
            start = time.monotonic()
            if end - start < 5:
                append_row(out / "steps.csv", {"step": step.name, "status": "skipped", "timeout_s": 0,
                                               "note": "the run's budget (--budget-s) is spent"})  # fmt: skip
                continue
            try:
                rc, status, note = run(step), "ok", ""
            except Exception as err:  # the step's error; the next step runs
                rc, status, note = 1, "error", f"{type(err).__name__}: {str(err)[:300]}"
            append_row(out / "steps.csv", {"step": step.name, "status": status if not rc else "error", "rc": rc,
                                           "timeout_s": step.timeout_s, "wall_s": time.monotonic() - start,
                                           "note": note})  # fmt: skip
        if after_stage is not None:
            after_stage()


def _run_stages(stages, out: Path, end: float, after_stage, logs: Path) -> None:
    for stage in stages:
        left = end - time.monotonic()
        if left < 5:
            for step in stage:
                append_row(
                    out / "steps.csv",
                    {
                        "step": step.name,
                        "status": "skipped",
                        "timeout_s": 0,
                        "note": "the run's budget (--budget-s) is spent",
                    },
                )
            continue
        running = []
        for step in stage:
            timeout = min(step.timeout_s, left)
            log = open(logs / f"{step.name}.log", "w")
            proc = subprocess.Popen(step.argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            running.append((step, proc, log, time.monotonic(), timeout))
        for step, proc, log, start, timeout in running:
            try:
                rc = proc.wait(timeout=max(start + timeout - time.monotonic(), 0))
                status, note = ("ok", "") if rc == 0 else ("error", _last_line(logs / f"{step.name}.log"))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc, status, note = proc.wait(), "timeout", f"stopped after {timeout:.0f} s"
            log.close()
            with open(out / "logs.txt", "a") as f:
                f.write(f"==== {step.name}: {status} ====\n{(logs / f'{step.name}.log').read_text(errors='replace')}\n")
            append_row(
                out / "steps.csv",
                {
                    "step": step.name,
                    "status": status,
                    "rc": rc,
                    "timeout_s": timeout,
                    "wall_s": time.monotonic() - start,
                    "note": note,
                },
            )
            print(
                f"gpu-first: {step.name}: {status} ({time.monotonic() - start:.0f} s) {note}",
                file=sys.stderr,
                flush=True,
            )
        if after_stage is not None:
            after_stage()


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""
