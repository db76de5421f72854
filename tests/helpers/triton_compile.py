"""Compile the Triton kernels for a GPU target on a machine without one, and read ptxas's resource report.

Used by tests/test_triton_compile.py. Each variant runs the real launchers
(:func:`infcl.kernels.softmax_forward.softmax_forward`, :func:`...softmax_backward.softmax_backward`)
on small CPU tensors with a ``wrap`` that compiles each kernel launch for the chosen target instead of
running it, so the compiled set is exactly what the public API launches for those inputs (its
heuristic flags, integer specializations and constexprs). Triton needs an "active driver" only to
name the target: a compile-only stand-in provides it.

The worker processes must import infcl.kernels with TRITON_INTERPRET=0 (Triton decides at
``@triton.jit`` time whether a kernel is interpreted): :func:`init_worker` sets it, and this module
imports nothing from infcl or triton at the top.
"""

import contextlib
import functools
import hashlib
import inspect
import itertools
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

# Largest shared memory a block may use (opt-in dynamic shared memory), bytes.
SMEM_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024, 120: 99 * 1024}
# SMs of the stand-in GPU (the split plans read it): an H100 SXM's 132 for every target.
STAND_IN_SMS = 132
# ptxas's report: "Used 128 registers, ..." and "N bytes spill stores, M bytes spill loads".
_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# Float atomics (atom.global.add.f32, red.global.add.f64, atom.add.noftz.bf16, ...): none may appear.
FLOAT_ATOMIC = re.compile(r"\b(atom|red)\.[\w.]*add[\w.]*\.(f16|bf16|f32|f64)")


@dataclass(frozen=True)
class Variant:
    """One call of a launcher: which phase, target, operand type, shape and tiling."""

    phase: str  # "forward" or "backward"
    arch: int  # 80 or 90
    dtype: str  # "float32", "bfloat16", "float16", "float64"
    precision: str  # "ieee", "tf32" (float32); "ieee" otherwise
    dim: int
    batch: int  # Bq = Bk; a multiple of every block size ("even") or not
    symmetric: bool
    tiling: tuple  # Tiling.to_ints()
    origin: str  # "default" or "autotune #i"

    def label(self) -> str:
        dtype = dtype_label(self.dtype, self.precision)
        sym = "sym" if self.symmetric else "one"
        return f"sm_{self.arch} {self.phase} {dtype} D={self.dim} B={self.batch} {sym} {self.origin}"

    def key(self) -> str:
        return hashlib.sha256(repr(asdict(self)).encode()).hexdigest()[:16]


class CompileOnlyDriver:
    """What Triton (and infcl, which asks it for the target) reads of the active driver, for a GPU that is
    not there: the target, a device, a stream, the device's properties, a benchmarker, and the torch
    device its tensors live on (CPU: the tensors are never read)."""

    def __init__(self, arch: int, bench=None, sms: int = STAND_IN_SMS):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.arch = arch
        self.bench = bench
        self.sms = sms
        self.utils = self  # driver.utils.get_device_properties

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.arch  # one kernel cache per target

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_properties(self, device):
        return {"multiprocessor_count": self.sms, "max_shared_mem": SMEM_LIMITS[self.arch], "warpSize": 32}

    def get_benchmarker(self):
        return self.bench


_CompileOnlyDriver = CompileOnlyDriver


class _Compiler:
    """A launcher's ``wrap``: ``wrap(kernel)[grid](*args, **kw)`` compiles instead of launching, and keeps
    (kernel, compiled kernel, the ptxas -v log of Triton's own ptxas run or None if it was cached)."""

    def __init__(self):
        self.compiled = []

    def __call__(self, kernel):
        def launch(grid):
            def run(*args, **kwargs):
                with _ptxas_logs() as logs:
                    compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
                self.compiled.append((_launched(kernel, args, kwargs), compiled, logs[-1] if logs else None))

            return run

        return type("CompileOnly", (), {"__getitem__": lambda _, grid: launch(grid)})()


@contextlib.contextmanager
def _ptxas_logs():
    """Collect the stderr of the ``ptxas -v`` runs Triton makes while compiling (its exact flags), and
    pass it on to the log file Triton reads."""
    from triton.backends.nvidia import compiler

    logs, real_run = [], compiler.subprocess.run

    def run(cmd, *args, **kwargs):
        if not (isinstance(cmd, list) and "ptxas" in os.path.basename(str(cmd[0])) and "-v" in cmd):
            return real_run(cmd, *args, **kwargs)
        log_file = kwargs.pop("stderr", None)
        check = kwargs.pop("check", False)
        result = real_run(cmd, *args, stderr=subprocess.PIPE, **kwargs)
        log = result.stderr.decode(errors="replace")
        logs.append(log)
        if log_file is not None and hasattr(log_file, "name"):
            with open(log_file.name, "w") as f:
                f.write(log)
        if check and result.returncode:
            raise subprocess.CalledProcessError(result.returncode, cmd, stderr=result.stderr)
        return result

    compiler.subprocess.run = run
    try:
        yield logs
    finally:
        compiler.subprocess.run = real_run


def init_worker() -> None:
    os.environ["TRITON_INTERPRET"] = "0"


# Kernels launched once per direction (their BY_COLUMN constexpr), reported per direction: (row walk, column walk).
DIRECTIONS = {
    "backward": ("dq", "dk"),
    "matryoshka_backward": ("matryoshka_dq", "matryoshka_dk"),
    "masked_matryoshka_backward": ("masked_matryoshka_dq", "masked_matryoshka_dk"),
    "maxsim_backward": ("maxsim_dq", "maxsim_dk"),
}


class _Direction:
    """A kernel of :data:`DIRECTIONS` as one launch ran it: ``label`` names the direction."""

    def __init__(self, fn, label: str):
        self.fn = fn
        self.label = label


def _launched(fn, args: tuple, kwargs: Dict):
    """What a launch's record keeps of its kernel: ``fn``, or for a kernel of :data:`DIRECTIONS` ``fn`` with the
    launch's direction (its ``BY_COLUMN`` argument, by keyword or, as torch.compile's wrapper passes it, by
    position)."""
    from triton.runtime.jit import JITFunction

    name = _kernel_name(fn)
    if name not in DIRECTIONS:
        return fn
    jit = fn
    while not isinstance(jit, JITFunction):
        jit = jit.fn
    given = {**dict(zip(jit.arg_names, args)), **kwargs}
    return _Direction(fn, DIRECTIONS[name][bool(given["BY_COLUMN"])])


