"""The backends: the block operations of every API (:mod:`infcl.contract`), a folder per backend and a file per
loss inside (:mod:`.torch_tiles`, :mod:`.native`, :mod:`.triton`), and the one resolver (:mod:`.resolve`: the
names, the "auto" table, INFCL_BACKEND)."""

from .resolve import BACKENDS, ENV_VAR, backend_for, backend_object, resolve_backend, unavailable_reason

__all__ = ["BACKENDS", "ENV_VAR", "backend_for", "backend_object", "resolve_backend", "unavailable_reason"]
