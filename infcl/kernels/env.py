"""The environment flags the kernels read, in a module that imports nothing of infcl's (so that
:mod:`.configs` and :mod:`.target` can both take them)."""

import os


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for the interpreter now (compare :data:`INTERPRETED`)."""
    return env_flag("TRITON_INTERPRET")


# Read once, at import: @triton.jit builds interpreted kernels only if TRITON_INTERPRET is set *when
# the decorator runs*, i.e. when the kernel modules are imported.
INTERPRETED = interpret_requested()