def _kernel_name(kernel) -> str:
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, _Direction):
        return kernel.label
    while not isinstance(kernel, JITFunction):  # unwrap triton.heuristics / triton.autotune
        kernel = kernel.fn
    return kernel.__name__.strip("_").replace("_kernel", "")


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself uses for ``arch`` (the wheel's bundled one unless TRITON_PTXAS_PATH says)."""
    from triton.backends.nvidia import compiler

    if inspect.signature(compiler.get_ptxas).parameters:  # a tool per architecture (after Triton 3.5)
        return compiler.get_ptxas(arch).path
    return compiler.get_ptxas().path  # Triton 3.4 / 3.5: one ptxas


@functools.lru_cache(maxsize=None)
def _ptxas_flags(ptxas: str) -> List[str]:
    """The flags Triton's own ptxas call adds that change register allocation: -lineinfo always, and
    --regAllocOptLevel=2 with ptxas 13 (Triton >= 3.7 works around a ptxas 13 allocator bug with it)."""
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    return ["-lineinfo"] + (["--regAllocOptLevel=2"] if "release 13." in version else [])


def _parse_ptxas(log: str) -> Dict[str, int]:
    regs = max(int(x) for x in _REGS.findall(log))
    spills = [int(a) + int(b) for a, b in _SPILLS.findall(log)]
    return {"regs": regs, "spill_bytes": max(spills) if spills else 0}


def _ptxas_report(ptx: str, arch: int, arch_name: str) -> Dict[str, int]:
    """Run ptxas -v ourselves (when Triton's compile came from its cache and ran no ptxas)."""
    ptxas = _ptxas(arch)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run(
            [
                ptxas,
                *_ptxas_flags(ptxas),
                "-v",
                f"--gpu-name={arch_name}",
                src,
                "-o",
                os.path.join(tmp, "kernel.cubin"),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stderr
    return _parse_ptxas(log)


def compile_variant(variant: Variant) -> List[Dict]:
    """Compile every kernel ``variant``'s launcher call launches; one report row per kernel."""
    import torch
    from triton.runtime import driver

    from infcl.kernels import INTERPRETED, Tiling, softmax_backward, softmax_forward

    assert not INTERPRETED, "compile checks need TRITON_INTERPRET=0 before infcl.kernels is imported"
    driver.set_active(_CompileOnlyDriver(variant.arch))
    dtype = getattr(torch, variant.dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    n, dim = variant.batch, variant.dim
    q, k = torch.zeros(n, dim, dtype=dtype), torch.zeros(n, dim, dtype=dtype)
    scale = torch.ones((), dtype=acc)
    pos = torch.arange(n)
    tiling = Tiling.from_ints(list(variant.tiling))
    compiler = _Compiler()
    if variant.phase == "forward":
        softmax_forward.softmax_forward(q, k, scale, pos, variant.symmetric, tiling, variant.precision, wrap=compiler)
    else:
        stats, grads = torch.zeros(2, n, dtype=acc), torch.ones(n, dtype=acc)
        cols = (stats, grads) if variant.symmetric else (None, None)
        softmax_backward.softmax_backward(
            q,
            k,
            scale,
            pos,
            stats,
            grads,
            *cols,
            torch.zeros(n, dim, dtype=acc),
            torch.zeros(n, dim, dtype=acc),
            tiling,
            variant.precision,
            wrap=compiler,
        )
    rows = []
    for kernel, compiled, log in compiler.compiled:
        ptx = compiled.asm["ptx"]
        arch_name = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
        usage = _parse_ptxas(log) if log else _ptxas_report(ptx, variant.arch, arch_name)
        rows.append(
            {
                "variant": variant.label(),
                "kernel": _kernel_name(kernel),
                "num_warps": compiled.metadata.num_warps,
                "smem": compiled.metadata.shared,
                "smem_limit": SMEM_LIMITS[variant.arch],
                "float_atomics": sorted(set(m.group(0) for m in FLOAT_ATOMIC.finditer(ptx))),
                **usage,
            }
        )
    return rows


# (dtype, precision): every operand type the public API can launch.
DTYPES = (("float32", "ieee"), ("float32", "tf32"), ("bfloat16", "ieee"), ("float16", "ieee"), ("float64", "ieee"))
# Targets: sm_90 and sm_80 get their own configs; sm_86 stands for the small-memory family (sm_86, sm_89,
# sm_120: 99 KiB of shared memory per block).
FULL_TARGETS = (90, 80)
SMALL_TARGET = 86
# B = 1000: no block size divides it (every load and store masked or clamped); 1024: every one does.
RAGGED, EVEN = 1000, 1024


def shapes(resident_d: int, full: bool = True):
    """(D, symmetric, B) cases covering every code path of the kernels for one feature chunking:
    the smallest D (one 16-wide chunk, one direction); the largest D that is still one chunk, just
    below it so the chunk is masked (q or k held in registers: the most registers); a D that is
    several whole chunks and whole dq slices (768) on block-multiple batches; and a ragged D (1000)
    on ragged batches. The symmetric loss (column stats, column dS) is the heavier direction, so all
    but the first case use it. ``full=False``: only the two heaviest cases."""
    heavy = [(resident_d - 5, True, RAGGED), (1000, True, RAGGED)]
    return heavy if not full else [(1, False, RAGGED), heavy[0], (768, True, EVEN), heavy[1]]


def variants() -> List[Variant]:
    """Every launch the public API can make that compiles to different code, per target: each dtype x
    each case of :func:`shapes` x both phases with the default configs (fp16's forward, bf16's twin,
    on the heavy cases only); each autotune config other than the default on the ragged D case; and
    the small-memory family's defaults on the heavy cases."""
    import torch

    from infcl.kernels import softmax_backward, softmax_forward
    from infcl.kernels.configs import FEATURE_CHUNKS, FLOAT64_DOT, operand_class_of
    from infcl.kernels.target import arch_key
    from infcl.kernels.tiling import tiling_for

    out = []

    def add(arch, dtype, precision, cases, tiling, origin, phases=("forward", "backward")):
        for phase in phases:
            for dim, symmetric, batch in cases:
                out.append(
                    Variant(phase, arch, dtype, precision, dim, batch, symmetric, tuple(tiling.to_ints()), origin)
                )

    for arch in FULL_TARGETS + (SMALL_TARGET,):
        for dtype, precision in DTYPES:
            if dtype == "float64" and not FLOAT64_DOT:
                continue  # Triton 3.4: float64 blocks run on the torch tiles, no kernel is launched
            torch_dtype = getattr(torch, dtype)
            operand_class = operand_class_of(torch_dtype, precision)
            default = tiling_for(arch_key((arch // 10, arch % 10)), torch_dtype, precision)
            resident_d = FEATURE_CHUNKS[operand_class][0]
            if arch == SMALL_TARGET:
                add(arch, dtype, precision, shapes(resident_d, full=False), default, "default")
                continue
            add(arch, dtype, precision, shapes(resident_d, full=dtype != "float16"), default, "default", ("forward",))
            add(arch, dtype, precision, shapes(resident_d), default, "default", ("backward",))
            if dtype == "bfloat16":
                continue  # the "mma" class's autotune configs are compiled at fp16 (dS normalization: more registers)
            # the autotune lists at the ragged D case (1000), around that D's defaults
            key, ragged = (arch_key((arch // 10, arch % 10)), operand_class, True), [shapes(resident_d)[-1]]
            default = tiling_for(key[0], torch_dtype, precision, ragged[0][0])
            for i, cfg in enumerate(softmax_forward.AUTOTUNE_CONFIGS[key]):
                if cfg != default.forward:
                    add(arch, dtype, precision, ragged, replace(default, forward=cfg), f"autotune #{i}", ("forward",))
            pairs = itertools.zip_longest(
                softmax_backward.DQ_AUTOTUNE_CONFIGS[key], softmax_backward.DK_AUTOTUNE_CONFIGS[key]
            )
            for i, (dq, dk) in enumerate(pairs):
                dq, dk = dq or default.dq, dk or default.dk  # the lists may differ in length
                if (dq, dk) != (default.dq, default.dk):
                    add(arch, dtype, precision, ragged, replace(default, dq=dq, dk=dk), f"autotune #{i}", ("backward",))
    return out


# ==== the public API, compile-only ==================================================================
#
# :func:`run_call` makes one public call (cal_inf_loss, cal_siglip_loss, InfCLIPLoss, InfSigLipLoss) with
# backend="triton" on CPU tensors, forward and backward, with everything real (the backend choice, the
# custom-op registration: triton_op + wrap_triton, the configs, split plans and the
# autotuner) except Triton's active driver, which is :class:`CompileOnlyDriver`, and JITFunction.run,
# which compiles (``warmup=True``) instead of launching. Every compiled kernel is checked by ptxas.

# Targets in the API check; sm_100 and sm_120 only where the wheel's ptxas knows them.
API_TARGETS = (90, 80, 86, 100, 120)
# The feature dims of the check: D = 1 (one masked chunk), 40 (one chunk, not a multiple of 16), 128 (one
# whole chunk of tensor cores' widest), 256 / 512 / 768 (whole chunks, one or several dq slices), 384 (whole
# chunks, a ragged last dq / dk slice: its operand load is masked, not clamped) and 1000 (ragged chunks and
# slices).
API_DIMS = (1, 40, 128, 256, 384, 512, 768, 1000)
# Batches: 100 rows (no block divides it) and 128 (every block divides it); Bk > Bq: 100 x 160.
RAGGED_BATCH, EVEN_BATCH, WIDE_BATCH = 100, 128, 160
# The guide's width in the masked calls: not a whole number of guide chunks (16 or 32), several of them.
GUIDE_DIM = 100
# topk_scores' n in the gate: a typical list (16 slots); with it the widest the kernel holds for the dtype
# (infcl.kernels.topk.max_top).
TOPK_N = 10


def topk_ns(dtype: str) -> Tuple[int, int]:
    import torch

    from infcl.kernels.topk import max_top

    return TOPK_N, max_top(getattr(torch, dtype))


@dataclass(frozen=True)
class Call:
    """One public-API call: forward and backward with backend="triton"."""

    arch: int
    entry: str  # "cal_inf_loss", "cal_siglip_loss", "InfCLIPLoss", "InfSigLipLoss", "topk_scores" (no backward)
    dtype: str  # "float32", "bfloat16", "float16", "float64"
    precision: str  # float32: "ieee" or "tf32" (set through torch.backends.cuda.matmul.allow_tf32)
    dim: int
    n_q: int
    n_k: int
    symmetric: bool = False
    labels: bool = False
    autotune: bool = False
    masks: str = ""  # cal_inf_loss's mask options: "", "ids", "guide" or "both"; cal_siglip_loss's: "" or "ids"
    multi_positive: str = ""  # "", "mean" or "sum" (with ids)
    # A pinned Tiling (Tiling.to_ints()) for the triton backend's calls, passed as a user passes one:
    # ``backend=TritonBackend(tiling=...)`` (:func:`call_backend`); () for the device's defaults.
    tiling: tuple = ()
    topk: int = 0  # topk_scores' n
    backend: str = "triton"  # or "chunked": the chunked route's passes (cal_inf_loss and cal_siglip_loss)
    reduction: str = "mean"  # cal_siglip_loss's ("none": the chunked route's loss-only and gradient-only passes)
    matryoshka: tuple = ()  # cal_inf_loss's Matryoshka prefix dims (renormalized but the last), () for none
    label_smoothing: float = 0.0  # cal_inf_loss's label_smoothing (with masks: the masked kernels' kept sums)

    def label(self) -> str:
        dtype = dtype_label(self.dtype, self.precision)
        extra = "".join(
            [
                " sym" if self.symmetric else "",
                " labels" if self.labels else "",
                " autotune" if self.autotune else "",
                f" {self.masks}" if self.masks else "",
                f" {self.multi_positive}" if self.multi_positive else "",
                f" tiling={'-'.join(map(str, self.tiling))}" if self.tiling else "",
                f" n={self.topk}" if self.topk else "",
                f" {self.backend}" if self.backend != "triton" else "",
                f" {self.reduction}" if self.reduction != "mean" else "",
                f" matryoshka={'-'.join(map(str, self.matryoshka))}" if self.matryoshka else "",
                f" ls={self.label_smoothing}" if self.label_smoothing else "",
            ]
        )
        return f"sm_{self.arch} {self.entry} {dtype} D={self.dim} {self.n_q}x{self.n_k}{extra}"


def ptxas_knows(arch: int) -> bool:
    """Whether the ptxas Triton uses for ``arch`` can compile for it (sm_100 / sm_120 need CUDA >= 12.8)."""
    try:
        ptxas = _ptxas(arch)
    except Exception:
        return False
    out = subprocess.run([ptxas, "--help"], capture_output=True, text=True).stdout
    return f"sm_{arch}" in out


class _Recorder:
    """JITFunction.run replaced by a compile: each launch's compiled kernel with Triton's ptxas log, and
    (in ``launches``, same order) its grid and scalar arguments (bench/static reads the block sizes)."""

    def __init__(self):
        self.compiled = []
        self.launches = []

    def install(self):
        from triton.runtime.jit import JITFunction

        real_run = JITFunction.run
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            with _ptxas_logs() as logs:
                kernel = real_run(fn, *args, grid=grid, warmup=True, **kwargs)
            recorder.compiled.append((_launched(fn, args, kwargs), kernel, logs[-1] if logs else None))
            scalars = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))}
            recorder.launches.append({"grid": tuple(grid(kwargs)) if callable(grid) else tuple(grid), **scalars})
            return kernel

        JITFunction.run = run


_RECORDER = None
_REPORTS: Dict[str, Dict] = {}  # per compiled kernel (its hash): the resource row, computed once per process


def _bench(kernel_call, quantiles=None, **kwargs):
    """The autotuner's benchmarker: compile the trial (through the recorder) and call every config equal.
    A trial that fails is an error of the check, not an "infinitely slow" config the autotuner skips."""
    try:
        kernel_call()
    except Exception as err:
        raise RuntimeError(f"an autotune trial failed: {type(err).__name__}: {err}") from err
    return [1.0, 1.0, 1.0] if quantiles else 1.0


def _resources(fn, kernel, log, arch: int) -> Dict:
    key = f"{arch}:{kernel.hash}" if hasattr(kernel, "hash") else f"{arch}:{id(kernel)}"
    if key not in _REPORTS:
        ptx = kernel.asm["ptx"]
        arch_name = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
        usage = _parse_ptxas(log) if log else _ptxas_report(ptx, arch, arch_name)
        _REPORTS[key] = {
            "kernel": _kernel_name(fn),
            "num_warps": kernel.metadata.num_warps,
            "num_stages": kernel.metadata.num_stages,
            "smem": kernel.metadata.shared,
            "smem_limit": SMEM_LIMITS[arch],
            "float_atomics": sorted(set(m.group(0) for m in FLOAT_ATOMIC.finditer(ptx))),
            "hash": key,
            **usage,
        }
    return _REPORTS[key]


def _inputs(call: Call):
    import torch

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, call.dtype)
    q = torch.randn(call.n_q, call.dim, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(call.n_k, call.dim, generator=gen).to(dtype).requires_grad_()
    labels = torch.randperm(call.n_k, generator=gen)[: call.n_q] if call.labels else None
    return q, k, labels


def _params():
    """(scale, bias), leaves that receive gradients."""
    import torch

    return torch.tensor(2.0, requires_grad=True), torch.tensor(-1.0, requires_grad=True)


def mask_options(call: Call) -> Dict:
    """cal_inf_loss's mask keywords for ``call``: ids from a few classes (repeats), a guide of width
    GUIDE_DIM (ragged over every guide chunk) in the features' dtype, ``multi_positive``."""
    import torch

    if not call.masks:
        return {}
    gen = torch.Generator().manual_seed(1)
    opts = {"multi_positive": call.multi_positive or None}
    if call.masks in ("ids", "both"):
        opts.update(
            q_ids=torch.randint(0, 7, (call.n_q,), generator=gen), k_ids=torch.randint(0, 7, (call.n_k,), generator=gen)
        )
    if call.masks in ("guide", "both"):
        dtype = getattr(torch, call.dtype)
        guide = [torch.randn(n, GUIDE_DIM, generator=gen).to(dtype) for n in (call.n_q, call.n_k)]
        opts.update(guide=tuple(guide), guide_margin=0.1)
    return opts


def sigmoid_ids(call: Call) -> Dict:
    """cal_siglip_loss's ids for ``call`` (``masks="ids"``): a few classes, so rows have several positives."""
    import torch

    if call.masks != "ids":
        return {}
    gen = torch.Generator().manual_seed(1)
    return {
        "q_ids": torch.randint(0, 7, (call.n_q,), generator=gen),
        "k_ids": torch.randint(0, 7, (call.n_k,), generator=gen),
    }


def call_topk(call: Call, q, k):
    """topk_scores with backend="triton" on q and k (no gradient); with ``labels``, labels excluded and ids
    of a few classes."""
    import torch

    import infcl

    gen = torch.Generator().manual_seed(2)
    opts = {}
    if call.labels:
        opts.update(
            labels=torch.randint(-1, call.n_k, (call.n_q,), generator=gen),
            exclude_labels=True,
            q_ids=torch.randint(0, 7, (call.n_q,), generator=gen),
            k_ids=torch.randint(0, 7, (call.n_k,), generator=gen),
        )
    return infcl.topk_scores(q.detach(), k.detach(), call.topk, backend="triton", **opts)


def call_loss(call: Call, q, k, labels, scale, bias, masks: Optional[Dict] = None):
    """The public call ``call`` names, on q and k: the loss (a 0-d tensor). ``masks``: cal_inf_loss's mask
    keywords (default :func:`mask_options`)."""
    import infcl

    backend = call_backend(call)
    if call.entry == "cal_inf_loss":
        masks = mask_options(call) if masks is None else masks
        if call.matryoshka:
            flags = (True,) * (len(call.matryoshka) - 1) + (False,)
            masks = {**masks, "matryoshka": infcl.Matryoshka(call.matryoshka, renormalize=flags)}
        if call.label_smoothing:
            masks = {**masks, "label_smoothing": call.label_smoothing}
        return infcl.cal_inf_loss(q, k, labels, scale=scale, symmetric=call.symmetric, backend=backend, **masks)
    if call.entry == "cal_siglip_loss":
        return infcl.cal_siglip_loss(
            q, k, scale, bias, labels, reduction=call.reduction, backend=backend, **sigmoid_ids(call)
        ).sum()
    if call.entry == "InfCLIPLoss":
        return infcl.InfCLIPLoss(backend=backend)(q, k, scale)
    return infcl.InfSigLipLoss(backend=backend)(q, k, scale, bias)


@contextlib.contextmanager
def compile_only(arch: int, sms: int = STAND_IN_SMS):
    """Triton's active driver is the stand-in for sm_``arch`` (``sms`` SMs, which the split plans read) and
    every launch compiles instead of running."""
    global _RECORDER
    from triton.runtime import driver

    if _RECORDER is None:
        _RECORDER = _Recorder()
        _RECORDER.install()
    driver.set_active(CompileOnlyDriver(arch, bench=_bench, sms=sms))
    # Left active afterwards: Triton's reset_active would build the real driver, which fails without a GPU.
    yield _RECORDER.compiled, len(_RECORDER.compiled)


def call_backend(call: Call):
    """The ``backend=`` argument of ``call``: its backend's name, or with a pinned tiling the Triton backend object
    carrying it (the options from the call, as a user passes them)."""
    if not call.tiling:
        return call.backend
    from infcl.backends.triton import TritonBackend
    from infcl.kernels import Tiling

    return TritonBackend(tiling=Tiling.from_ints(list(call.tiling)))


def report_call(call, run: Callable[[], None], autotune: bool = False) -> Dict:
    """Run ``run()`` (a call's forward and backward) compile-only for ``call.arch``: {"call", "error" or
    "kernels": [resource rows]}. Shared by every compile check (losses, top-k, ranks, distillation)."""
    import torch

    from infcl.kernels import INTERPRETED

    assert not INTERPRETED, "compile checks need TRITON_INTERPRET=0 before infcl.kernels is imported"
    os.environ["INFCL_AUTOTUNE"] = "1" if autotune else "0"
    torch.backends.cuda.matmul.allow_tf32 = call.precision == "tf32"
    try:
        with compile_only(call.arch) as (compiled, start):
            run()
            launches = compiled[start:]
            if not launches:
                raise AssertionError("no kernel was launched")
            rows = [_resources(fn, kernel, log, call.arch) for fn, kernel, log in launches]
    except Exception as err:  # reported per call: one failure must not hide the others
        import traceback

        return {
            "call": call.label(),
            "error": f"{type(err).__name__}: {str(err)[-1500:]}\n"
            f"{''.join(traceback.format_exc().splitlines(True)[-6:])}",
        }
    return {"call": call.label(), "kernels": rows}


def run_call(call: Call) -> Dict:
    """Make ``call`` (forward + backward) compile-only; {"call", "error" or "kernels": [resource rows]}."""

    def run():
        q, k, labels = _inputs(call)
        if call.entry == "topk_scores":
            call_topk(call, q, k)
        else:
            call_loss(call, q, k, labels, *_params()).backward()

    return report_call(call, run, call.autotune)


def api_calls(full: bool) -> List[Call]:
    """The calls of the check, per target whose ptxas the wheel has, per dtype (fp32 ieee / tf32, bf16,
    fp16, fp64 where tl.dot has it; CI's subset per target: :func:`api_dtypes`).

    ``full``: every D of :data:`API_DIMS` for cal_inf_loss symmetric and cal_siglip_loss on a ragged
    batch and for cal_inf_loss one-directional with labels and Bk > Bq; an even batch; both modules; the
    autotuned path (each config of its search space compiled as a trial) for both directions.

    CI (not ``full``; D = 256 / 512 / 768 compile to the same kernels, so they stand in for each other):
    on sm_90, D = 40, 384, 512 and 1000 symmetric (512: several whole chunks, whose S tile is not ragged
    D's; 384: the same with a ragged last slice) and sigmoid, D = 1 one-directional with labels and
    Bk > Bq, an even batch through both modules, and the autotuned symmetric path at D = 1000; on the other
    targets the heaviest cases (symmetric at D = 40 and 1000, and 384 on tensor cores; sigmoid at 1000,
    ragged) and the autotuned symmetric path in bf16.

    The mask options (:func:`masked_calls`): ``full``, every mask kind on every target and dtype; CI,
    sm_90 and sm_80 in bf16 and fp32 (ieee; tf32 on sm_90 for the heaviest case).
    """
    from infcl.kernels.configs import FLOAT64_DOT

    out = []
    ragged, wide, even = (RAGGED_BATCH, RAGGED_BATCH), (RAGGED_BATCH, WIDE_BATCH), (EVEN_BATCH, EVEN_BATCH)
    for arch in API_TARGETS:
        if not ptxas_knows(arch):
            continue
        for dtype, precision in api_dtypes(arch, full, FLOAT64_DOT):

            def add(entry, dims, sizes, arch=arch, dtype=dtype, precision=precision, **kw):
                out.extend(Call(arch, entry, dtype, precision, dim, *sizes, **kw) for dim in dims)

            if full:
                add("cal_inf_loss", API_DIMS, ragged, symmetric=True)
                add("cal_siglip_loss", API_DIMS, ragged)
                add("cal_inf_loss", API_DIMS, wide, labels=True)
                add("cal_siglip_loss", (1000,), wide, labels=True)
                add("cal_inf_loss", API_DIMS, even, symmetric=True)
                add("cal_siglip_loss", API_DIMS, even)
                add("InfCLIPLoss", (768,), even)
                add("InfSigLipLoss", (768,), even)
                add("cal_inf_loss", (1000,), ragged, autotune=True)
                add("cal_inf_loss", (1000,), ragged, symmetric=True, autotune=True)
            elif arch == 90:
                add("cal_inf_loss", (40, 384, 512, 1000), ragged, symmetric=True)
                # Block-multiple batches compile the unmasked (EVEN_M/N) loads: fewer registers go to
                # masks, more to the pipeline, so a ragged D spills there first.
                add("cal_inf_loss", (1000,), even, symmetric=True)
                add("cal_siglip_loss", (512, 1000), even)
                add("cal_siglip_loss", (40, 1000), ragged)
                add("cal_inf_loss", (1,), wide, labels=True)
                add("InfCLIPLoss", (256,), even)
                add("InfSigLipLoss", (256,), even)
                add("cal_inf_loss", (1000,), ragged, symmetric=True, autotune=True)
            else:
                # D = 384 on tensor cores: whole chunks beyond one, where the S tile is not ragged D's, and a
                # ragged last slice.
                tensor_cores = dtype in ("bfloat16", "float16") or precision == "tf32"
                add("cal_inf_loss", (40, 384, 1000) if tensor_cores else (40, 1000), ragged, symmetric=True)
                add("cal_siglip_loss", (1000,), ragged)
                add("cal_inf_loss", (1000,), even, symmetric=True)
                add("cal_siglip_loss", (512, 1000), even)
                if dtype == "bfloat16":
                    add("cal_inf_loss", (1000,), ragged, symmetric=True, autotune=True)
            out.extend(masked_calls(arch, dtype, precision, full))
            out.extend(sigmoid_id_calls(arch, dtype, precision, full))
            out.extend(matryoshka_calls(arch, dtype, precision, full))
            out.extend(topk_calls(arch, dtype, precision, full))
        out.extend(chunked_calls(arch))
    return out


# The targets the sigmoid loss with ids compiles on in CI (issue 56), every dtype.
SIGMOID_ID_TARGETS = (90, 80, 100)


def sigmoid_id_calls(arch: int, dtype: str, precision: str, full: bool) -> List[Call]:
    """cal_siglip_loss with ids (several positives per row; the kernels' HAS_IDS): ragged at D = 1000 (the
    plain sigmoid's heaviest CI case) on :data:`SIGMOID_ID_TARGETS`; ``full``: every D of :data:`API_DIMS`
    ragged and one-directional Bk > Bq at D = 1000, on every target."""
    if not (full or arch in SIGMOID_ID_TARGETS):
        return []
    ragged, wide = (RAGGED_BATCH, RAGGED_BATCH), (RAGGED_BATCH, WIDE_BATCH)
    cases = [(dim, ragged) for dim in (API_DIMS if full else (1000,))] + ([(1000, wide)] if full else [])
    return [Call(arch, "cal_siglip_loss", dtype, precision, dim, *sizes, masks="ids") for dim, sizes in cases]


# The targets the fused Matryoshka loss compiles on in CI (issue 56), every dtype; its prefix dims: a ragged
# chunk boundary in every segment and one below a chunk, the widest not renormalized.
MATRYOSHKA_TARGETS = (90, 80, 100)
MATRYOSHKA_DIMS = (1000, 512, 100, 37)
# A one-wide renormalized first prefix: the backward's SIGN_ONLY variant (Prefixes.sign_only), on sm_90 in CI.
MATRYOSHKA_SIGN_ONLY_DIMS = (1, 1000, 512, 100)
# The fused Matryoshka kernels' masked variant (masked_matryoshka_forward / _dq / _dk beside the guide scores'
# kernel): (masks, multi_positive, symmetric) on MATRYOSHKA_TARGETS in every dtype; a full run adds the rest.
MATRYOSHKA_MASKS = (("both", "sum", True), ("ids", "", False))
MATRYOSHKA_MASKS_FULL = (("guide", "", True), ("both", "mean", False), ("ids", "mean", True))


def matryoshka_calls(arch: int, dtype: str, precision: str, full: bool) -> List[Call]:
    """cal_inf_loss with ``matryoshka`` (issue 56; infcl/kernels/matryoshka.py): symmetric on a ragged batch at
    D = 1000 (several chunks and slices, every segment ragged) on :data:`MATRYOSHKA_TARGETS`, and with a one-wide
    renormalized first prefix (:data:`MATRYOSHKA_SIGN_ONLY_DIMS`) on sm_90, and with the mask options
    (:data:`MATRYOSHKA_MASKS`: the masked kernels); ``full``: also one-directional with labels and Bk > Bq at
    D = 384 (dims 384, 64), the one-wide prefix and every mask kind (:data:`MATRYOSHKA_MASKS_FULL`), on every
    target."""
    if not (full or arch in MATRYOSHKA_TARGETS):
        return []
    ragged, wide = (RAGGED_BATCH, RAGGED_BATCH), (RAGGED_BATCH, WIDE_BATCH)
    out = [Call(arch, "cal_inf_loss", dtype, precision, 1000, *ragged, symmetric=True, matryoshka=MATRYOSHKA_DIMS)]
    if full or arch == 90:
        sign_only = MATRYOSHKA_SIGN_ONLY_DIMS
        out.append(Call(arch, "cal_inf_loss", dtype, precision, 1000, *ragged, symmetric=True, matryoshka=sign_only))
    if full:
        out.append(Call(arch, "cal_inf_loss", dtype, precision, 384, *wide, labels=True, matryoshka=(384, 64)))
    for masks, mode, symmetric in MATRYOSHKA_MASKS + (MATRYOSHKA_MASKS_FULL if full else ()):
        out.append(
            Call(
                arch,
                "cal_inf_loss",
                dtype,
                precision,
                1000,
                *ragged,
                symmetric=symmetric,
                masks=masks,
                multi_positive=mode,
                matryoshka=MATRYOSHKA_DIMS,
            )
        )
    return out


def topk_calls(arch: int, dtype: str, precision: str, full: bool) -> List[Call]:
    """topk_scores on a ragged corpus (every D of :data:`API_DIMS` in a full run; CI: D = 384, several
    chunks, the last ragged) with each n of :func:`topk_ns`, and with ``labels`` (exclude_labels and ids).
    Its kernel takes float32 at "ieee" whatever torch's matmul precision, so the tf32 pass adds nothing. CI:
    sm_90 and sm_80."""
    if precision == "tf32" or not (full or arch in (90, 80)):
        return []
    dims = API_DIMS if full else (384,)
    out = []
    for dim in dims:
        for n_top in topk_ns(dtype):
            out.append(Call(arch, "topk_scores", dtype, precision, dim, RAGGED_BATCH, WIDE_BATCH + 3, topk=n_top))
        out.append(
            Call(arch, "topk_scores", dtype, precision, dim, RAGGED_BATCH, WIDE_BATCH + 3, labels=True, topk=TOPK_N)
        )
    return out


# The chunked route's passes compile on these targets (issue 45: the GPUs it is measured on next).
CHUNKED_TARGETS = (90, 80, 100)


def chunked_calls(arch: int) -> List[Call]:
    """cal_inf_loss with backend="chunked" (infcl/kernels/chunked_softmax.py's stats, merge and grad passes; on
    CPU tensors the products are torch's, only the passes compile): in bf16 symmetric on a ragged and a
    block-multiple batch and one-directional with labels and Bk > Bq; fp16 (its row-scaled dS) and fp32 symmetric
    on a ragged batch. cal_siglip_loss with backend="chunked" (infcl/kernels/chunked_sigmoid.py): the one pass of
    "mean" in bf16 (ragged, and labels with Bk > Bq), fp16 and fp32; "none"'s loss-only and gradient-only passes in
    bf16 and fp16. The passes read only the [C, Bk] scores, so D is immaterial (40)."""
    if arch not in CHUNKED_TARGETS:
        return []
    ragged, wide, even = (RAGGED_BATCH, RAGGED_BATCH), (RAGGED_BATCH, WIDE_BATCH), (EVEN_BATCH, EVEN_BATCH)
    cases = (
        ("bfloat16", ragged, {"symmetric": True}),
        ("bfloat16", even, {"symmetric": True}),
        ("bfloat16", wide, {"labels": True}),
        ("float16", ragged, {"symmetric": True}),
        ("float32", ragged, {"symmetric": True}),
    )
    sigmoid = (
        ("bfloat16", ragged, {}),
        ("bfloat16", wide, {"labels": True}),
        ("bfloat16", even, {"reduction": "none"}),
        ("float16", ragged, {}),
        ("float16", ragged, {"reduction": "none"}),
        ("float32", ragged, {}),
    )
    return [
        Call(arch, "cal_inf_loss", dtype, "ieee", 40, *sizes, backend="chunked", **kw) for dtype, sizes, kw in cases
    ] + [
        Call(arch, "cal_siglip_loss", dtype, "ieee", 40, *sizes, backend="chunked", **kw)
        for dtype, sizes, kw in sigmoid
    ]


# Every kernel family compiles at least once in the floor subset (:func:`floor_calls`).
FLOOR_KERNELS = frozenset(
    {"forward", "dq", "dk", "siglip_forward", "siglip_backward", "guide_label_scores", "topk"}
    | {"chunk_stats", "merge_chunk", "chunk_grad"}
    | {"matryoshka_forward", "matryoshka_dq", "matryoshka_dk"}
    | {"masked_matryoshka_forward", "masked_matryoshka_dq", "masked_matryoshka_dk"}
)


def floor_calls() -> List[Call]:
    """The part of :func:`api_calls`'s CI matrix that compiles every kernel family once, for the oldest Triton
    infcl supports (.ci/run's floor step, in a second virtual environment; every call is one of the matrix's or
    :func:`smoothing_calls`', so under the newest Triton it costs nothing beside them): on sm_90 the softmax
    kernels on tensor cores (bf16, D = 384: whole chunks and a ragged slice), in fp32 FMA and (Triton >= 3.5) fp64
    (D = 40), autotuned (bf16, D = 1000), with ids and a guide ("sum", D = 1000; and with label smoothing: the
    masked kernels' kept sums), the sigmoid kernels, the top-k search and the chunked route's passes and the fused
    Matryoshka loss (bf16, D = 1000; also with a one-wide renormalized first prefix, and with ids and a guide,
    "sum": its masked kernels); on sm_80 the softmax kernels
    in bf16 (the pre-wgmma MMA). The ranks' and distillation kernels: :func:`rank_distill_compile.floor_calls`."""
    from infcl.kernels.configs import FLOAT64_DOT

    ragged = (RAGGED_BATCH, RAGGED_BATCH)
    smoothing = dict(symmetric=True, masks="both", multi_positive="sum", label_smoothing=SMOOTHING)
    float64 = [Call(90, "cal_inf_loss", "float64", "ieee", 40, *ragged, symmetric=True)] if FLOAT64_DOT else []
    return float64 + [
        Call(90, "cal_inf_loss", "bfloat16", "ieee", 384, *ragged, symmetric=True),
        Call(90, "cal_inf_loss", "float32", "ieee", 40, *ragged, symmetric=True),
        Call(90, "cal_inf_loss", "bfloat16", "ieee", 1000, *ragged, symmetric=True, autotune=True),
        Call(90, "cal_inf_loss", "bfloat16", "ieee", 1000, *ragged, symmetric=True, masks="both", multi_positive="sum"),
        Call(90, "cal_inf_loss", "bfloat16", "ieee", 1000, *ragged, **smoothing),
        Call(90, "cal_siglip_loss", "bfloat16", "ieee", 1000, *ragged),
        Call(90, "topk_scores", "bfloat16", "ieee", 384, RAGGED_BATCH, WIDE_BATCH + 3, labels=True, topk=TOPK_N),
        Call(90, "cal_inf_loss", "bfloat16", "ieee", 40, *ragged, symmetric=True, backend="chunked"),
        Call(80, "cal_inf_loss", "bfloat16", "ieee", 384, *ragged, symmetric=True),
        *(
            Call(90, "cal_inf_loss", "bfloat16", "ieee", 1000, *ragged, symmetric=True, matryoshka=dims)
            for dims in (MATRYOSHKA_DIMS, MATRYOSHKA_SIGN_ONLY_DIMS)
        ),
        Call(
            90,
            "cal_inf_loss",
            "bfloat16",
            "ieee",
            1000,
            *ragged,
            symmetric=True,
            masks="both",
            multi_positive="sum",
            matryoshka=MATRYOSHKA_DIMS,
        ),
    ]


def dtype_label(dtype: str, precision: str) -> str:
    """How a call's label names its (dtype, precision): fp32-ieee, fp32-tf32, bf16, fp16, fp64."""
    return {"float32": f"fp32-{precision}", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}[dtype]


def api_dtypes(arch: int, full: bool, float64_dot: bool) -> List[Tuple[str, str]]:
    """The (dtype, precision) pairs :func:`api_calls` compiles on ``arch``: every one on every target, CI
    included (fp32 "ieee" and "tf32", bf16, fp16, and fp64 where ``tl.dot`` has it: Triton >= 3.5). ``full``
    widens the dims and batches, never the dtypes: fp16 beside bf16 and the FMA classes beyond sm_80 were once
    left out of CI for time only, and CI's budget of 30 minutes holds them."""
    dtypes = [("float32", "ieee"), ("float32", "tf32"), ("bfloat16", "ieee"), ("float16", "ieee")]
    if float64_dot:
        dtypes.append(("float64", "ieee"))
    return dtypes


def big_tile_calls(arch: int = 90) -> List[Call]:
    """Pinned one-chunk tiles with more than 2**20 products per S tile (128 x 128 rows at D = 128), softmax
    (symmetric) and sigmoid, in bf16: a kernel's interpreter-only code must not be traced on a GPU target
    (Triton caps a tensor at 2**20 entries, and score_tiles.score_dot's interpreter product is [M, N, D])."""
    from infcl.kernels import TileConfig, Tiling

    big = TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=1, block_out=128, max_registers=255)
    tiling = tuple(Tiling(forward=big, dq=big, dk=big, resident_d=128, chunk_d=64).to_ints())
    sizes = (RAGGED_BATCH, RAGGED_BATCH)
    return [
        Call(arch, "cal_inf_loss", "bfloat16", "ieee", 128, *sizes, symmetric=True, tiling=tiling),
        Call(arch, "cal_siglip_loss", "bfloat16", "ieee", 128, *sizes, tiling=tiling),
    ]


# The mask kinds of the check, (masks, multi_positive): ids alone (false negatives), several positives by
# id ("mean", "sum"), a guide alone, and a guide with ids.
MASK_KINDS = (
    ("ids", ""),
    ("ids", "mean"),
    ("ids", "sum"),
    ("guide", ""),
    ("both", ""),
    ("both", "mean"),
    ("both", "sum"),
)


def masked_calls(arch: int, dtype: str, precision: str, full: bool) -> List[Call]:
    """cal_inf_loss with mask options. ``full``: each of :data:`MASK_KINDS` symmetric on a ragged batch
    at D = 40 and 1000 and one-directional with labels and Bk > Bq at D = 1000. CI: on sm_90 and sm_80
    in bf16 and fp32 ieee, ids alone symmetric at D = 1000, a guide alone one-directional with Bk > Bq
    at D = 40, ids and a guide with "mean" symmetric at D = 40 and with "sum" symmetric at D = 1000
    (ragged) and ids with "sum" one-directional at D = 1000 on a block-multiple batch; tf32 on sm_90:
    the "sum" case with a guide (the most registers)."""
    ragged, wide, even = (RAGGED_BATCH, RAGGED_BATCH), (RAGGED_BATCH, WIDE_BATCH), (EVEN_BATCH, EVEN_BATCH)
    cases = []
    if full:
        for masks, multi in MASK_KINDS:
            kinds = dict(masks=masks, multi_positive=multi)
            cases += [(dim, ragged, dict(symmetric=True, **kinds)) for dim in (40, 1000)]
            cases.append((1000, wide, dict(labels=True, **kinds)))
    elif arch in (90, 80) and dtype in ("bfloat16", "float32"):
        heaviest = (1000, ragged, dict(symmetric=True, masks="both", multi_positive="sum"))
        if precision == "tf32":
            cases = [heaviest] if arch == 90 else []
        else:
            cases = [
                (1000, ragged, dict(symmetric=True, masks="ids")),
                (40, wide, dict(labels=True, masks="guide")),
                (40, ragged, dict(symmetric=True, masks="both", multi_positive="mean")),
                heaviest,
                (1000, even, dict(masks="ids", multi_positive="sum")),
            ]
    return [Call(arch, "cal_inf_loss", dtype, precision, dim, *sizes, **kw) for dim, sizes, kw in cases]


# Label smoothing with mask options (issue 56): the masked kernels' kept-sums variant (KEPT_SUMS: two more forward
# partials, the backward's uniform weights), on these targets.
SMOOTHING_TARGETS = (90, 80, 100)
SMOOTHING = 0.1


def smoothing_calls(float64_dot: bool) -> List[Call]:
    """cal_inf_loss with label_smoothing and a guide (``backend="triton"``: the masked kernels with their kept sums):
    the masked matrix's heaviest case (ids and a guide, "sum", symmetric, D = 1000 on a ragged batch) in every dtype
    on sm_90 and in bf16 and fp32 "ieee" on sm_80 and (where the wheel's ptxas knows it) sm_100; a guide alone,
    one-directional with labels and Bk > Bq at D = 40 (one resident chunk) in bf16 and fp32 "ieee" on sm_90, and
    in bf16 on the chunked route (``backend="chunked"``)."""
    ragged, wide = (RAGGED_BATCH, RAGGED_BATCH), (RAGGED_BATCH, WIDE_BATCH)
    heaviest = dict(symmetric=True, masks="both", multi_positive="sum", label_smoothing=SMOOTHING)
    out = []
    for arch in SMOOTHING_TARGETS:
        if not ptxas_knows(arch):
            continue
        dtypes = api_dtypes(arch, False, float64_dot)
        if arch != 90:
            dtypes = [(d, p) for d, p in dtypes if (d, p) in (("bfloat16", "ieee"), ("float32", "ieee"))]
        out += [Call(arch, "cal_inf_loss", d, p, 1000, *ragged, **heaviest) for d, p in dtypes]
    one_way = dict(labels=True, masks="guide", label_smoothing=SMOOTHING)
    out += [Call(90, "cal_inf_loss", d, "ieee", 40, *wide, **one_way) for d in ("bfloat16", "float32")]
    # the chunked route hands its masked blocks to these kernels (the same specializations: Triton's cache has them)
    out.append(Call(90, "cal_inf_loss", "bfloat16", "ieee", 40, *wide, backend="chunked", **one_way))
    return out


def compile_training_step(
    arch: int, entry: str, masks: str = "", multi_positive: str = "", label_smoothing: float = 0.0
) -> Dict:
    """torch.compile(fullgraph=True) of a step calling ``entry`` (cal_inf_loss symmetric, with ``masks``,
    ``multi_positive`` and ``label_smoothing`` as :class:`Call`'s, or cal_siglip_loss) with backend="triton",
    through AOTAutograd with an eager backend (Inductor needs a real GPU), run forward and backward compile-only.
    {"graphs": the AOT forward and backward graphs' code, "frames": frames compiled} or {"error"}."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.testing import CompileCounterWithBackend

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    os.environ["INFCL_AUTOTUNE"] = "0"
    torch.backends.cuda.matmul.allow_tf32 = False
    call = Call(
        arch,
        entry,
        "bfloat16",
        "ieee",
        64,
        RAGGED_BATCH,
        RAGGED_BATCH,
        symmetric=entry == "cal_inf_loss",
        masks=masks,
        multi_positive=multi_positive,
        label_smoothing=label_smoothing,
    )
    counter = CompileCounterWithBackend(aot_autograd(fw_compiler=keep, bw_compiler=keep))
    try:
        torch._dynamo.reset()
        with compile_only(arch) as (compiled, start):
            q, k, labels = _inputs(call)
            scale, bias = _params()
            masks = mask_options(call)  # built outside: a torch.Generator cannot be created in a traced region
            step = torch.compile(
                lambda q, k: call_loss(call, q, k, labels, scale, bias, masks), backend=counter, fullgraph=True
            )
            step(q, k).backward()
            kernels = sorted({_kernel_name(fn) for fn, _, _ in compiled[start:]})
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err)[-3000:]}"}
    return {"graphs": graphs, "frames": counter.frame_count, "kernels": kernels}
