"""The run's plan: its settings, the sizes of a GPU run and of a dry run, the steps, and the stages they run in.

A step is one ``python -m bench.gpu_first --step NAME`` process with its own timeout; the steps of a stage
run side by side, and nothing runs beside a timed step. To add a step: its function in a module of its own
(``step_<name>(out, sizes, dry, part)``, appending its rows as it has them), its entry in
:data:`bench.gpu_first.cli.STEPS`, its timeout in :data:`STEP_TIMEOUTS` and its place in :func:`plan`'s stages.
"""

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "gpu-first"
REPO = Path(__file__).resolve().parents[2]
# The peers' wheels (pip download --no-deps siglip-kernel memeff inf-cl -d .peers), carried to the GPU, which has no
# network; the peers step installs them from there into the run's folder.
PEERS_DIR = REPO / ".peers"
# The whole run's wall-clock budget: under 7 minutes (420 s) with 20 s for the processes' starts and the summary.
# The stages' timeouts add up to less (a stage's: its longest step's), so no step is cut short by a budget that
# earlier steps spent within their own timeouts.
BUDGET_S = 400
DIM = 512  # the feature dim of every measurement
REPEATS = 5  # timed runs per speed configuration (--repeats)
MILLION = 1_048_576
# B = 1,048,576 on the chunked route: 8 GiB of workspace budget. The inputs are 1 GiB each (bf16, D = 512), their
# float32 gradients in the route 2 GiB each and their bf16 gradients 1 GiB each, so with the workspace about 16 GiB
# in all: inside an 80 GB H100. (At the default 1 GiB the budget fits no row: (C + Bk) * D * 4 alone is 2 GiB.)
MILLION_BUDGET_MB = 8192
# The chunked route's errors against float64 run in chunks of this many rows, so a B = 4096 block is four chunks and
# the column merges and the dk accumulation across chunks are compared too.
CHECK_CHUNK_ROWS = 1024
CORRECTNESS_PARTS = ("bfloat16", "float16", "tf32", "options", "chunked")
# About twice what each step took on the H200 (bench/results/gpu-first-h200.md: env 6 s, speed 38 s for three
# methods, kernels 19 s, correctness <= 27 s, static 30 s), the new steps estimated: the route's products and
# passes ~15 s, the million ~12 s of products and passes at 650 TFLOP/s, the peers' compiles and autotuning.
# They add up to 395 s, within BUDGET_S.
STEP_TIMEOUTS = {
    "env": 20,
    "speed": 120,
    "kernels": 30,
    "correctness": 60,
    "static": 60,
    "route": 45,
    "million": 40,
    "peers": 60,
    "autotable": 20,  # no GPU work: a process start (torch and infcl imported) and a read of speed.csv
}


@dataclass(frozen=True)
class Sizes:
    """The shapes of one run: a GPU's, or toy ones for ``--dry-run`` on CPU tensors."""

    dim: int
    speed: Tuple[int, ...]  # B of the speed and peers steps
    check: Tuple[int, ...]  # B of the correctness cases
    check_chunk_rows: int  # the chunked route's C in its correctness cases
    kernels: Tuple[int, ...]  # B of the per-kernel profile
    gemm_rows: Tuple[int, ...]  # C of the route's products
    gemm_cols: int  # Bk of the route's products and passes
    pass_rows: Tuple[int, ...]  # C of the passes' GB/s
    bits: int  # B of the S-bits check
    million: int  # B of the one-batch run
    million_budget_mb: float
    repeats: int


GPU = Sizes(
    DIM, (16384, 32768, 65536), (4096, 16384), CHECK_CHUNK_ROWS, (32768, 65536), (1024, 2048, 4096, 8192), 65536,
    (2048, 4096), 16384, MILLION, MILLION_BUDGET_MB, REPEATS,
)  # fmt: skip
DRY = Sizes(32, (128, 256), (96,), 32, (), (16, 32), 256, (16,), 96, 384, 1.0, 1)


@dataclass(frozen=True)
class Step:
    """One process of the run, stopped at its timeout (or at the end of the budget)."""

    name: str
    kind: str  # the step function (:data:`bench.gpu_first.cli.STEPS`)
    part: str  # its part ("" for none)
    argv: Tuple[str, ...]  # the command, run in the repository root
    timeout_s: float


def _step(kind: str, out: Path, dry: bool, repeats: int, part: str = "") -> Step:
    argv = (sys.executable, "-m", "bench.gpu_first", "--step", kind, "--out", str(out), "--repeats", str(repeats))
    argv += ("--part", part) if part else ()
    argv += ("--dry-run",) if dry else ()
    return Step(f"{kind}-{part}" if part else kind, kind, part, argv, STEP_TIMEOUTS[kind])


def plan(out: Path, repeats: int = REPEATS, steps: Optional[Sequence[str]] = None, dry: bool = False):
    """The stages (steps run side by side within one) of a run writing to ``out``; ``steps``: only those
    (``speed``, ``correctness``, ...)."""
    stages: List[Tuple[Step, ...]] = [
        (_step("env", out, dry, repeats),),
        (_step("speed", out, dry, repeats),),
        (_step("kernels", out, dry, repeats),),
        (
            *(_step("correctness", out, dry, repeats, part) for part in CORRECTNESS_PARTS),
            _step("static", out, dry, repeats),
        ),
        (_step("route", out, dry, repeats),),
        (_step("million", out, dry, repeats),),
        (_step("peers", out, dry, repeats),),
        (_step("autotable", out, dry, repeats),),
    ]
    if steps is not None:
        keep = set(steps)
        stages = [tuple(s for s in stage if s.kind in keep or s.name in keep) for stage in stages]
    return [stage for stage in stages if stage]
