"""Which implementation runs an API beyond the losses' block contract (the retrieval ranks, the distillation
loss): the backend name resolved as for the losses (:func:`infcl.backends.resolve_backend`: "auto" and
``INFCL_BACKEND``), then the torch tiles, the native kernel or the Triton kernels.

"auto" picks the native kernel for CPU tensors (when it is built) but not yet the Triton kernels on CUDA:
they pass the interpreter tests and the compile gate, but no GPU has run them yet (the guided loss's
precedent, :func:`infcl.backends.resolve_backend`); "auto" there runs the torch tiles until a GPU session
shows them right. ``backend="triton"`` or ``INFCL_BACKEND=triton`` runs them.

Each API hands in its three implementations, the optional ones as loaders (importing the native or Triton
module only when chosen). "reference" materializes nothing for these APIs: it raises NotImplementedError
(their float64 truths live in the tests).
"""

import os

import torch

from . import ENV_VAR, resolve_backend, unavailable_reason


def select_impl(backend, device: torch.device, api: str, torch_impl, native_loader, triton_loader):
    """The implementation object of ``api`` for ``backend`` on ``device``."""
    if backend == "reference":
        raise NotImplementedError(
            f"{api} has no backend='reference' (it would materialize the B x B scores); use 'auto', 'torch', "
            f"'cpu' or 'triton'"
        )
    if backend == "chunked":  # the softmax loss's route (docs/chunked.md): no other API has a chunked pass
        raise ValueError(
            f"{api} has no backend='chunked' (the softmax loss's route); use 'auto', 'torch', 'cpu' or 'triton'"
        )
    name = resolve_backend(backend, device)
    if name == "chunked":  # INFCL_BACKEND=chunked: this API's own "auto" (the native kernel on CPU, else the tiles)
        name = "cpu" if unavailable_reason("cpu", device) is None else "torch"
    if name == "triton" and backend == "auto" and not os.environ.get(ENV_VAR, "").strip():
        name = "torch"  # not yet run on a GPU: see the module docstring
    if name == "cpu":
        return native_loader()
    if name == "triton":
        return triton_loader()
    return torch_impl
