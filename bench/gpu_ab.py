"""``python -m bench.gpu_ab``: issue 45's bounded A/B of the chunked route (``backend="chunked"``) on the next GPU.

Under 7 minutes on an H200 (``--budget-s``, default 400 s of steps): each step runs in its own process with its own
timeout (a crash, hang or out-of-memory is recorded and the next step runs) and appends every result to
``ab.csv`` as soon as it has it (step, case, metric, value, unit, note), so a run cut off from outside still
leaves its data; ``steps.csv`` says how each step ended and ``logs.txt`` holds their output. Steps, in order:

1. ``env``: torch / Triton / CUDA versions, the device; whether ``torch.mm`` / ``torch.addmm`` with
   ``out_dtype=torch.float32`` run for bf16 operands (allocating, and into ``out=``).
2. ``gemm``: cuBLAS rates of the route's three products (scores q_c @ k.T, dq's dS @ k, dk's dS.T @ q_c, all with
   float32 results) for C in {1024, 2048, 4096, 8192} at Bk = 65536, D = 512, bf16; and the plain bf16 GEMM's.
3. ``passes``: GB/s of the stats and grad passes (infcl/kernels/chunked_softmax.py) against a plain copy.
4. ``speed``: bf16, D = 512, symmetric forward + backward at B = 16k / 32k / 64k: chunked, fused (``"triton"``),
   vanilla where its logits fit, Inf-CL where it imports: median time (CUDA events), first call, peak memory.
5. ``errors``: against float64 (the torch tiles in float64) at B = 4096, D = 512: bf16 / fp16 / fp32 at TF32,
   symmetric and with labels, ids + guide and SigLIP (both handed to the fused kernels): max errors of loss, dq,
   dk, dscale for chunked, fused and vanilla in that dtype; reruns bit-identical.
6. ``bits``: each chunk's scores computed by the forward's call and again after other products (the backward's
   recomputation) compared bit for bit; a whole forward + backward rerun compared bit for bit, B = 16384.
7. ``million``: one batch of B = 1,048,576, D = 512, bf16, symmetric forward + backward with the chunked route
   (INFCL_CHUNK_BUDGET_MB=8192): time and peak memory.
8. ``open-items``: ``python tools/guided_fault_repro.py bisect`` and the Triton rank / distillation / guide-tie
   tests on the GPU (pytest), their output in logs.txt.

``--dry-run`` runs every step's control flow on CPU tensors at toy sizes (the torch passes for the Triton ones,
the torch tiles for the fused kernels; the commands of step 8 listed, not run): tests/test_chunked_bench.py.
"""

import argparse
import csv
import importlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu-ab"
REPO = Path(__file__).resolve().parent.parent
BUDGET_S = 400
FIELDS = ("step", "case", "metric", "value", "unit", "note")
MILLION = 1_048_576
MILLION_BUDGET_MB = 8192  # C = 960 rows at Bk = 2**20, D = 512 (bf16): 7.6 GiB of workspace on a 141 GB H200


@dataclass(frozen=True)
class Sizes:
    """The shapes of one run: the GPU's, or toy ones for --dry-run."""

    dim: int
    gemm_rows: tuple
    gemm_cols: int
    pass_rows: tuple
    speed: tuple
    check: int
    bits: int
    million: int
    repeats: int


GPU = Sizes(512, (1024, 2048, 4096, 8192), 65536, (2048, 4096), (16384, 32768, 65536), 4096, 16384, MILLION, 3)
DRY = Sizes(32, (16, 32), 256, (16,), (128, 256), 64, 96, 384, 1)


class Rows:
    """ab.csv, appended and flushed row by row."""

    def __init__(self, out: Path, step: str):
        self.path, self.step = out / "ab.csv", step
        if not self.path.exists():
            with open(self.path, "w", newline="") as f:
                csv.writer(f).writerow(FIELDS)

    def add(self, case: str, metric: str, value, unit: str = "", note: str = "") -> None:
        if isinstance(value, float):
            value = f"{value:.6g}"
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow((self.step, case, metric, value, unit, note))
        print(f"{self.step:10} {case:34} {metric:18} {value} {unit} {note}", flush=True)


# ---- timing and products ------------------------------------------------------------------------------------


