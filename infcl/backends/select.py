"""Which implementation runs an API beyond the losses' block contract (the retrieval ranks, the distillation
loss): the backend name resolved as for the losses (:func:`infcl.backends.resolve_backend`: "auto" and
``INFCL_BACKEND``), then the torch tiles, the native kernel or the Triton kernels.

Each API hands in its three implementations, the optional ones as loaders (importing the native or Triton
module only when chosen). "reference" materializes nothing for these APIs: it raises NotImplementedError
(their float64 truths live in the tests).
"""

import torch

from . import resolve_backend


def select_impl(backend, device: torch.device, api: str, torch_impl, native_loader, triton_loader):
    """The implementation object of ``api`` for ``backend`` on ``device``."""
    if backend == "reference":
        raise NotImplementedError(
            f"{api} has no backend='reference' (it would materialize the B x B scores); use 'auto', 'torch', "
            f"'cpu' or 'triton'"
        )
    name = resolve_backend(backend, device)
    if name == "cpu":
        return native_loader()
    if name == "triton":
        return triton_loader()
    return torch_impl
