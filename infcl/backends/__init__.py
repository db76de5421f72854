"""Backend registry: names, the "auto" choice and the INFCL_BACKEND override.

- "reference": materializes the logits and uses autograd (tests and debugging; O(Bq * Bk) memory).
- "torch":     tiled pure PyTorch, any device.
- "cpu":       the native C++ kernel (csrc/), CPU tensors.
- "triton":    fused Triton kernels, CUDA tensors (or CPU tensors under TRITON_INTERPRET=1).
"auto" picks triton for CUDA tensors when importable, the native kernel for CPU tensors when it is
built, and the torch tiles otherwise. ``INFCL_BACKEND=<name>`` overrides "auto" (never an explicit name).

The mask options of ``cal_inf_loss`` (ids, ``multi_positive``, ``guide``; :mod:`infcl.masks`) run on
:data:`MASK_BACKENDS` only for now: "auto" (and its override) then falls back to the torch tiles, and an
explicit other name raises a ValueError.
"""

import importlib
import os

import torch

from .base import BlockBackend
from .torch_tiles import TORCH_TILES

BACKENDS = ("auto", "reference", "torch", "cpu", "triton")
MASK_BACKENDS = ("torch", "reference")  # the backends that form ids / guide masks in their tiles
MASK_OPTIONS = "q_ids/k_ids, multi_positive and guide"
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


def resolve_backend(backend, device: torch.device, masked: bool = False) -> str:
    """Turn the user's ``backend`` argument (and INFCL_BACKEND for "auto") into a concrete name.

    ``masked``: the call uses mask options, which only :data:`MASK_BACKENDS` support.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if masked and backend not in ("auto",) + MASK_BACKENDS:
        raise ValueError(
            f"{MASK_OPTIONS} are not yet supported by backend {backend!r}; the backends that support them "
            f"are {MASK_BACKENDS} (backend='auto' picks 'torch')"
        )
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"environment variable {ENV_VAR} must be one of {BACKENDS}, got {env!r}")
            backend = env
    if masked and backend not in MASK_BACKENDS:
        return "torch"  # "auto" (or INFCL_BACKEND naming a backend without masks): the torch tiles
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