def _device(dry: bool) -> torch.device:
    return torch.device("cpu" if dry else "cuda")


def timed(fn: Callable, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 result: cuBLAS's out_dtype on a GPU, float32 copies elsewhere (the route's products)."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def _peak_gib(device, base) -> str:
    if device.type != "cuda":
        return "-"
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - base) / 2**30:.3f}"


# ---- the steps ----------------------------------------------------------------------------------------------


def step_env(rows: Rows, sizes: Sizes, dry: bool) -> None:
    import triton

    rows.add("versions", "torch", torch.__version__)
    rows.add("versions", "triton", triton.__version__)
    rows.add("versions", "cuda", str(torch.version.cuda))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.add("device", props.name, props.multi_processor_count, "SMs", f"sm_{props.major}{props.minor}")
    device = _device(dry)
    a = torch.ones(64, 64, dtype=torch.bfloat16, device=device)
    c = torch.zeros(64, 64, device=device)
    forms = {
        "mm out_dtype": lambda: torch.mm(a, a, out_dtype=torch.float32),
        "mm out_dtype out=": lambda: torch.mm(a, a, out_dtype=torch.float32, out=torch.empty_like(c)),
        "addmm out_dtype": lambda: torch.addmm(c, a, a, out_dtype=torch.float32),
        "addmm out_dtype out=c": lambda: torch.addmm(c, a, a, out_dtype=torch.float32, out=c),
    }
    for name, fn in forms.items():
        try:
            ok = bool(torch.equal(fn().float(), torch.full_like(c, 64.0)))
            rows.add("out_dtype", name, int(ok), "runs", "" if ok else "wrong result")
        except Exception as err:  # what this torch does without it is the finding
            rows.add("out_dtype", name, 0, "runs", f"{type(err).__name__}: {str(err)[:120]}")


def _gemm_case(rows: Rows, c: int, k: torch.Tensor, repeats: int, plain: bool) -> None:
    device, (n_k, d) = k.device, k.shape
    q_c = torch.randn(c, d, device=device).to(torch.bfloat16)
    ds = torch.randn(c, n_k, device=device).to(torch.bfloat16)
    flops = 2 * c * n_k * d
    products = {"scores": lambda: mm32(q_c, k.T), "dq": lambda: mm32(ds, k), "dk": lambda: mm32(ds.T, q_c)}
    if plain:
        products["plain bf16 out"] = lambda: q_c @ k.T
    for name, fn in products.items():
        seconds = timed(fn, device, repeats)
        rows.add(f"C={c} Bk={n_k} D={d}", name, flops / seconds / 1e12, "TFLOP/s", f"{seconds * 1e3:.3f} ms")


def step_gemm(rows: Rows, sizes: Sizes, dry: bool) -> None:
    k = torch.randn(sizes.gemm_cols, sizes.dim, device=_device(dry)).to(torch.bfloat16)
    for c in sizes.gemm_rows:
        _gemm_case(rows, c, k, sizes.repeats, plain=c == sizes.gemm_rows[-1])


def _pass_case(rows: Rows, passes, c: int, n_k: int, device: torch.device, repeats: int, dry: bool) -> None:
    from infcl.kernels.chunked_softmax import pass_bytes

    raw = torch.randn(c, n_k, device=device) * 0.3
    pos, scale = torch.arange(c, device=device), torch.tensor(14.0, device=device)
    out = torch.empty(3, c, device=device)
    extra = ([torch.empty(c, n_k, device=device) for _ in range(2)],) if dry else ()
    cols = passes.chunk_stats(raw.clone(), scale, pos, True, out, *extra)
    ds = torch.empty(c, n_k, device=device, dtype=torch.float32 if dry else torch.bfloat16)
    g, g_col = torch.full((c,), 1.0 / c, device=device), torch.full((n_k,), 1.0 / n_k, device=device)
    grad_args = (raw, ds, scale, scale, pos, out[:2].contiguous(), g, cols, g_col, torch.bfloat16, *extra)
    forward_bytes, backward_bytes = pass_bytes(c, n_k, torch.bfloat16, True)
    cases = {
        "copy": (lambda: raw.clone(), 8 * c * n_k),
        "stats pass": (lambda: passes.chunk_stats(raw, scale, pos, True, out, *extra), forward_bytes),
        "grad pass": (lambda: passes.chunk_grad(*grad_args), backward_bytes),
    }
    for name, (fn, nbytes) in cases.items():
        seconds = timed(fn, device, repeats)
        rows.add(f"C={c} Bk={n_k}", name, nbytes / seconds / 1e9, "GB/s", f"{seconds * 1e3:.3f} ms")


