"""The command line of ``python -m bench.gpu_first`` (the package docstring is its help): the whole run, its
dry run (every step on CPU tensors at toy sizes), or one step in its own process (``--step``, as the stage runner
starts them)."""

import argparse
import sys
from pathlib import Path

from .autotable import step_autotable
from .correctness import step_correctness
from .env import step_env
from .files import FILES, write_header
from .kernels import step_kernels
from .peers import step_peers
from .plan import BUDGET_S, DEFAULT_OUT, DRY, GPU, REPEATS, plan
from .route import step_million, step_route
from .runner import run_stages
from .speed import step_speed
from .static_step import step_static
from .summary import write_summary

# What ``--step NAME`` runs: each step's function, called as ``fn(out, sizes, dry, part)``.
STEPS = {
    "env": step_env,
    "speed": step_speed,
    "kernels": step_kernels,
    "correctness": step_correctness,
    "static": step_static,
    "route": step_route,
    "million": step_million,
    "peers": step_peers,
    "autotable": step_autotable,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_first", description=sys.modules[__package__].__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's wall-clock limit, seconds")
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per speed configuration")
    p.add_argument("--steps", help=f"only these steps, e.g. speed,route ({', '.join(STEPS)})")
    p.add_argument("--dry-run", action="store_true", help="every step on CPU tensors at toy sizes; no GPU")
    p.add_argument("--in-process", action="store_true", help="the steps in this process, one after another (tests)")
    p.add_argument("--step", choices=sorted(STEPS), help=argparse.SUPPRESS)  # one step (run_stages starts these)
    p.add_argument("--part", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_step(kind: str, out: Path, dry: bool, part: str = "", repeats: int = REPEATS) -> int:
    sizes = DRY if dry else GPU
    if not dry and repeats != sizes.repeats:
        from dataclasses import replace

        sizes = replace(sizes, repeats=repeats)
    return STEPS[kind](out, sizes, dry, part) or 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.step:
        return run_step(args.step, out, args.dry_run, args.part, args.repeats)
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("python -m bench.gpu_first measures on a GPU; none is visible (--dry-run runs on CPU)")
    stages = plan(out, args.repeats, args.steps.replace(",", " ").split() if args.steps else None, args.dry_run)
    for i, stage in enumerate(stages, 1):
        for step in stage:
            print(f"stage {i}: {step.name} (timeout {step.timeout_s:.0f} s): {' '.join(step.argv[1:])}")
    for name in FILES:  # a fresh run: an earlier run's rows in ``out`` are dropped
        write_header(out / name)
    for name in ("static-model.csv", "summary.md", "logs.txt"):
        (out / name).unlink(missing_ok=True)
    in_process = None
    if args.in_process:
        in_process = lambda step: run_step(step.kind, out, args.dry_run, step.part, args.repeats)  # noqa: E731
    run_stages(stages, out, args.budget_s, after_stage=lambda: write_summary(out), in_process=in_process)
    print(write_summary(out).read_text())
    return 0
