"""Saving and restoring torch's float32 matmul precision around a test.

torch serves ``torch.backends.cuda.matmul.allow_tf32`` through a module ``__getattr__``, not as an attribute,
so ``monkeypatch.setattr`` cannot restore it: pytest 9.2 records the old value as "not set" and its undo calls
``delattr``, which fails at teardown. On torch 2.9+ the same setting is also ``fp32_precision``, and reading
``allow_tf32`` raises once the two APIs were mixed. :func:`float32_matmul` saves whichever the running torch
has, lets the test set ``allow_tf32``, and restores the saved state however the test left it.
"""

from contextlib import contextmanager
from typing import Optional

import torch


def _read(name: str):
    """The setting ``name`` of torch.backends.cuda.matmul, or None where this torch lacks it or refuses to read it."""
    try:
        return getattr(torch.backends.cuda.matmul, name)
    except (AttributeError, RuntimeError):
        return None


@contextmanager
def float32_matmul(allow_tf32: Optional[bool] = None):
    """Set ``allow_tf32`` (when given) for the block; restore torch's float32 matmul precision on exit."""
    matmul = torch.backends.cuda.matmul
    saved_precision, saved_legacy = _read("fp32_precision"), _read("allow_tf32")
    try:
        if allow_tf32 is not None:
            matmul.allow_tf32 = allow_tf32
        yield matmul
    finally:
        if saved_precision not in (None, "none"):
            matmul.fp32_precision = saved_precision  # torch 2.9+, set through the new API
        elif saved_legacy is not None:
            matmul.allow_tf32 = saved_legacy