def step_passes(rows: Rows, sizes: Sizes, dry: bool) -> None:
    """The Triton passes on a GPU; the torch passes in a dry run (the interpreter would take minutes)."""
    from infcl.backends.chunked import torch_passes

    passes = torch_passes if dry else importlib.import_module("infcl.kernels.chunked_softmax")
    for c in sizes.pass_rows:
        _pass_case(rows, passes, c, sizes.gemm_cols, _device(dry), sizes.repeats, dry)


def _methods(device: torch.device) -> Dict[str, Callable]:
    from bench.methods import _inf_cl_unavailable, inf_cl_loss, vanilla_loss
    from infcl import cal_inf_loss

    fused = "triton" if device.type == "cuda" else "torch"
    out = {
        "chunked": lambda q, k, s: cal_inf_loss(q, k, scale=s, symmetric=True, backend="chunked"),
        f"fused ({fused})": lambda q, k, s: cal_inf_loss(q, k, scale=s, symmetric=True, backend=fused),
        "vanilla": lambda q, k, s: vanilla_loss(q, k, s, True),
    }
    if _inf_cl_unavailable(device, GPU.dim) is None:
        out["inf-cl"] = lambda q, k, s: inf_cl_loss(q, k, s, True)
    return out


def _chunk_plan(q, k, masked: bool = False) -> str:
    """What backend="chunked" does with a block of these features: "C=<rows>", or why the fused kernels run it."""
    from infcl.backends import chunked
    from infcl.contract import Block

    pos = torch.arange(q.shape[0], device=q.device)
    ids = {"q_ids": pos, "k_ids": pos} if masked else {}
    block = Block(q=q.detach(), k=k.detach(), scale=torch.ones((), device=q.device), pos=pos, **ids)
    plan = chunked.BACKEND.plan(block)
    return f"C={plan.rows}" if hasattr(plan, "rows") else plan.reason


def step_speed(rows: Rows, sizes: Sizes, dry: bool) -> None:
    from bench.methods import make_inputs

    device = _device(dry)
    for b in sizes.speed:
        q, k, scale = make_inputs(b, sizes.dim, torch.bfloat16, device)
        rows.add(f"B={b}", "chunk plan", _chunk_plan(q, k))
        for name, loss in _methods(device).items():
            if name == "vanilla" and device.type == "cuda":
                if 5 * b * b * 4 > 0.75 * torch.cuda.get_device_properties(0).total_memory:
                    rows.add(f"B={b} {name}", "skipped", 1, "", "its logits do not fit")
                    continue
            _speed_case(rows, f"B={b} {name}", loss, q, k, scale, sizes.repeats)


def _speed_case(rows: Rows, case: str, loss: Callable, q, k, scale, repeats: int) -> None:
    device = q.device

    def step():
        loss(q, k, scale).backward()
        q.grad = k.grad = scale.grad = None

    base = _peak_reset(device)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rows.add(case, "first call", (time.perf_counter() - t0) * 1e3, "ms")
    seconds = timed(step, device, repeats)
    rows.add(case, "fwd+bwd", seconds * 1e3, "ms", f"peak {_peak_gib(device, base)} GiB")


def _grads(fn, q, k, scale):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, scale)]
    loss = fn(*leaves)
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves]


