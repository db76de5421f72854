"""``python -m bench.gpu_first`` (or ``python -m bench --preset gpu-first``): the bounded first run on a fresh GPU.

One command that answers, within 7 minutes (``--budget-s``, 400 s: the stages' timeouts add up to it), what a
first GPU session needs: speed, per-kernel times beside the static model, correctness against float64, Triton's
compile time, and the A/B of the chunked route (issue 45). Each step runs in its own process with its own
timeout (a crash, a hang or an out-of-memory in one is recorded in ``steps.csv`` and the next step runs) and
appends every result to its CSV as soon as it has it, so a run cut off from outside still leaves its data.
``summary.md`` (the tables to paste) is rewritten after every stage. ``--dry-run`` plans the stages and writes
the files' headers without touching a GPU.

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
5. ``ab``: ``python -m bench.gpu_ab`` (the chunked route against the fused kernels, vanilla and Inf-CL: the
   products' and passes' rates, end to end at 16k / 32k / 64k, errors against float64, S bits, one batch of a
   million, the open GPU items) into ``ab/``, within its timeout (:mod:`.ab`).

Eight files at the top: summary.md, steps.csv, env.csv, speed.csv, kernels.csv, correctness.csv, static-model.csv
and logs.txt (every step's output, appended as each step ends); and the A/B's three in ``ab/`` (ab.csv, steps.csv,
logs.txt). A device run copies back eight files, so its command archives the folder: ``python -m bench --preset
gpu-first --out /tmp/gpu-first; tar czf $OUT/gpu-first.tgz -C /tmp gpu-first``.

S bit for bit between the forward, dq and dk is not measured: no hook exposes S from the kernels; the
compiled S layouts are checked by bench.static (tests/test_static_report.py).

The package, by concern: :mod:`.plan` (the settings, the steps and their stages: where a step is declared),
:mod:`.runner` (the stage runner), :mod:`.files` (the CSVs and how rows reach them), one module per
measurement (:mod:`.env`, :mod:`.speed`, :mod:`.kernels`, :mod:`.correctness`, :mod:`.static_step`, :mod:`.ab`),
:mod:`.summary` (summary.md) and :mod:`.cli`.
"""

from .ab import ab_command, step_ab
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
    "ab_command",
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
    "step_ab",
    "step_correctness",
    "step_env",
    "step_kernels",
    "step_speed",
    "step_static",
    "time_step",
    "write_header",
    "write_summary",
]
