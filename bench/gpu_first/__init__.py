"""``python -m bench.gpu_first`` (or ``python -m bench --preset gpu-first``): the one bounded run on a fresh GPU.

One command, one runner, within 7 minutes (``--budget-s``, 400 s: the stages' timeouts add up to less), that answers
what a first GPU session needs: the fused kernels and the chunked route (``backend="chunked"``) against the vanilla
loss and the peers at the same B, D and dtype, per-kernel times beside the static model, errors against float64 on
the one harness (:mod:`bench.errors`), the route's products, passes, S bits and one batch of a million, the
``dtype_out`` probes, and the auto table's suggestion. Each step runs in its own process with its own timeout (a
crash, a hang or an out-of-memory in one is recorded in ``steps.csv`` and the next step runs) and appends every
result to its CSV as soon as it has it, so a run cut off from outside still leaves its data. ``summary.md`` (the
tables to paste) is rewritten after every stage. ``--dry-run`` runs every step on CPU tensors at toy sizes (the
torch tiles standing in for the fused kernels, the torch passes for the Triton ones): tests/test_bench_gpu_first.py
and tests/test_chunked_bench.py.

Stages, in order (the steps of one stage run at the same time; nothing runs beside a timed step):

1. ``env``: device, SMs, clocks, driver, versions (env.csv); the ``dtype_out`` probes (route.csv).
2. ``speed``: bf16, D = 512, forward + backward at B = 16k / 32k / 64k, CLIP (symmetric) and SigLIP: the route, the
   fused kernels and vanilla (at 64k too where its logits fit: an 80 GB H100 holds them), CUDA events, median of
   ``--repeats`` after the first call (timed apart: the compiles) and one warm call; peak memory; the route's C;
   the device's bf16 GEMM rate and each time over its GEMM-equivalents' bound (speed.csv).
3. ``kernels``: torch.profiler's time per kernel: the fused kernels' and Inf-CL's at 32k / 64k, the route's every
   kernel at 64k (kernels.csv).
4. ``correctness-*`` and ``static``, side by side: errors against float64 at B = 4096 / 16384: the fused kernels in
   bf16 / fp16 / tf32, labels, ids + guide, SigLIP; the route in chunks of 1024 rows (correctness.csv);
   ``python -m bench.static`` for this device's target (static-model.csv, the chunked passes' table in logs.txt).
5. ``route``: the route's products (TFLOP/s at C = 1024 ... 8192), passes (GB/s against a copy), S bits
   forward vs backward and a bit-identical rerun (route.csv).
6. ``million``: one batch of B = 1,048,576 on the route, its budget stated (8 GiB: fits an 80 GB H100).
7. ``peers``: Inf-CL, memeff (CLIP) and siglip-kernel (SigLIP) installed from ``.peers/`` (their wheels, downloaded
   beforehand: the GPU has no network) and timed as the speed step times ours (speed.csv); a peer that does not
   install or run gets a row saying why.
8. ``autotable``: the ``resolve.CHUNKED_FROM`` entry the speed rows suggest (route.csv, summary.md).

Files: summary.md, steps.csv, env.csv, speed.csv, kernels.csv, correctness.csv, route.csv, static-model.csv and
logs.txt (every step's output, appended as each step ends). A device run copies back a limited number of files, so
its command archives the folder: ``python -m bench --preset gpu-first --out /tmp/gpu-first; tar czf
$OUT/gpu-first.tgz -C /tmp gpu-first``.

The package, by concern: :mod:`.plan` (the settings, the sizes, the steps and their stages), :mod:`.runner` (the stage
runner), :mod:`.files` (the CSVs and how rows reach them), :mod:`.timing`, one module per measurement (:mod:`.env`,
:mod:`.speed`, :mod:`.peers`, :mod:`.kernels`, :mod:`.correctness`, :mod:`.static_step`, :mod:`.route`,
:mod:`.autotable`), :mod:`.summary` (summary.md) and :mod:`.cli`.
"""

from .autotable import step_autotable, suggest_chunked_from
from .cli import STEPS, main, parse_args, run_step
from .correctness import Case, check_case, correctness_cases, step_correctness
from .env import probe_out_dtype, step_env
from .files import FILES, append_row, read_rows, route_row, write_header
from .kernels import profile_kernels, step_kernels
from .peers import PEERS, install, step_peers
from .plan import (
    BUDGET_S,
    CORRECTNESS_PARTS,
    DEFAULT_OUT,
    DIM,
    DRY,
    GPU,
    MILLION_BUDGET_MB,
    PEERS_DIR,
    REPEATS,
    REPO,
    STEP_TIMEOUTS,
    Sizes,
    Step,
    plan,
)
from .route import step_million, step_route
from .runner import run_stages
from .speed import chunk_plan, gemm_tflops, step_speed
from .static_step import static_command, step_static
from .summary import model_for_summary, write_summary
from .timing import time_step

__all__ = [
    "BUDGET_S",
    "CORRECTNESS_PARTS",
    "Case",
    "DEFAULT_OUT",
    "DIM",
    "DRY",
    "FILES",
    "GPU",
    "MILLION_BUDGET_MB",
    "PEERS",
    "PEERS_DIR",
    "REPEATS",
    "REPO",
    "STEPS",
    "STEP_TIMEOUTS",
    "Sizes",
    "Step",
    "append_row",
    "check_case",
    "chunk_plan",
    "correctness_cases",
    "gemm_tflops",
    "install",
    "main",
    "model_for_summary",
    "parse_args",
    "plan",
    "probe_out_dtype",
    "profile_kernels",
    "read_rows",
    "route_row",
    "run_stages",
    "run_step",
    "static_command",
    "step_autotable",
    "step_correctness",
    "step_env",
    "step_kernels",
    "step_million",
    "step_peers",
    "step_route",
    "step_speed",
    "step_static",
    "suggest_chunked_from",
    "time_step",
    "write_header",
    "write_summary",
]
