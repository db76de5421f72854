"""The command line of ``python -m bench.gpu_first`` (the package docstring is its help): the whole run, its
dry run, or one step in its own process (``--step``, as the stage runner starts them)."""

import argparse
import sys
from pathlib import Path

from .ab import step_ab
from .correctness import step_correctness
from .env import step_env
from .files import FILES, write_header
from .kernels import step_kernels
from .plan import BUDGET_S, DEFAULT_OUT, REPEATS, plan
from .runner import run_stages
from .speed import step_speed
from .static_step import step_static
from .summary import write_summary

# What ``--step NAME`` runs, in its own process: each step's function, with the options it reads.
STEPS = {
    "env": lambda out, args: step_env(out),
    "speed": lambda out, args: step_speed(out, repeats=args.repeats),
    "kernels": lambda out, args: step_kernels(out),
    "correctness": lambda out, args: step_correctness(out, args.part),
    "static": lambda out, args: step_static(out),
    "ab": lambda out, args: step_ab(out),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_first", description=sys.modules[__package__].__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's wall-clock limit, seconds")
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per speed configuration")
    p.add_argument(
        "--steps", help="only these steps, e.g. speed,kernels (env, speed, kernels, correctness, static, ab)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and write the files' headers; no GPU")
    p.add_argument("--step", help=argparse.SUPPRESS)  # one step, in its own process (run_stages starts these)
    p.add_argument("--part", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.step:
        return STEPS[args.step](out, args) or 0
    stages = plan(out, args.repeats, args.steps.replace(",", " ").split() if args.steps else None)
    for i, stage in enumerate(stages, 1):
        for step in stage:
            print(f"stage {i}: {step.name} (timeout {step.timeout_s:.0f} s): {' '.join(step.argv[1:])}")
    for name in FILES:  # a fresh run: an earlier run's rows in ``out`` are dropped
        write_header(out / name)
    for name in ("static-model.csv", "summary.md", "logs.txt"):
        (out / name).unlink(missing_ok=True)
    if args.dry_run:
        write_summary(out)
        print(f"dry run: headers and summary.md in {out}")
        return 0
    run_stages(stages, out, args.budget_s, after_stage=lambda: write_summary(out))
    print(write_summary(out).read_text())
    return 0
