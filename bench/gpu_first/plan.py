"""The run's plan: its settings, the steps, and the stages they run in.

A step is one ``python -m bench.gpu_first --step NAME`` process with its own timeout; the steps of a stage
run side by side, and nothing runs beside a timed step. To add a step: its function in a module of its own
(``step_<name>(out)``, appending its rows as it has them), its entry in :data:`bench.gpu_first.cli.STEPS`
(what ``--step NAME`` runs), its timeout in :data:`STEP_TIMEOUTS` and its place in :func:`plan`'s stages.
"""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "gpu-first"
REPO = Path(__file__).resolve().parents[2]
# The whole run's wall-clock budget: under 7 minutes (420 s) with 20 s for the processes' starts and the summary.
# The stages' timeouts add up to it (a stage's: its longest step's), so no step is cut short by a budget that
# earlier steps spent within their own timeouts.
BUDGET_S = 400
DIM = 512  # the feature dim of every measurement
REPEATS = 5  # timed runs per speed configuration (--repeats)
CORRECTNESS_PARTS = ("bfloat16", "float16", "tf32", "options")
# About twice what each step took on the H200 (bench/results/gpu-first-h200.md: env 6 s, speed 38 s, kernels 19 s,
# correctness <= 27 s, static 30 s); "ab": bench.gpu_ab's 190 s budget and a margin (bench.gpu_first.ab).
STEP_TIMEOUTS = {"env": 20, "speed": 80, "kernels": 40, "correctness": 60, "static": 60, "ab": 200}


@dataclass(frozen=True)
class Step:
    """One process of the run, stopped at its timeout (or at the end of the budget)."""

    name: str
    argv: Tuple[str, ...]  # the command, run in the repository root
    timeout_s: float


def _own(step: str, out: Path, *extra: str) -> Tuple[str, ...]:
    return (sys.executable, "-m", "bench.gpu_first", "--step", step, "--out", str(out), *extra)


def _step(kind: str, out: Path, *extra: str, name: Optional[str] = None) -> Step:
    """The step that runs ``--step kind`` (with ``extra`` arguments) under the name ``name`` (default: kind)."""
    return Step(name or kind, _own(kind, out, *extra), STEP_TIMEOUTS[kind])


def plan(out: Path, repeats: int = REPEATS, steps: Optional[Sequence[str]] = None) -> List[Tuple[Step, ...]]:
    """The stages (steps run side by side within one) of a run writing to ``out``; ``steps``: only those
    (``speed``, ``correctness``, ...)."""
    stages = [
        (_step("env", out),),
        (_step("speed", out, "--repeats", str(repeats)),),
        (_step("kernels", out),),
        (
            *(_step("correctness", out, "--part", part, name=f"correctness-{part}") for part in CORRECTNESS_PARTS),
            _step("static", out),
        ),
        (_step("ab", out),),
    ]
    if steps is not None:
        keep = set(steps)
        stages = [tuple(s for s in stage if s.name.split("-")[0] in keep) for stage in stages]
    return [stage for stage in stages if stage]
