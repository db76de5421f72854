"""The command line of ``python -m bench.gpu_ab`` (the package docstring is its help): the steps in order, each
in its own process with its timeout within the budget, or one step (``--step``) in this process."""

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

from .env import step_env
from .errors import step_bits, step_errors
from .open_items import step_open_items
from .plan import BUDGET_S, DEFAULT_OUT, DRY, GPU, REPO
from .products import step_gemm, step_passes
from .rows import Rows
from .speed import step_million, step_speed

# (name, function, timeout seconds): the order of the run. The first seven's timeouts add up to plan.BUDGET_S, each
# about twice what the step is estimated to take on an H200 (a process start and CUDA init ~5 s, Triton compiles
# where a step first launches a kernel; the million: ~7 s of products at 650 TFLOP/s); the open items take what the
# others leave of the budget.
STEPS = (
    ("env", step_env, 15),
    ("gemm", step_gemm, 15),
    ("passes", step_passes, 20),
    ("speed", step_speed, 55),
    ("errors", step_errors, 45),
    ("bits", step_bits, 10),
    ("million", step_million, 30),
    ("open-items", step_open_items, 240),
)


def run_step(name: str, out: Path, dry: bool) -> None:
    fn = dict((n, f) for n, f, _ in STEPS)[name]
    fn(Rows(out, name), DRY if dry else GPU, dry)


def _record(out: Path, name: str, status: str, seconds: float) -> None:
    path = out / "steps.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(("step", "status", "seconds"))
        writer.writerow((name, status, f"{seconds:.1f}"))


def run_all(out: Path, dry: bool, budget_s: float, in_process: bool, only: Optional[List[str]] = None) -> None:
    """Every step (or ``only``) in order, each in its own process with its timeout, within ``budget_s``."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for name, _, timeout in STEPS:
        if only and name not in only:
            continue
        left = budget_s - (time.perf_counter() - start)
        if left < 5:
            _record(out, name, "skipped: budget spent", 0.0)
            continue
        t0 = time.perf_counter()
        if in_process:
            run_step(name, out, dry)
            status = "ok"
        else:
            cmd = [sys.executable, "-m", "bench.gpu_ab", "--step", name, "--out", str(out)] + (["--dry-run"] * dry)
            with open(out / "logs.txt", "a") as log:
                log.write(f"\n==== {name} ====\n")
                log.flush()
                try:
                    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=log, timeout=min(timeout, left))
                    status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
                except subprocess.TimeoutExpired:
                    status = "timeout"
        _record(out, name, status, time.perf_counter() - t0)
        print(f"---- {name}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_ab", description=sys.modules[__package__].__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--dry-run", action="store_true", help="the control flow on CPU at toy sizes")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--step", choices=[n for n, _, _ in STEPS], help="run one step in this process")
    parser.add_argument("--only", nargs="+", choices=[n for n, _, _ in STEPS], help="run these steps only")
    parser.add_argument("--in-process", action="store_true", help="no subprocess per step (tests)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("python -m bench.gpu_ab measures on a GPU; none is visible (--dry-run runs on CPU)")
    if args.step:
        run_step(args.step, args.out, args.dry_run)
        return
    run_all(args.out, args.dry_run, args.budget_s, args.in_process, args.only)