def _cases(device: torch.device, n: int, dim: int):
    """(name, dtype, tf32, loss kwargs builder, siglip) of the error step."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randperm(n, generator=gen).to(device)
    ids = (torch.arange(n) // 4).to(device)
    guide = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=-1).to(device)
    return (
        ("bf16 symmetric", torch.bfloat16, False, {"symmetric": True}, False),
        ("bf16 labels", torch.bfloat16, False, {"labels": labels}, False),
        ("fp16 symmetric", torch.float16, False, {"symmetric": True}, False),
        ("fp32 tf32 symmetric", torch.float32, True, {"symmetric": True}, False),
        ("bf16 siglip", torch.bfloat16, False, {}, True),
        # Last: the guided Triton kernel faulted once on an H200 (tools/guided_fault_repro.py); a fault ends the step.
        ("bf16 ids+guide", torch.bfloat16, False, {"q_ids": ids, "k_ids": ids, "guide": (guide, guide)}, False),
    )


def _case_losses(kw: dict, siglip: bool, dtype: torch.dtype):
    """(loss by backend name, torch's own loss in that dtype or None) of one error case."""
    from bench.methods import siglip_vanilla_loss, vanilla_loss
    from infcl import cal_inf_loss, cal_siglip_loss

    if siglip:
        return (
            lambda backend: lambda q, k, s: cal_siglip_loss(q, k, s, -10.0, backend=backend),
            lambda q, k, s: siglip_vanilla_loss(q, k, s, False),
        )
    symmetric = kw.get("symmetric", False)
    vanilla = None
    if "guide" not in kw and "labels" not in kw:
        vanilla = lambda q, k, s: vanilla_loss(q, k, s, symmetric)  # noqa: E731
    return (lambda backend: lambda q, k, s: cal_inf_loss(q, k, scale=s, backend=backend, **kw)), vanilla


def step_errors(rows: Rows, sizes: Sizes, dry: bool) -> None:
    from bench.methods import make_inputs

    device, n = _device(dry), sizes.check
    fused = "triton" if device.type == "cuda" else "torch"
    for name, dtype, tf32, kw, siglip in _cases(device, n, sizes.dim):
        q, k, scale = make_inputs(n, sizes.dim, dtype, device, seed=1)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        loss, vanilla = _case_losses(kw, siglip, dtype)
        rows.add(name, "chunk plan", "fused (siglip)" if siglip else _chunk_plan(q, k, masked="guide" in kw))
        truth = _grads(loss("torch"), q.double(), k.double(), scale.double())
        runs = {"chunked": loss("chunked"), f"fused ({fused})": loss(fused)}
        if vanilla is not None:
            runs[f"vanilla {dtype}".replace("torch.", "")] = vanilla
        for method, fn in runs.items():
            got = _grads(fn, q, k, scale)
            for part, g, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
                err = float((g.double() - t).abs().max() / t.abs().max().clamp_min(1e-30))
                rows.add(f"{name} {method}", f"{part} rel err", err, "max|err|/max|truth|")
            if method == "chunked":
                again = _grads(fn, q, k, scale)
                same = all(torch.equal(a, b) for a, b in zip(got, again))
                rows.add(f"{name} {method}", "rerun identical", int(same))
    torch.backends.cuda.matmul.allow_tf32 = False


def step_bits(rows: Rows, sizes: Sizes, dry: bool) -> None:
    from bench.methods import make_inputs
    from infcl import cal_inf_loss
    from infcl.backends import chunked
    from infcl.contract import Block
    from infcl.backends.chunked.products import Products

    device, n = _device(dry), sizes.bits
    q, k, scale = make_inputs(n, sizes.dim, torch.bfloat16, device)
    block = Block(q=q.detach(), k=k.detach(), scale=scale.detach(), pos=torch.arange(n, device=device))
    plan = chunked.BACKEND.plan(block)
    if not hasattr(plan, "rows"):
        rows.add(f"B={n}", "S bits", "-", "", plan.reason)
    else:
        products, same = Products(block, plan), True
        for c in plan.chunks(n):
            buf = torch.empty(c.stop - c.start, n, device=device)
            first = products.scores(c, buf).clone()
            grads = torch.zeros(n, sizes.dim, device=device), torch.zeros(n, sizes.dim, device=device)
            products.accumulate(torch.zeros_like(buf, dtype=plan.ds_dtype), c, block, None, *grads)
            same &= bool(torch.equal(first, products.scores(c, buf)))
        rows.add(f"B={n} C={plan.rows}", "S fwd == bwd bits", int(same))
    fn = lambda q_, k_, s_: cal_inf_loss(q_, k_, scale=s_, symmetric=True, backend="chunked")  # noqa: E731
    first, again = _grads(fn, q, k, scale), _grads(fn, q, k, scale)
    rows.add(f"B={n}", "rerun identical", int(all(torch.equal(a, b) for a, b in zip(first, again))))


def step_million(rows: Rows, sizes: Sizes, dry: bool) -> None:
    from bench.methods import make_inputs
    from infcl import cal_inf_loss

    os.environ["INFCL_CHUNK_BUDGET_MB"] = str(MILLION_BUDGET_MB)
    device, n = _device(dry), sizes.million
    q, k, scale = make_inputs(n, sizes.dim, torch.bfloat16, device)
    rows.add(f"B={n} D={sizes.dim} bf16 symmetric", "chunk plan", _chunk_plan(q, k))
    base = _peak_reset(device)
    t0 = time.perf_counter()
    cal_inf_loss(q, k, scale=scale, symmetric=True, backend="chunked").backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    rows.add(f"B={n} D={sizes.dim} bf16 symmetric", "fwd+bwd", seconds, "s", f"peak {_peak_gib(device, base)} GiB")


OPEN_ITEMS = (
    ("guided fault bisect", [sys.executable, "tools/guided_fault_repro.py", "bisect"], 100),
    (
        "triton rank/distill/guide tie tests",
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "tests/test_retrieval_backends.py",
            "tests/test_distill_backends.py",
            "tests/test_masks_ties_gpu.py",
            "-k",
            "triton or gpu",
        ],  # fmt: skip
        120,
    ),
)


