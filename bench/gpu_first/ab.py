"""The ``ab`` step: issue 45's A/B of the chunked route (``python -m bench.gpu_ab``: its own steps, each a process of
its own) into ``<out>/ab``, its budget this step's timeout less a margin, so the one bounded GPU command runs it and
a cut-off A/B still leaves its rows."""

import subprocess
import sys
from pathlib import Path
from typing import Tuple

from .plan import REPO, STEP_TIMEOUTS

# Seconds of the step's timeout the A/B leaves unused: its last process's exit, and the stage runner's kill margin.
MARGIN_S = 10


def ab_command(out: Path) -> Tuple[str, ...]:
    """``python -m bench.gpu_ab`` writing to ``out/ab`` within :data:`STEP_TIMEOUTS`["ab"] less :data:`MARGIN_S`."""
    budget = STEP_TIMEOUTS["ab"] - MARGIN_S
    return (sys.executable, "-m", "bench.gpu_ab", "--out", str(out / "ab"), "--budget-s", str(budget))


def step_ab(out: Path) -> int:
    """The A/B (its rows in out/ab/ab.csv, how each of its steps ended in out/ab/steps.csv, their output in
    out/ab/logs.txt); its own progress lines go to this step's log (logs.txt)."""
    return subprocess.run(ab_command(out), cwd=REPO, timeout=STEP_TIMEOUTS["ab"]).returncode
