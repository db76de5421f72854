"""Building and loading the native CPU kernel: where its C++ sources are, where the build is cached, and why
it is unavailable when it is.

Sources: every ``*.cpp`` in the kernel's source folder, compiled together into one extension. A wheel or a
regular install carries them as ``infcl/_csrc/`` (setup.py maps the repository's ``csrc/`` there at build
time); in a checkout (an editable install, or ``PYTHONPATH``) they are read from ``csrc/`` beside the package.

Build: ``torch.utils.cpp_extension.load`` (ninja, :func:`compile_flags`: ``-march=native`` unless
``INFCL_NATIVE_ARCH`` names another target) the first time, into
``<root>/<extension name>`` where root is ``$TORCH_EXTENSIONS_DIR`` or torch's default
(``~/.cache/torch_extensions/<python>_<accelerator>``), as torch itself lays it out. The extension name is
the cache key: ``infcl_cpu_<CPU fingerprint>_<build hash>``, the build hash covering the sources' bytes, the
flags and the torch and Python versions, so a changed source, another CPU or another torch gets a build of
its own and a shared cache directory never hands out a stale or foreign binary. A build announces itself
with one line on stderr when it starts and one when it ends; loading a cached build (milliseconds) prints
nothing. ``python -m infcl build`` builds ahead of time; ``INFCL_NATIVE=0`` turns the backend off.
"""

import functools
import hashlib
import os
import platform
import re
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from ...contract import DISTILL_ROWS
from ...op_fakes import (
    ahead_counts_fake,
    best_positives_fake,
    dscale_fake,
    guide_scores_fake,
    in_place_fake,
    masked_prefix_stats_fake,
    masked_stats_fake,
    maxsim_scores_fake,
    prefix_stats_fake,
    row_fake,
    stats_fake,
)

