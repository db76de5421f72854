"""Backend registry: names, the "auto" choice and the INFCL_BACKEND override.

- "reference": materializes the logits and uses autograd (tests and debugging; O(Bq * Bk) memory).
- "torch":     tiled pure PyTorch, any device.
- "cpu":       the native C++ kernel (csrc/), CPU tensors.
- "triton":    fused Triton kernels, CUDA tensors (or CPU tensors under TRITON_INTERPRET=1).
- "chunked":   the exact chunked route (cuBLAS products with float32 scores, Triton passes; docs/chunked.md).
"auto" picks triton for CUDA tensors when it can run there, the native kernel for CPU tensors when it is
built, and the torch tiles otherwise; where a CUDA device cannot take the Triton kernels (triton missing,
a ROCm GPU, an architecture with no compiled configs) it warns once, naming why.
``INFCL_BACKEND=<name>`` overrides "auto" (never an explicit name).

Every backend runs the mask options of ``cal_inf_loss`` (ids, ``multi_positive``, ``guide``;
:mod:`infcl.masks`), so they change nothing in the choice.
"""

import importlib
import os
import sys
import warnings

import torch

from .base import BlockBackend
from .torch_tiles import TORCH_TILES

BACKENDS = ("auto", "reference", "torch", "cpu", "triton", "chunked")
ENV_VAR = "INFCL_BACKEND"

# Optional backends live in their own modules, each exposing ``BACKEND`` and ``unavailable_reason(device)``
# (None when usable on that device).
_OPTIONAL = {
    "cpu": "infcl.backends.native",
    "triton": "infcl.backends.triton_backend",
    "chunked": "infcl.backends.chunked",
}


_LOADED = {}  # name -> (module or None, why not): imported once, so a compiled call only reads a dict


def _optional_module(name: str):
    if name not in _LOADED:
        try:
            _LOADED[name] = importlib.import_module(_OPTIONAL[name]), None
        except ImportError as err:
            _LOADED[name] = None, f"backend {name!r} is not available: {err}"
    return _LOADED[name]


def unavailable_reason(name: str, device: torch.device):
    """None if backend ``name`` can run on ``device``, else a sentence saying why not."""
    if name in ("reference", "torch"):
        return None
    module, why = _optional_module(name)
    return why if module is None else module.unavailable_reason(device)


_WARNED = set()


def _warn_once(message: str) -> None:
    """One warning per distinct message per process (the fallback is chosen at every call)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _constant_for_compile(fn):
    """torch.compile runs ``fn`` while tracing and keeps its result as a constant (no graph break on the
    imports, driver queries and warnings inside); eager calls are unchanged.

    ``torch.compiler.assume_constant_result`` only sets ``fn._dynamo_marked_constant`` (torch 2.4 to 2.13),
    but calling it imports torch._dynamo, which imports triton and costs about a second: importing infcl
    must load neither. So the mark is set directly unless dynamo is already loaded.
    """
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_constant_for_compile
def resolve_backend(backend, device: torch.device, guided: bool = False) -> str:
    """Turn the user's ``backend`` argument (and INFCL_BACKEND for "auto") into a concrete name.

    ``guided``: the call has a guide. "auto" then runs the torch tiles on CUDA: the masked Triton forward
    with a guide stopped with an illegal memory access on an H200 (bf16 features, D = 64; README, "On a
    GPU"), and it stays off the default path until a GPU shows it fixed. ``backend="triton"`` still runs it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"environment variable {ENV_VAR} must be one of {BACKENDS}, got {env!r}")
            backend = env
    if backend == "auto":
        preferred = {"cuda": "triton", "cpu": "cpu"}.get(device.type)
        if preferred is None:
            return "torch"
        why = unavailable_reason(preferred, device)
        if why is None and preferred == "triton" and guided:
            _warn_once(
                "infcl: backend='auto' runs a guided loss on the torch tiles, not the Triton kernels "
                "(a known fault of the guided Triton kernel; pass backend='triton' to run it anyway)"
            )
            return "torch"
        if why is None:
            return preferred
        if preferred == "triton":
            _warn_once(
                f"infcl: backend='auto' runs the torch tiles on {device.type} tensors, not the Triton kernels: {why}"
            )
        return "torch"
    why = unavailable_reason(backend, device)
    if why is not None:
        raise RuntimeError(why)
    return backend


def block_backend(name: str) -> BlockBackend:
    if name == "torch":
        return TORCH_TILES
    module, why = _optional_module(name)
    if module is None:
        raise RuntimeError(why)
    return module.BACKEND