def step_open_items(rows: Rows, sizes: Sizes, dry: bool) -> None:
    for name, cmd, timeout in OPEN_ITEMS:
        if dry:
            rows.add(name, "planned", " ".join(cmd[1:]), "", f"timeout {timeout} s")
            continue
        try:
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            rc, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as err:
            rc, tail = "timeout", str(err.stdout or "")[-3000:]
        print(tail, flush=True)
        last = tail.strip().splitlines()[-1] if tail.strip() else ""
        rows.add(name, "exit", rc, "", last[:160])


# (name, function, timeout seconds): the order of the run.
STEPS = (
    ("env", step_env, 30),
    ("gemm", step_gemm, 40),
    ("passes", step_passes, 30),
    ("speed", step_speed, 90),
    ("errors", step_errors, 90),
    ("bits", step_bits, 30),
    ("million", step_million, 120),
    ("open-items", step_open_items, 240),
)


def run_step(name: str, out: Path, dry: bool) -> None:
    fn = dict((n, f) for n, f, _ in STEPS)[name]
    fn(Rows(out, name), DRY if dry else GPU, dry)


def _record(out: Path, name: str, status: str, seconds: float) -> None:
    path = out / "steps.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(("step", "status", "seconds"))
        writer.writerow((name, status, f"{seconds:.1f}"))


def run_all(out: Path, dry: bool, budget_s: float, in_process: bool, only: Optional[List[str]] = None) -> None:
    """Every step (or ``only``) in order, each in its own process with its timeout, within ``budget_s``."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for name, _, timeout in STEPS:
        if only and name not in only:
            continue
        left = budget_s - (time.perf_counter() - start)
        if left < 5:
            _record(out, name, "skipped: budget spent", 0.0)
            continue
        t0 = time.perf_counter()
        if in_process:
            run_step(name, out, dry)
            status = "ok"
        else:
            cmd = [sys.executable, "-m", "bench.gpu_ab", "--step", name, "--out", str(out)] + (["--dry-run"] * dry)
            with open(out / "logs.txt", "a") as log:
                log.write(f"\n==== {name} ====\n")
                log.flush()
                try:
                    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=log, timeout=min(timeout, left))
                    status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
                except subprocess.TimeoutExpired:
                    status = "timeout"
        _record(out, name, status, time.perf_counter() - t0)
        print(f"---- {name}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--dry-run", action="store_true", help="the control flow on CPU at toy sizes")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S)
    parser.add_argument("--step", choices=[n for n, _, _ in STEPS], help="run one step in this process")
    parser.add_argument("--only", nargs="+", choices=[n for n, _, _ in STEPS], help="run these steps only")
    parser.add_argument("--in-process", action="store_true", help="no subprocess per step (tests)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("python -m bench.gpu_ab measures on a GPU; none is visible (--dry-run runs on CPU)")
    if args.step:
        run_step(args.step, args.out, args.dry_run)
        return
    run_all(args.out, args.dry_run, args.budget_s, args.in_process, args.only)


if __name__ == "__main__":
    main()
