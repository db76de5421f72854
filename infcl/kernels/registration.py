"""How every Triton block step becomes a custom op, one way (:func:`register_op`), and how a launcher hands its
kernels to it (:func:`wrap`): ``torch.library.triton_op``, whose body launches each @triton.jit kernel (or
triton.autotune of one) through ``wrap_triton`` (compiled kernels: torch.compile traces into the kernels); under
the interpreter, whose kernels torch.compile cannot trace, ``torch.library.custom_op`` with fake impls."""

from typing import Tuple

import torch

from .env import INTERPRETED

# Whether the custom ops launch through wrap_triton (triton_op): compiled kernels, not the interpreter's.
TRITON_OP = not INTERPRETED
# wrap_triton accepts a @triton.jit function or a triton.autotune of one; every launcher hands it those.
wrap = torch.library.wrap_triton if TRITON_OP else (lambda kernel: kernel)


def register_op(name: str, impl, fake, mutates: Tuple[str, ...] = ()):
    """``impl`` as the custom op ``infcl::<name>`` in the one way every block step is registered."""
    qualname = f"infcl::{name}"
    if TRITON_OP:
        return torch.library.triton_op(qualname, impl, mutates_args=mutates)
    op = torch.library.custom_op(qualname, impl, mutates_args=mutates)
    op.register_fake(fake)
    return op
