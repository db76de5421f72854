"""Backend registry: names, the "auto" choice and the INFCL_BACKEND override.

- "reference": materializes the logits and uses autograd (tests and debugging; O(Bq * Bk) memory).
- "torch":     tiled pure PyTorch, any device.
- "cpu":       the native C++ kernel (csrc/), CPU tensors.
- "triton":    fused Triton kernels, CUDA tensors (or CPU tensors under TRITON_INTERPRET=1).
"auto" picks triton for CUDA tensors when importable, the native kernel for CPU tensors when it is
built, and the torch tiles otherwise. ``INFCL_BACKEND=<name>`` overrides "auto" (never an explicit name).
"""

import importlib
import os

import torch

from .base import BlockBackend
from .torch_tiles import TORCH_TILES

BACKENDS = ("auto", "reference", "torch", "cpu", "triton")
ENV_VAR = "INFCL_BACKEND"

# Optional backends live in their own modules, each exposing ``BACKEND`` and ``unavailable_reason(device)``
# (None when usable on that device).
_OPTIONAL = {"cpu": "infcl.backends.native", "triton": "infcl.backends.triton_backend"}


def _optional_module(name: str):
    try:
        return importlib.import_module(_OPTIONAL[name]), None
    except ImportError as err:
        return None, f"backend {name!r} is not available: {err}"


def unavailable_reason(name: str, device: torch.device):
    """None if backend ``name`` can run on ``device``, else a sentence saying why not."""
    if name in ("reference", "torch"):
        return None
    module, why = _optional_module(name)
    return why if module is None else module.unavailable_reason(device)


def resolve_backend(backend, device: torch.device) -> str:
    """Turn the user's ``backend`` argument (and INFCL_BACKEND for "auto") into a concrete name."""
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
        if preferred is not None and unavailable_reason(preferred, device) is None:
            return preferred
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
