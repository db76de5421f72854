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
"""

import argparse
import csv
import dataclasses
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu-first"
REPO = Path(__file__).resolve().parent.parent
# The whole run's wall-clock budget: a 7-minute device slot less the machine's start and the copy back.
BUDGET_S = 300
DIM = 512
SPEED_BATCHES = (16384, 32768, 65536)
KERNEL_BATCHES = (32768, 65536)
CHECK_BATCHES = (4096, 16384)
SPEED_METHODS = ("triton", "inf-cl", "vanilla")
REPEATS = 5
PROFILED_STEPS = 3
# Vanilla runs where its ~5 [B, B] buffers (bench.__main__.VANILLA_BUFFERS) take at most this share of memory.
VANILLA_MEMORY_SHARE = 0.75
# The GEMM rate: q @ k.T at this B (flat beyond it, bench.gemm.GEMM_MAX_BATCH), best of this many runs.
GEMM_BATCH, GEMM_RUNS = 16384, 20
# Relative 2-norm error bounds against float64, as tests/test_triton_gpu.py's REL_TOL; and ours must be no
# worse than twice torch's own loss in the same dtype plus VANILLA_SLACK (the test's criterion).
REL_TOL = {"bfloat16": 1e-2, "float16": 3e-3, "tf32": 2e-2}
VANILLA_SLACK = 2.0**-9
LOGIT_SCALE = 1 / 0.07
SIGLIP_BIAS = -10.0
IDS_PER_CLASS = 4  # ids + guide: every 4 rows share an id (false negatives beside the diagonal)
GUIDE_DIM, GUIDE_MARGIN = 64, 0.1
MIB = 2**20

# Every file the run writes, with its columns (``--dry-run`` writes these headers).
FILES = {
    "steps.csv": ("step", "status", "rc", "wall_s", "timeout_s", "note"),
    "env.csv": ("key", "value"),
    "speed.csv": (
        "method",
        "batch",
        "dim",
        "dtype",
        "status",
        "time_ms",
        "time_min_ms",
        "repeats",
        "peak_mib",
        "gemm_tflops",
        "bound_ms",
        "x_bound",
        "first_call_s",
        "sm_clock_mhz",
        "note",
    ),
    "kernels.csv": ("target", "dtype", "D", "batch", "kernel", "method", "calls_per_step", "measured_ms", "source"),
    "correctness.csv": (
        "case",
        "batch",
        "dtype",
        "symmetric",
        "status",
        "loss_err",
        "dq_err",
        "dk_err",
        "dscale_err",
        "dbias_err",
        "vanilla_err",
        "tolerance",
        "within_tol",
        "within_vanilla",
        "bit_identical",
        "first_call_s",
        "note",
    ),
}


# ---- the plan and the stage runner ---------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    name: str
    argv: Tuple[str, ...]  # the command, run in the repository root
    timeout_s: float


def _own(step: str, out: Path, *extra: str) -> Tuple[str, ...]:
    return (sys.executable, "-m", "bench.gpu_first", "--step", step, "--out", str(out), *extra)


CORRECTNESS_PARTS = ("bfloat16", "float16", "tf32", "options")
STEP_TIMEOUTS = {"env": 30, "speed": 150, "kernels": 60, "correctness": 150, "static": 150}


def plan(out: Path, repeats: int = REPEATS, steps: Optional[Sequence[str]] = None) -> List[Tuple[Step, ...]]:
    """The stages (steps run side by side within one) of a run writing to ``out``; ``steps``: only those
    (``speed``, ``correctness``, ...)."""
    stages = [
        (Step("env", _own("env", out), STEP_TIMEOUTS["env"]),),
        (Step("speed", _own("speed", out, "--repeats", str(repeats)), STEP_TIMEOUTS["speed"]),),
        (Step("kernels", _own("kernels", out), STEP_TIMEOUTS["kernels"]),),
        (
            *(
                Step(f"correctness-{part}", _own("correctness", out, "--part", part), STEP_TIMEOUTS["correctness"])
                for part in CORRECTNESS_PARTS
            ),
            Step("static", _own("static", out), STEP_TIMEOUTS["static"]),
        ),
    ]
    if steps is not None:
        keep = set(steps)
        stages = [tuple(s for s in stage if s.name.split("-")[0] in keep) for stage in stages]
    return [stage for stage in stages if stage]


def append_row(path: Path, row: Dict) -> None:
    """One row appended to ``path`` (header from :data:`FILES`), in one write: the file is complete after every
    row, and the correctness steps' rows do not interleave."""
    columns = FILES[path.name]
    if not path.exists():
        write_header(path)
    line = _csv_line([_cell(row.get(c)) for c in columns])
    with open(path, "a") as f:
        f.write(line)


