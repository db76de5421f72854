"""The Triton backend (``backend="triton"``): the fused kernels of :mod:`infcl.kernels`, a file per loss
(:mod:`.softmax`, :mod:`.matryoshka`, :mod:`.sigmoid`, :mod:`.distill`, :mod:`.rank`, :mod:`.topk`, :mod:`.maxsim`) on
shared options and the one float64 rule (:mod:`.options`), put together in :mod:`.backend`.

Runs on CUDA tensors, and on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 was set
before the kernels were imported (that is how CI tests it). float64 inputs are computed in float64
(with Triton 3.4, whose tl.dot has no float64, by the torch tiles). Importable without triton:
:func:`unavailable_reason` then says why it cannot run, and ``BACKEND`` is None.
"""

from .available import IMPORT_ERROR, unavailable_reason

if IMPORT_ERROR is None:
    from .backend import BACKEND, TritonBackend
else:
    BACKEND = TritonBackend = None

__all__ = ["BACKEND", "TritonBackend", "unavailable_reason"]
