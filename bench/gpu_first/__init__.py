"""``python -m bench.gpu_first`` (or ``python -m bench --preset gpu-first``): the bounded first run on a fresh GPU.

One command that answers, within about 5 minutes on an H100 (``--budget-s``), what a first GPU session
needs: speed, per-kernel times beside the static model, correctness against float64, and Triton's compile
time. Each step runs in its own process with its own timeout (a crash, a hang or an out-of-memory in one is
recorded in ``steps.csv`` and the next step runs) and appends every result to its CSV as soon as it has it,
so a run cut off from outside still leaves its data. ``summary.md`` (the tables to paste) is rewritten after
every stage. ``--dry-run`` plans the stages and writes the files' headers without touching a GPU.

Stages, in order (the steps of one stage run at the same time; nothing runs beside a timed step):

1. ``env``: device, SM count, clocks, driver, torch / Triton / Inf-CL versions (env.csv).
2. ``speed``: bf16, D = 512, symmetric, forward + backward at B = 16k / 32k / 64k, CUDA events, median of
   ``--repeats``: infcl ``backend="triton"``, Inf-CL (when ``inf_cl`` imports; its one-rank process group as
   bench.methods sets it up), vanilla where its logits fit; peak extra memory; the device's own bf16 GEMM
   rate and each time over the 5-GEMM bound; the first call of each method timed apart (Triton's compile).
3. ``kernels``: torch.profiler's time per kernel (forward, dq, dk; Inf-CL's) at B = 32k / 64k (kernels.csv,
   the columns bench.static ``--measured`` reads).
4. ``correctness-*`` (one process per operand type, and one for the options) and ``static``, side by side:
   loss and gradients against the float64 truth (infcl's torch tiles in float64) at B = 4096 / 16384,
   D = 512, bf16 / fp16 / fp32 with TF32 products, one- and two-directional; labels; ids + guide; SigLIP;
   each case run twice (bit-identical?); torch's own loss in the same dtype as the baseline error
   (correctness.csv). ``static``: ``python -m bench.static`` for this device's target, compile-only, its
   time model fed with this device's SM count, GEMM rate and clock, and compared with kernels.csv
   (static-model.csv; the report's table is in logs.txt). If it does not finish, the summary models the
   stored bench/results/static.csv instead, and says so.

Eight files at most (what a device run copies back): summary.md, steps.csv, env.csv, speed.csv, kernels.csv,
correctness.csv, static-model.csv and logs.txt (every step's output, appended as each step ends).

S bit for bit between the forward, dq and dk is not measured: no hook exposes S from the kernels; the
compiled S layouts are checked by bench.static (tests/test_static_report.py).

The package, by concern: :mod:`.plan` (the settings, the steps and their stages: where a step is declared),
:mod:`.runner` (the stage runner), :mod:`.files` (the CSVs and how rows reach them), one module per
measurement (:mod:`.env`, :mod:`.speed`, :mod:`.kernels`, :mod:`.correctness`, :mod:`.static_step`),
:mod:`.summary` (summary.md) and :mod:`.cli`.
"""

from .cli import STEPS, main, parse_args
from .correctness import Case, check_case, correctness_cases, step_correctness
from .env import step_env
from .files import FILES, append_row, read_rows, write_header
from .kernels import profile_kernels, step_kernels
from .plan import BUDGET_S, CORRECTNESS_PARTS, DEFAULT_OUT, DIM, REPEATS, REPO, STEP_TIMEOUTS, Step, plan
from .runner import run_stages
from .speed import gemm_tflops, step_speed, time_step
from .static_step import static_command, step_static
from .summary import model_for_summary, write_summary

__all__ = [
    "BUDGET_S",
    "CORRECTNESS_PARTS",
    "Case",
    "DEFAULT_OUT",
    "DIM",
    "FILES",
    "REPEATS",
    "REPO",
    "STEPS",
    "STEP_TIMEOUTS",
    "Step",
    "append_row",
    "check_case",
    "correctness_cases",
    "gemm_tflops",
    "main",
    "model_for_summary",
    "parse_args",
    "plan",
    "profile_kernels",
    "read_rows",
    "run_stages",
    "static_command",
    "step_correctness",
    "step_env",
    "step_kernels",
    "step_speed",
    "step_static",
    "time_step",
    "write_header",
    "write_summary",
]
