"""What the backends do once: a warning per distinct message per process (:func:`warn_once`), and a host-side
choice that torch.compile keeps as a constant (:func:`constant_for_compile`). A leaf module (torch only): the
resolver and every backend package import it without importing each other."""

import sys
import warnings

import torch

_WARNED = set()


def warn_once(message: str) -> None:
    """One warning per distinct message per process (the fallback is chosen at every call)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def constant_for_compile(fn):
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
