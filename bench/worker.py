"""One benchmark configuration in its own fresh process.

Every job runs in a new process forked from a "forkserver" that has imported torch and infcl once
(so a job costs milliseconds to start, not the seconds of ``import torch``) and has never computed
anything, so each job's peak memory is its own. A job that runs out of memory reports "OOM"; one the
OS kills (the Linux OOM killer) is reported as "OOM" too, from its exit signal, not as a crash.
"""

import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from typing import Dict

import torch

from .accuracy import errors_vs_float64
from .gemm import gemm_rates, gemm_steps, route_dtype
from .measure import MIB, Step, loss_step, median, peak_extra_bytes, time_interleaved
from .methods import METHODS, gemm_equivalents, make_inputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
MODES = ("forward", "backward", "forward+backward")
OUT_OF_MEMORY = torch.OutOfMemoryError
# Rows of the throw-away first call: it initializes thread pools and lazy kernels without touching
# full-size buffers, so the measured first full-size call sees only the step's own memory.
WARMUP_ROWS = 64


@dataclass(frozen=True)
class Job:
    method: str
    batch: int
    dim: int
    dtype: str
    device: str
    threads: int
    warmup: int
    repeats: int
    mode: str = "forward+backward"
    symmetric: bool = True
    memory_only: bool = False
    loss: str = "clip"  # "clip" (the contrastive loss) or "siglip" (the sigmoid loss)
    accuracy: bool = False  # also measure the error against a float64 truth (bench.accuracy)
    gemm_route: str = ""  # the bound's product dtype (bench.gemm.best_route); "" = dtype

    def route(self) -> str:
        return self.gemm_route or self.dtype

    def label(self) -> str:
        loss = "" if self.loss == "clip" else f" {self.loss}"
        return f"{self.method}{loss} {self.mode} B={self.batch} D={self.dim} {self.dtype}"


def _step(job: Job, batch: int) -> Step:
    """The step of ``job.mode`` on fresh inputs of ``batch`` rows."""
    q, k, scale = make_inputs(batch, job.dim, DTYPES[job.dtype], torch.device(job.device))
    loss = METHODS[job.method].loss_fn(job.loss)
    return loss_step(lambda q, k, s: loss(q, k, s, job.symmetric), q, k, scale, job.mode)


def _run_method(job: Job) -> Dict:
    device = torch.device(job.device)
    warm = _step(job, min(job.batch, WARMUP_ROWS))
    warm.measured(warm.prepare())
    del warm
    step = _step(job, job.batch)
    result = {"peak_extra_mib": peak_extra_bytes(step, device) / MIB}
    if not job.memory_only:
        # The GEMM bound's matmul runs take turns with the method's runs (after the memory figure, so
        # their buffers are not in it): both see the same machine speed.
        # Their dtype is the job's route (bench.gemm): never a slow one that would load the cores between
        # the method's runs.
        gemm = gemm_steps(job.batch, job.dim, route_dtype(job.route()), device)
        times = time_interleaved(
            {"method": step, **gemm},
            device,
            job.warmup,
            job.repeats,
            progress=lambda line: print(f"  {job.label()}: {line}", file=sys.stderr, flush=True),
        )
        method_times = times.pop("method")
        rates = gemm_rates(job.batch, job.dim, times)
        result.update(
            time_s=median(method_times),
            time_min_s=min(method_times),
            gemm_gflops=rates["gflops"],
            gemm_route=job.route(),
            gemm_equivalents=gemm_equivalents(
                job.method, job.loss, job.mode, device, DTYPES[job.dtype], job.dim, job.symmetric
            ),
        )
    if job.accuracy:
        del step
        result.update(
            errors_vs_float64(job.method, job.loss, job.batch, job.dim, DTYPES[job.dtype], device, job.symmetric)
        )
    return result


def run_job(job: Job) -> Dict:
    """Run ``job`` in this process; the result's "status" is "ok", "OOM" or "error"."""
    torch.set_num_threads(job.threads)
    torch.manual_seed(0)
    try:
        return {"status": "ok", **_run_method(job)}
    except (MemoryError, OUT_OF_MEMORY) as err:
        return {"status": "OOM", "note": _first_line(err)}
    except Exception as err:  # reported in the table, not raised: one bad configuration must not end the run
        # The CPU allocator reports exhaustion as a plain RuntimeError.
        status = "OOM" if "can't allocate memory" in str(err) else "error"
        return {"status": status, "note": f"{type(err).__name__}: {_first_line(err)}"}


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


def _child(job: Job, conn) -> None:
    conn.send(run_job(job))
    conn.close()


_CONTEXT = None


def _context():
    """The forkserver context, started once with torch, infcl and this module preloaded."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["bench.worker"])
    return _CONTEXT


def run_isolated(job: Job, timeout_s: float) -> Dict:
    """Run ``job`` in a fresh process and return its result dict (never raises for the job's failures)."""
    ctx = _context()
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(job, sender), name=job.label())
    proc.start()
    sender.close()
    result = None
    try:
        if receiver.poll(timeout_s):
            result = receiver.recv()
    except EOFError:
        pass  # the process died before answering: see its exit code below
    if result is None and proc.is_alive():
        proc.kill()
        result = {"status": "timeout", "note": f"no result within {timeout_s:g} s"}
    proc.join()
    if result is None:
        code = proc.exitcode
        if code == -signal.SIGKILL:
            result = {"status": "OOM", "note": "killed by SIGKILL (the OS out-of-memory killer)"}
        else:
            result = {"status": "error", "note": f"worker exited with code {code}"}
    return result


def set_worker_threads(threads: int) -> None:
    """Thread count of every worker; must run before the first job starts the forkserver."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