EXTENSION_PREFIX = "infcl_cpu"
DISABLE_VAR = "INFCL_NATIVE"  # INFCL_NATIVE=0 turns the native backend off
VERBOSE_VAR = "INFCL_VERBOSE_BUILD"  # INFCL_VERBOSE_BUILD=1 shows the compiler's command lines and output
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# Where the sources may be, first match wins: inside the installed package (a wheel: setup.py's package_dir
# maps csrc/ to infcl._csrc), then the checkout that holds the package (editable install or PYTHONPATH).
SOURCE_DIRS = (PACKAGE_ROOT / "_csrc", PACKAGE_ROOT.parent / "csrc")
SOURCE_GLOB = "*.cpp"  # each one is compiled; a new kernel file needs no change here
HEADER_GLOBS = ("*.h", "*.hpp")  # not compiled on their own, but part of the build hash
ARCH_VAR = "INFCL_NATIVE_ARCH"  # e.g. INFCL_NATIVE_ARCH=x86-64-v3: build for that -march instead of this CPU
DEFAULT_ARCH = "native"
# -O3 (+ full-width vectors) for the fused exp loops; -fno-trapping-math because without it GCC will not
# turn a float compare-and-select (exp_f32's clamps, the top/rest tests) into a blend on AVX2, where there
# are no mask registers, and leaves every elementwise loop of the kernel scalar (AVX-512 vectorizes them
# either way; no value changes: the kernel never unmasks a floating-point trap, and torch builds itself
# the same way); -fopenmp because at::parallel_for's OpenMP loop is compiled into the extension from
# torch's headers. -march: see arch().
CFLAGS = ("-O3", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
HASH_CHARS = 8  # hex digits of each hash in the extension name: short paths, collisions not a concern
BUILD_TIME_HINT = "up to about 2 minutes on 2 cores"


def disabled_reason() -> Optional[str]:
    """The sentence ``unavailable_reason`` gives when INFCL_NATIVE=0 turned the backend off, else None."""
    if os.environ.get(DISABLE_VAR, "").strip() == "0":
        return f"the native CPU kernel is turned off ({DISABLE_VAR}=0)"
    return None


def sources_dir() -> Path:
    """The folder holding the kernel's C++ sources; raises FileNotFoundError naming where it looked."""
    for folder in SOURCE_DIRS:
        if any(folder.glob(SOURCE_GLOB)):
            return folder
    raise FileNotFoundError(
        f"the C++ sources of the native kernel ({SOURCE_GLOB}) are in none of "
        f"{', '.join(str(d) for d in SOURCE_DIRS)}; reinstall infcl (a wheel carries them in infcl/_csrc)"
    )


def source_files(folder: Optional[Path] = None) -> List[Path]:
    """Every ``*.cpp`` in ``folder`` (default: :func:`sources_dir`), sorted, so the build and its hash are stable."""
    return sorted((folder or sources_dir()).glob(SOURCE_GLOB))


def arch() -> str:
    """The ``-march`` of the build: ``$INFCL_NATIVE_ARCH``, else ``native`` (this CPU: the build happens on the
    machine that runs it, and the cache is per CPU kind). Another value builds for that target on any CPU,
    e.g. ``x86-64-v3`` (AVX2 + FMA, no AVX-512) to reproduce an AVX2-only CPU's kernel on an AVX-512 one;
    it is part of the build hash. Raises ValueError for a value that is not one -march word."""
    value = os.environ.get(ARCH_VAR, "").strip() or DEFAULT_ARCH
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", value):
        raise ValueError(f"{ARCH_VAR} must be one -march value such as native or x86-64-v3, got {value!r}")
    return value


def compile_flags() -> Tuple[str, ...]:
    """The compiler flags of the build: :data:`CFLAGS` and ``-march=<arch()>``."""
    return (*CFLAGS, f"-march={arch()}")


def _cpu_fingerprint() -> str:
    """A short hash of this CPU's model and instruction-set flags.

    The build uses -march=native by default, so a cached binary is only valid on the CPU it was built for; the
    fingerprint goes into the extension's name, and a home directory shared between different
    machines gets one cached build per CPU kind instead of an illegal instruction.
    """
    info = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info += "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:HASH_CHARS]


def _build_hash(sources: Sequence[Path]) -> str:
    """A short hash of what the binary depends on besides the CPU: every source and header in the sources'
    folder (names and bytes), the compiler and linker flags, and the torch and Python versions."""
    digest = hashlib.sha1()
    folders = sorted({path.parent for path in sources})
    headers = sorted(path for folder in folders for pattern in HEADER_GLOBS for path in folder.glob(pattern))
    for path in sorted(sources) + headers:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    digest.update(repr((compile_flags(), LDFLAGS, torch.__version__, python)).encode())
    return digest.hexdigest()[:HASH_CHARS]


def extension_name(sources: Optional[Sequence[Path]] = None) -> str:
    """The extension's name, which is also its cache key: ``infcl_cpu_<CPU fingerprint>_<build hash>``."""
    sources = source_files() if sources is None else sources
    return f"{EXTENSION_PREFIX}_{_cpu_fingerprint()}_{_build_hash(sources)}"


def build_directory(name: str) -> Path:
    """Where torch's JIT puts extension ``name``: ``$TORCH_EXTENSIONS_DIR/name``, else torch's default root
    plus a ``py<version>_<accelerator>`` folder (torch's own layout; computed, not created, so that asking
    where the build is has no side effect)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return Path(root) / name


def built_library(name: Optional[str] = None) -> Path:
    """The path of the compiled extension for the current sources (it exists once they have been built)."""
    from torch.utils.cpp_extension import LIB_EXT

    name = name or extension_name()
    return build_directory(name) / f"{name}{LIB_EXT}"


def _announce(line: str) -> None:
    """One line on stderr, outside the warnings machinery, so it shows whatever the warning filters say."""
    print(f"infcl: {line}", file=sys.stderr, flush=True)


def _build_and_load() -> None:
    """Load the cached build of the current sources, compiling it first if there is none; raises on any failure."""
    from torch.utils import cpp_extension

    sources = source_files()
    name = extension_name(sources)
    library = built_library(name)
    if library.is_file():
        try:
            torch.ops.load_library(str(library))
            return
        except OSError:
            pass  # a truncated or foreign file (an interrupted build): build again below, under torch's lock
    folder = library.parent
    _announce(
        f"building the native CPU kernel from {', '.join(p.name for p in sources)} in {sources[0].parent} "
        f"into {folder}; this happens once per machine and version of the sources ({BUILD_TIME_HINT})"
    )
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=list(compile_flags()),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            is_python_module=False,
            verbose=os.environ.get(VERBOSE_VAR) == "1",
        )
    except BaseException:
        _announce(f"building the native CPU kernel failed after {time.perf_counter() - started:.0f} s")
        raise
    _announce(f"built the native CPU kernel in {time.perf_counter() - started:.0f} s; later runs load it from {folder}")


@functools.lru_cache(maxsize=None)
def load_error() -> Optional[str]:
    """None once the extension is loaded (built first if needed) and its ops' fake impls are registered
    (:func:`register_fakes`); else why it could not be.

    Computed once per process. A failed build or load warns once (``backend="auto"`` then falls back to the
    torch tiles); INFCL_NATIVE=0 is a choice, not a failure, and does not warn.
    """
    disabled = disabled_reason()
    if disabled is not None:
        return disabled
    try:
        _build_and_load()
    except Exception as err:  # any build or load failure means: fall back, and say why
        reason = f"the native CPU kernel could not be built or loaded ({type(err).__name__}: {err})"
        warnings.warn(
            f"infcl: {reason}; backend 'auto' uses the pure-PyTorch tiles instead", RuntimeWarning, stacklevel=2
        )
        return reason
    register_fakes()
    return None


def torch_ops():
    """``torch.ops.infcl`` once the extension is loaded (built first if needed), else a RuntimeError saying why."""
    why = load_error()
    if why is not None:
        raise RuntimeError(why)
    return torch.ops.infcl


# ---- the ops' fake (shape-only) impls ------------------------------------------------------------
# The C++ library defines the ops' schemas (TORCH_LIBRARY in csrc/); torch.compile and FakeTensor need a
# Python impl that gives only the output shapes and dtypes. torch refuses a fake for an op that is not
# defined yet, so these are registered right after the library loads, by :func:`load_error`. They are the Triton
# ops' fakes too (:mod:`infcl.op_fakes`).

KEPT_SUMS_AT = 10  # masked_forward_block's kept_sums among the arguments after q and k (schema default False)

FAKES = {
    "infcl::forward_block": stats_fake(3, 2),  # csrc/softmax_ops.cpp
    "infcl::backward_block": dscale_fake,
    "infcl::masked_forward_block": masked_stats_fake(KEPT_SUMS_AT),
    "infcl::masked_backward_block": dscale_fake,
    "infcl::guide_label_scores": guide_scores_fake,
    "infcl::matryoshka_forward_block": prefix_stats_fake,
    "infcl::matryoshka_backward_block": dscale_fake,
    "infcl::masked_matryoshka_forward_block": masked_prefix_stats_fake,
    "infcl::masked_matryoshka_backward_block": dscale_fake,
    "infcl::sigmoid_forward_block": row_fake,  # csrc/infcl_siglip.cpp
    "infcl::sigmoid_backward_block": dscale_fake,
    "infcl::distill_forward_block": stats_fake(DISTILL_ROWS, DISTILL_ROWS, symmetric_at=6),  # csrc/distill.cpp
    "infcl::distill_backward_block": dscale_fake,
    "infcl::rank_best_positives": best_positives_fake,  # csrc/retrieval.cpp
    "infcl::rank_ahead_counts": ahead_counts_fake,
    "infcl::topk_block_": in_place_fake,  # csrc/topk.cpp
    "infcl::maxsim_scores": maxsim_scores_fake,  # csrc/maxsim.cpp
    "infcl::maxsim_route_": in_place_fake,
}


def register_fakes() -> None:
    """Register :data:`FAKES` for the loaded library's ops (registering again replaces them: ``allow_override``,
    whose default is False on torch 2.8, True from a later torch)."""
    for op, fake in FAKES.items():
        torch.library.register_fake(op, fake, allow_override=True)
