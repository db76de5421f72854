"""The backends: the block operations of every API (:mod:`infcl.contract`), a folder per backend and a file per
loss inside (:mod:`.torch_tiles`, :mod:`.native`, :mod:`.triton`, :mod:`.chunked`), and the one resolver
(:mod:`.resolve`: the names, the "auto" table and its measured rule, INFCL_BACKEND)."""

from .resolve import BACKENDS, ENV_VAR, backend_for, backend_object, measured_route, resolve_backend, unavailable_reason

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "backend_for",
    "backend_object",
    "measured_route",
    "resolve_backend",
    "unavailable_reason",
]
