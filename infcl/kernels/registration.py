"""How every Triton block step becomes a custom op, one way (:func:`register_op`), and how a launcher hands its
kernels to it (:func:`wrap`), by what the installed torch offers: ``torch.library.triton_op``, whose body launches
each @triton.jit kernel (or triton.autotune of one) through ``wrap_triton`` (torch >= 2.6, compiled kernels:
torch.compile traces into the kernels); else ``torch.library.custom_op`` with fake impls (torch >= 2.4, and
always under the interpreter, whose kernels torch.compile cannot trace); else plain functions."""

from typing import Tuple

import torch

from .env import INTERPRETED

# Whether the custom ops launch through wrap_triton (triton_op): compiled kernels on torch >= 2.6.
TRITON_OP = not INTERPRETED and hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")
# wrap_triton accepts a @triton.jit function or a triton.autotune of one; every launcher hands it those.
wrap = torch.library.wrap_triton if TRITON_OP else (lambda kernel: kernel)


def register_op(name: str, impl, fake, mutates: Tuple[str, ...] = ()):
    """``impl`` as the custom op ``infcl::<name>`` in the one way every block step is registered."""
    qualname = f"infcl::{name}"
    if TRITON_OP:
        return torch.library.triton_op(qualname, impl, mutates_args=mutates)
    if hasattr(torch.library, "custom_op"):
        op = torch.library.custom_op(qualname, impl, mutates_args=mutates)
        op.register_fake(fake)
        return op
    return impl  # torch < 2.4: no custom-op API worth the name; eager only