def write_header(path: Path) -> None:
    with open(path, "w") as f:
        f.write(_csv_line(FILES[path.name]))


def _csv_line(cells) -> str:
    import io

    buf = io.StringIO()
    csv.writer(buf).writerow(cells)
    return buf.getvalue()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run_stages(stages: List[Tuple[Step, ...]], out: Path, budget_s: float, after_stage=None) -> None:
    """Run each stage's steps side by side (each a process group, its stdout and stderr in a log of its own
    outside ``out``, appended to out/logs.txt when it ends), each stopped at its timeout or at the end of the
    budget; one steps.csv row per step (ok, error with its exit code and the log's last line, timeout, or
    skipped when the budget is spent). ``after_stage()`` runs after every stage (the summary)."""
    with tempfile.TemporaryDirectory(prefix="gpu-first-logs-") as logs:
        _run_stages(stages, out, time.monotonic() + budget_s, after_stage, Path(logs))


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


# ---- the steps (each in its own process) -------------------------------------------------------------


def step_env(out: Path) -> None:
    import importlib.metadata

    import torch

    props = torch.cuda.get_device_properties(0)
    rows = {
        "device": props.name,
        "capability": f"{props.major}{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": f"{props.total_memory / 2**30:.1f}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for package in ("triton", "inf_cl"):
        try:
            rows[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            rows[package] = "not installed"
    rows["infcl_commit"] = _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"])
    rows["driver, max SM clock, power limit"] = smi or "nvidia-smi failed"
    for key, value in rows.items():
        append_row(out / "env.csv", {"key": key, "value": value})


def _run(cmd: List[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _clock_probe():
    """nvidia-smi sampling the SM clock while the GPU runs (started before a timed loop, read after)."""
    try:
        return subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return None


def _clock_read(probe) -> Optional[float]:
    if probe is None:
        return None
    try:
        return float(probe.communicate(timeout=10)[0].split()[0])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def gemm_tflops(batch: int = GEMM_BATCH, dim: int = DIM) -> float:
    """The device's bf16 rate on the loss's S product (q @ k.T into a preallocated output), best of
    :data:`GEMM_RUNS` CUDA-event timings: the rate the 5-GEMM bound is taken at."""
    import torch

    a, b = (torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16) for _ in "ab")
    c = torch.empty(batch, batch, device="cuda", dtype=torch.bfloat16)
    best = math.inf
    for i in range(GEMM_RUNS + 2):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b.T, out=c)
        stop.record()
        stop.synchronize()
        if i >= 2:  # two warm-up runs
            best = min(best, start.elapsed_time(stop) / 1e3)
    return 2.0 * batch * batch * dim / best / 1e12


def _fwd_bwd(fn, q, k, scale):
    def step():
        q.grad = k.grad = scale.grad = None
        fn(q, k, scale, True).backward()

    return step


def time_step(step, repeats: int) -> Dict:
    """First call (with any compile), then one warm call, then ``repeats`` CUDA-event timings; peak extra
    memory over what is held before a call."""
    import statistics

    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    probe = _clock_probe()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return {
        "first_call_s": first,
        "time_ms": statistics.median(times),
        "time_min_ms": min(times),
        "repeats": repeats,
        "peak_mib": (torch.cuda.max_memory_allocated() - base) / MIB,
        "sm_clock_mhz": _clock_read(probe),
    }


def step_speed(out: Path, batches=SPEED_BATCHES, repeats: int = REPEATS) -> None:
    import torch

    from .methods import METHODS, make_inputs

    device = torch.device("cuda")
    rate = gemm_tflops()
    append_row(
        out / "speed.csv",
        {
            "method": "torch.mm bf16 (q @ k.T)",
            "batch": GEMM_BATCH,
            "dim": DIM,
            "dtype": "bfloat16",
            "status": "ok",
            "gemm_tflops": rate,
        },
    )
    memory = torch.cuda.get_device_properties(0).total_memory
    for batch in batches:
        bound_ms = 1e3 * 5 * 2.0 * batch * batch * DIM / (rate * 1e12)
        for name in SPEED_METHODS:
            row = {
                "method": name,
                "batch": batch,
                "dim": DIM,
                "dtype": "bfloat16",
                "gemm_tflops": rate,
                "bound_ms": bound_ms,
            }
            reason = METHODS[name].unavailable_for("clip", device, DIM)
            if name == "vanilla" and 5 * batch * batch * 2 > VANILLA_MEMORY_SHARE * memory:
                reason = f"its ~5 [B, B] bf16 buffers exceed {VANILLA_MEMORY_SHARE:g} of the device's memory"
            if reason:
                append_row(out / "speed.csv", {**row, "status": "skipped", "note": reason})
                continue
            try:
                q, k, scale = make_inputs(batch, DIM, torch.bfloat16, device)
                result = time_step(_fwd_bwd(METHODS[name].loss, q, k, scale), repeats)
                row.update(status="ok", x_bound=result["time_ms"] / bound_ms, **result)
            except Exception as err:  # recorded; the next configuration runs
                row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
            finally:
                q = k = scale = None
                torch.cuda.empty_cache()
            append_row(out / "speed.csv", row)
            print(row, flush=True)


def profile_kernels(step, steps: int) -> Dict[str, Tuple[float, float]]:
    """{kernel label: (calls per step, ms per call)} of the CUDA kernels ``steps`` calls of ``step`` run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .static import kernel_label

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {}
    for event in prof.key_averages():
        total_us = getattr(event, "self_device_time_total", None)
        if total_us is None:
            total_us = getattr(event, "self_cuda_time_total", 0.0)
        if event.count and total_us:
            out[kernel_label(event.key)] = (event.count / steps, total_us / 1e3 / event.count)
    return out


def step_kernels(out: Path, batches=KERNEL_BATCHES) -> None:
    import torch

    from .methods import METHODS, make_inputs

    props = torch.cuda.get_device_properties(0)
    target = f"sm_{props.major}{props.minor}"
    device = torch.device("cuda")
    runs = [("triton", "infcl", ("forward", "dq", "dk"), batch) for batch in batches]
    if METHODS["inf-cl"].unavailable_for("clip", device, DIM) is None:
        runs.append(("inf-cl", "inf-cl", ("inf-cl forward", "inf-cl dq", "inf-cl dk"), batches[0]))
    for name, method, kernels, batch in runs:
        q, k, scale = make_inputs(batch, DIM, torch.bfloat16, device)
        times = profile_kernels(_fwd_bwd(METHODS[name].loss, q, k, scale), PROFILED_STEPS)
        common = {
            "target": target,
            "dtype": "bf16",
            "D": DIM,
            "batch": batch,
            "method": method,
            "source": f"torch.profiler, {PROFILED_STEPS} steps",
        }
        for kernel in kernels:
            calls, ms = times.get(kernel, (None, None))
            append_row(out / "kernels.csv", {**common, "kernel": kernel, "calls_per_step": calls, "measured_ms": ms})
        found = [times[kernel] for kernel in kernels if kernel in times]
        append_row(
            out / "kernels.csv",
            {
                **common,
                "kernel": f"{method} total",
                "calls_per_step": 1,
                "measured_ms": sum(calls * ms for calls, ms in found),
            },
        )
        q = k = scale = None
        torch.cuda.empty_cache()


# ---- correctness ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str  # "plain", "labels", "ids+guide", "siglip"
    batch: int
    dtype: str  # bfloat16, float16, tf32 (float32 inputs, TF32 products)
    symmetric: bool = True


def correctness_cases(part: str, batches=CHECK_BATCHES) -> List[Case]:
    """The cases of one correctness process: an operand type's plain cases, or the options (bf16)."""
    if part in REL_TOL:
        return [Case("plain", b, part, sym) for b in batches for sym in (True, False)]
    return [
        Case("labels", batches[0], "bfloat16", False),
        Case("ids+guide", batches[0], "bfloat16"),
        *(Case("siglip", b, "bfloat16") for b in batches),
    ]


def _case_inputs(case: Case, seed: int = 0):
    """q, k: unit rows, each k near its q (confident positives, as tests/test_triton_gpu.py builds them)."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(case.batch, DIM, device="cuda", generator=gen), dim=1)
    k = F.normalize(q + 0.5 * torch.randn(case.batch, DIM, device="cuda", generator=gen) / DIM**0.5, dim=1)
    dtype = torch.float32 if case.dtype == "tf32" else getattr(torch, case.dtype)
    return q.to(dtype), k.to(dtype)


def _losses(case: Case, q):
    """(ours, truth's, torch's own in the dtype or None): each ``fn(q, k, scale, bias) -> loss``."""
    import torch
    import torch.nn.functional as F

    from infcl import cal_inf_loss, cal_siglip_loss

    batch = case.batch
    if case.name == "siglip":

        def siglip(backend):
            return lambda q_, k_, s, b: cal_siglip_loss(q_, k_, s, b, backend=backend)

        def vanilla(q_, k_, s, b):
            signs = 2 * torch.eye(batch, device=q_.device, dtype=q_.dtype) - 1
            return -F.logsigmoid(signs * (s * q_ @ k_.T + b)).sum() / batch

        return siglip("triton"), siglip("torch"), vanilla
    options, labels = {}, None
    if case.name == "labels":
        labels = torch.randperm(batch, device=q.device, generator=torch.Generator(device=q.device).manual_seed(1))
    if case.name == "ids+guide":
        gen = torch.Generator(device=q.device).manual_seed(2)
        ids = torch.arange(batch, device=q.device) // IDS_PER_CLASS
        guide = tuple(
            F.normalize(torch.randn(batch, GUIDE_DIM, device=q.device, generator=gen), dim=1).to(q.dtype) for _ in "qk"
        )
        options = {"q_ids": ids, "k_ids": ids, "guide": guide, "guide_margin": GUIDE_MARGIN}

    def infcl(backend):
        return lambda q_, k_, s, b: cal_inf_loss(
            q_, k_, labels, s, symmetric=case.symmetric, backend=backend, **options
        )

    def vanilla(q_, k_, s, b):
        logits = s * q_ @ k_.T
        target = torch.arange(batch, device=q_.device) if labels is None else labels
        rows = F.cross_entropy(logits, target)
        return (rows + F.cross_entropy(logits.T, target)) / 2 if case.symmetric else rows

    return infcl("triton"), infcl("torch"), vanilla if case.name != "ids+guide" else None


def _grads(fn, q, k, scale, bias):
    """[loss, dq, dk, dscale, dbias] of ``fn(q, k, scale, bias)`` (zeros for a leaf the loss does not use)."""
    import torch

    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, scale, bias)]
    loss = fn(*leaves)
    loss.backward()
    return [loss.detach()] + [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def _rel(value, truth) -> float:
    return float((value.double() - truth).norm() / truth.norm().clamp_min(1e-300))


GRADS = ("loss", "dq", "dk", "dscale", "dbias")


def check_case(case: Case) -> Dict:
    """One case's row: errors of ours and of torch's own loss against float64, whether a rerun is identical."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = case.dtype == "tf32"
    q, k = _case_inputs(case)
    scale = torch.tensor(LOGIT_SCALE, device="cuda")
    bias = torch.tensor(SIGLIP_BIAS, device="cuda")
    ours_fn, truth_fn, vanilla_fn = _losses(case, q)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ours = _grads(ours_fn, q, k, scale, bias)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    again = _grads(ours_fn, q, k, scale, bias)
    truth = _grads(truth_fn, q.double(), k.double(), scale.double(), bias.double())
    used = GRADS if case.name == "siglip" else GRADS[:4]
    errors = {name: _rel(a, e) for name, a, e in zip(GRADS, ours, truth) if name in used}
    row = {
        **{f"{name}_err": value for name, value in errors.items()},
        "first_call_s": first,
        "bit_identical": all(torch.equal(a, b) for a, b in zip(ours, again)),
        "tolerance": REL_TOL[case.dtype],
        "within_tol": max(errors.values()) <= REL_TOL[case.dtype],
    }
    if vanilla_fn is not None:
        theirs = _grads(vanilla_fn, q, k, scale, bias)
        vanilla = {name: _rel(a, e) for name, a, e in zip(GRADS, theirs, truth) if name in used}
        row["vanilla_err"] = max(vanilla.values())
        row["within_vanilla"] = all(errors[n] <= 2 * vanilla[n] + VANILLA_SLACK for n in used)
    return row


def step_correctness(out: Path, part: str, batches=CHECK_BATCHES) -> None:
    import torch

    if part == "options":
        append_row(
            out / "correctness.csv",
            {
                "case": "S bits forward vs dq vs dk",
                "status": "skipped",
                "note": "no hook exposes S from the kernels; bench.static checks that the three compile S from one "
                "MMA layout (tests/test_static_report.py)",
            },
        )
    for case in correctness_cases(part, batches):
        row = {"case": case.name, "batch": case.batch, "dtype": case.dtype, "symmetric": case.symmetric}
        try:
            row.update(status="ok", **check_case(case))
        except Exception as err:  # recorded; the next case runs
            row.update(status="error", note=f"{type(err).__name__}: {str(err)[:200]}")
        torch.cuda.empty_cache()
        append_row(out / "correctness.csv", row)
        print(row, flush=True)


def static_command(out: Path, report: Path) -> Tuple[str, ...]:
    """``python -m bench.static`` for this device's target (env.csv), writing to ``report``, its model fed
    with the device's SM count, the GEMM rate and the SM clock under load the speed step measured, compared
    with kernels.csv."""
    env = dict(_read(out / "env.csv", ("key", "value")))
    cmd = [
        sys.executable,
        "-m",
        "bench.static",
        "--targets",
        env.get("capability", "90"),
        "--losses",
        "clip",
        "--no-plot",
        "--out",
        str(report),
        "--name",
        "static",
        "--measured",
        str(out / "kernels.csv"),
    ]
    if env.get("sms"):
        cmd += ["--sms", env["sms"]]
    speed = _read(out / "speed.csv")
    rates = [float(r["gemm_tflops"]) for r in speed if r["method"].startswith("torch.mm") and r["gemm_tflops"]]
    clocks = [float(r["sm_clock_mhz"]) for r in speed if r["method"] == "triton" and r["sm_clock_mhz"]]
    if rates:
        cmd += ["--tflops", f"{rates[0]:.1f}"]
    if clocks:
        cmd += ["--clock-ghz", f"{clocks[-1] / 1e3:.3f}"]
    return tuple(cmd)


def step_static(out: Path) -> int:
    """The static report (its table on stdout: logs.txt), its model copied to out/static-model.csv."""
    import shutil

    with tempfile.TemporaryDirectory(prefix="gpu-first-static-") as report:
        rc = subprocess.run(static_command(out, Path(report)), cwd=REPO).returncode
        if (Path(report) / "static-model.csv").exists():
            shutil.copy(Path(report) / "static-model.csv", out / "static-model.csv")
    return rc


# ---- the summary -------------------------------------------------------------------------------------------


def _read(path: Path, columns=None) -> List:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [tuple(r[c] for c in columns) for r in rows] if columns else rows


def _table(heads: Sequence[str], rows: List[Sequence]) -> str:
    lines = ["| " + " | ".join(heads) + " |", "| " + " | ".join("---" for _ in heads) + " |"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _num(text, fmt="{:.3g}") -> str:
    try:
        return fmt.format(float(text))
    except (TypeError, ValueError):
        return text or "-"


def model_for_summary(out: Path) -> Tuple[List[Dict], str]:
    """The static model's rows: this run's static step's, or else the stored report's (bench/results/static.csv,
    compiled by the Triton on the machine that made it) with this device's SM count and GEMM rate."""
    from . import static

    path = out / "static-model.csv"
    if path.exists():
        return _read(path), "this run's bench.static (compiled by this machine's Triton)"
    stored = static.DEFAULT_OUT / "static.csv"
    if not stored.exists():
        return [], "no static model"
    env = dict(_read(out / "env.csv", ("key", "value")))
    device = static.DEVICES[90]
    rates = [
        float(r["gemm_tflops"])
        for r in _read(out / "speed.csv")
        if r["method"].startswith("torch.mm") and r["gemm_tflops"]
    ]
    if env.get("sms"):
        device = dataclasses.replace(device, sms=int(env["sms"]))
    if rates:
        device = dataclasses.replace(device, tflops=rates[0])
    rows = [r for r in static.read_rows(stored) if r["target"] == "sm_90" and r["D"] == str(DIM)]
    measured = static.read_measured(out / "kernels.csv") if (out / "kernels.csv").exists() else {}
    try:
        models = static.model_rows(rows, static.MODEL_BATCHES, {90: device}, measured)
    except (KeyError, ValueError) as err:  # a report written before the model's columns
        return [], f"no static model: the stored bench/results/static.csv lacks {err}"
    return models, "the stored bench/results/static.csv (sm_90, compiled by the Triton of the machine that made it)"


def write_summary(out: Path) -> Path:
    """summary.md: the run's tables, from whatever CSVs exist so far."""
    env = dict(_read(out / "env.csv", ("key", "value")))
    head = ", ".join(
        f"{k} {env[k]}" for k in ("device", "sms", "torch", "cuda", "triton", "inf_cl", "infcl_commit") if k in env
    )
    parts = [f"# gpu-first: {head or 'no env yet'}", ""]
    if env.get("driver, max SM clock, power limit"):
        parts += [f"driver, max SM clock, power limit: {env['driver, max SM clock, power limit']}", ""]
    steps = _read(out / "steps.csv")
    parts += ["steps: " + "; ".join(f"{s['step']} {s['status']} {_num(s['wall_s'], '{:.0f}')} s" for s in steps), ""]
    speed = _read(out / "speed.csv")
    gemm = [r for r in speed if r["method"].startswith("torch.mm")]
    if speed:
        vanilla = {r["batch"]: float(r["time_ms"]) for r in speed if r["method"] == "vanilla" and r["time_ms"]}
        rows = []
        for r in speed:
            if r["method"].startswith("torch.mm"):
                continue
            x_vanilla = float(r["time_ms"]) / vanilla[r["batch"]] if r["time_ms"] and r["batch"] in vanilla else None
            rows.append(
                [
                    r["batch"],
                    r["method"],
                    _num(r["time_ms"], "{:.1f}") if r["status"] == "ok" else r["status"],
                    _num(x_vanilla, "{:.2f}"),
                    _num(r["x_bound"], "{:.2f}"),
                    _num(r["peak_mib"], "{:.0f}"),
                    _num(r["first_call_s"], "{:.1f}"),
                    _num(r["sm_clock_mhz"], "{:.0f}"),
                    r["note"][:80],
                ]
            )
        rate = f"{float(gemm[0]['gemm_tflops']):.0f} TFLOP/s" if gemm and gemm[0]["gemm_tflops"] else "?"
        parts += [
            f"## Speed: bf16, D = {DIM}, symmetric, forward + backward (CUDA events, median); bf16 GEMM {rate}",
            "",
            _table(
                ["B", "method", "ms", "x vanilla", "x 5-GEMM bound", "peak MiB", "first call s", "SM MHz", "note"], rows
            ),
            "",
        ]
    kernels = _read(out / "kernels.csv")
    if kernels:
        models, source = model_for_summary(out)
        by_key = {(str(m["batch"]), m["kernel"]): m for m in models}
        rows = []
        for r in kernels:
            m = by_key.get((r["batch"], r["kernel"]), {})
            serial, bound = m.get("serial_ms"), m.get("bound_ms")
            error = "-"
            if serial and r["measured_ms"]:
                error = f"{100 * (float(serial) / float(r['measured_ms']) - 1):+.0f}%"
            rows.append(
                [
                    r["batch"],
                    r["kernel"],
                    _num(r["calls_per_step"], "{:.0f}"),
                    _num(r["measured_ms"], "{:.2f}"),
                    _num(serial, "{:.2f}"),
                    _num(bound, "{:.2f}"),
                    m.get("limiter", "-"),
                    error,
                ]
            )
        parts += [
            "## Per kernel (torch.profiler, ms per call) beside the static model",
            "",
            f"model: {source}",
            "",
            _table(
                ["B", "kernel", "calls/step", "measured", "model (serial)", "model (max)", "limiter", "error"], rows
            ),
            "",
        ]
    checks = _read(out / "correctness.csv")
    if checks:
        rows = [
            [
                r["case"],
                r["batch"],
                r["dtype"],
                {"True": "sym", "False": "one"}.get(r["symmetric"], "-"),
                r["status"] if r["status"] != "ok" else "",
                *[_num(r[f"{n}_err"], "{:.1e}") for n in GRADS],
                _num(r["vanilla_err"], "{:.1e}"),
                r["within_tol"],
                r["within_vanilla"],
                r["bit_identical"],
                _num(r["first_call_s"], "{:.1f}"),
                r["note"][:80],
            ]
            for r in checks
        ]
        parts += [
            "## Correctness: relative 2-norm error against float64 (infcl's torch tiles in float64)",
            "",
            f"within tol: max error <= {REL_TOL}; within vanilla: each <= 2 x torch's own + 2^-9",
            "",
            _table(
                [
                    "case",
                    "B",
                    "dtype",
                    "dir",
                    "status",
                    *GRADS,
                    "vanilla worst",
                    "within tol",
                    "within vanilla",
                    "rerun identical",
                    "first call s",
                    "note",
                ],
                rows,
            ),
            "",
        ]
    firsts = [
        [
            f"{r['method']} bf16 symmetric fwd+bwd, B={r['batch']}",
            _num(r["first_call_s"], "{:.2f}"),
            _num(float(r["time_ms"]) / 1e3, "{:.3f}"),
            _num(float(r["first_call_s"]) - float(r["time_ms"]) / 1e3, "{:.2f}"),
        ]
        for r in speed
        if r["status"] == "ok" and r["first_call_s"] and r["batch"] == str(SPEED_BATCHES[0])
    ]
    if firsts:
        parts += [
            "## First call (Triton's compile, or Inf-CL's and its process group's start) less a warm call",
            "",
            _table(["what", "first call s", "warm s", "difference s"], firsts),
            "",
            "The correctness table's first calls include the compile of each case's kernels.",
            "",
        ]
    path = out / "summary.md"
    path.write_text("\n".join(parts))
    return path


# ---- the command line --------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_first", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's wall-clock limit, seconds")
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per speed configuration")
    p.add_argument("--steps", help="only these steps, e.g. speed,kernels (env, speed, kernels, correctness, static)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write the files' headers; no GPU")
    p.add_argument("--step", help=argparse.SUPPRESS)  # one step, in its own process (run_stages starts these)
    p.add_argument("--part", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.step:
        step = {
            "env": lambda: step_env(out),
            "speed": lambda: step_speed(out, repeats=args.repeats),
            "kernels": lambda: step_kernels(out),
            "correctness": lambda: step_correctness(out, args.part),
            "static": lambda: step_static(out),
        }[args.step]
        return step() or 0
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


if __name__ == "__main__":
    sys.exit(main())
