"""The native CPU backend: the fused C++ block kernel in the repository's ``csrc/``.

The extension is compiled just-in-time on first use with ``torch.utils.cpp_extension.load`` (ninja)
and cached in torch's extensions directory (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions/<python>_<torch build>/infcl_cpu_<cpu hash>``), so it is built once per machine and
reloaded in milliseconds afterwards. It registers the custom ops ``torch.ops.infcl.forward_block`` and
``torch.ops.infcl.backward_block`` (with fake impls here, so ``torch.compile`` can trace them).

The sources are read from ``csrc/`` next to the ``infcl`` package, i.e. the package must be installed
editable from a checkout (``pip install -e .``). If the sources are missing or the build fails (no
compiler, no ninja), the backend reports itself unavailable: ``backend="auto"`` then uses the
pure-PyTorch tiles (after one warning) and an explicit ``backend="cpu"`` raises a RuntimeError with
the reason.

Block contract and math: :mod:`infcl.backends.base`. Kernel layout, tiling and determinism:
``csrc/infcl_cpu.cpp``.
"""

import functools
import os
import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch

from .base import Block, Tensor, accum_dtype

EXTENSION_NAME = "infcl_cpu"
CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("infcl_cpu.cpp",)
# -O3 (+ full-width vectors) for the fused exp loops; -march=native because the build happens on the machine that
# runs it (the cache is per machine); -fopenmp because at::parallel_for's OpenMP loop is compiled into
# the extension from torch's headers.
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def _cpu_fingerprint() -> str:
    """A short hash of this CPU's model and instruction-set flags.

    The build uses -march=native, so a cached binary is only valid on the CPU it was built for; the
    fingerprint goes into the extension's name, and a home directory shared between different
    machines gets one cached build per CPU kind instead of an illegal instruction.
    """
    import hashlib
    import platform

    info = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info += "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha1(info.encode()).hexdigest()[:8]


def _build_and_load() -> None:
    """Compile (or reuse the cached build of) csrc/ and load it; raises on any failure."""
    from torch.utils import cpp_extension

    sources = [CSRC_DIR / name for name in SOURCES]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"C++ sources not found ({', '.join(missing)}); the native kernel needs infcl installed editable "
            "from a checkout (pip install -e .)"
        )
    cpp_extension.load(
        name=f"{EXTENSION_NAME}_{_cpu_fingerprint()}",
        sources=[str(p) for p in sources],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        is_python_module=False,
        verbose=os.environ.get("INFCL_VERBOSE_BUILD") == "1",
    )


@functools.lru_cache(maxsize=None)
def load_error() -> Optional[str]:
    """None once the extension is loaded; else why it could not be (computed, and warned about, once)."""
    try:
        _build_and_load()
    except Exception as err:  # any build or load failure means: fall back, and say why
        reason = f"the native CPU kernel could not be built or loaded ({type(err).__name__}: {err})"
        warnings.warn(f"infcl: {reason}; backend 'auto' uses the pure-PyTorch tiles instead", RuntimeWarning, stacklevel=2)
        return reason
    _register_fakes()
    return None


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the native kernel can run on ``device`` (CPU, extension built), else a sentence saying why."""
    if torch.device(device).type != "cpu":
        return f"backend 'cpu' runs on CPU tensors only, got a tensor on {device}"
    return load_error()


def _register_fakes() -> None:
    """Shape-only implementations so torch.compile / FakeTensor can trace through the custom ops."""

    @torch.library.register_fake("infcl::forward_block")
    def _forward_fake(q, k, scale, pos, want_cols):
        acc = accum_dtype(q.dtype)
        return q.new_empty(3, q.shape[0], dtype=acc), q.new_empty(2, k.shape[0] if want_cols else 0, dtype=acc)

    @torch.library.register_fake("infcl::backward_block")
    def _backward_fake(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq, dk):
        return q.new_empty(2, dtype=accum_dtype(q.dtype))


class NativeBackend:
    """The block contract (:mod:`infcl.backends.base`) on the custom ops; the scale goes in as a host float
    (reading a CPU tensor costs no device sync)."""

    name = "cpu"

    def forward_block(self, block: Block, want_cols: bool) -> Tuple[Tensor, Optional[Tensor]]:
        rows, cols = torch.ops.infcl.forward_block(block.q, block.k, float(block.scale), block.pos, bool(want_cols))
        return rows, (cols if want_cols else None)

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return torch.ops.infcl.backward_block(
            block.q, block.k, float(block.scale), block.pos, block.row_stats, block.g_row,
            block.col_stats, block.g_col, dq, dk,
        )


BACKEND = NativeBackend()
