"""The backends: the block operations of every API (:mod:`infcl.contract`), a folder per backend and a file per
loss inside (:mod:`.torch_tiles`, :mod:`.native`, :mod:`.triton`, :mod:`.chunked`), and the one resolver
(:mod:`.resolve`: the names, the "auto" table and its measured rule, INFCL_BACKEND).

A call's ``backend=`` takes a name or a backend object with its options, e.g.
``backend=infcl.backends.ChunkedBackend(budget_mb=512)`` (:func:`.resolve.call_backend`); the classes are reachable
here by name, imported when first asked for (``ChunkedBackend``, ``TritonBackend``, ``TorchTilesBackend``,
``NativeBackend``)."""

import importlib

from .resolve import (
    BACKENDS,
    ENV_VAR,
    backend_for,
    backend_name,
    backend_object,
    call_backend,
    measured_route,
    resolve_backend,
    unavailable_reason,
)

# The backend classes, by the package that holds each (imported on first access: "import infcl" loads no kernels).
_CLASSES = {
    "ChunkedBackend": ".chunked",
    "TritonBackend": ".triton",
    "TorchTilesBackend": ".torch_tiles",
    "NativeBackend": ".native",
}


def __getattr__(name: str):
    if name in _CLASSES:
        return getattr(importlib.import_module(_CLASSES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "ChunkedBackend",
    "NativeBackend",
    "TorchTilesBackend",
    "TritonBackend",
    "backend_for",
    "backend_name",
    "backend_object",
    "call_backend",
    "measured_route",
    "resolve_backend",
    "unavailable_reason",
]
