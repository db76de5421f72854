"""The native CPU backend (``backend="cpu"``): the fused C++ block kernels (the repository's ``csrc/``), a file per
loss (:mod:`.softmax`, :mod:`.matryoshka`, :mod:`.sigmoid`, :mod:`.distill`, :mod:`.rank`, :mod:`.topk`,
:mod:`.maxsim`), put together in :mod:`.backend`.

The kernel registers one custom op per block operation (``torch.ops.infcl.forward_block`` ...); the loader
registers their fake impls, so that ``torch.compile`` can trace them, right after the library loads. It is compiled
just-in-time on first use, or ahead of time by ``python -m infcl build``, and cached per machine and version of the
sources: :mod:`.build` finds the sources (shipped inside the package), builds, caches and
loads them, and says why the backend is unavailable when it is (turned off by ``INFCL_NATIVE=0``, no compiler,
no ninja): ``backend="auto"`` then uses the pure-PyTorch tiles (after one warning for a failure) and an
explicit ``backend="cpu"`` raises a RuntimeError with the reason.

Block contract and math: :mod:`infcl.contract`. Kernel layout, tiling and determinism: docs/kernels.md
("Native CPU kernel"); the ops are ``csrc/softmax_ops.cpp`` (phases in ``csrc/softmax_forward.cpp`` and
``csrc/softmax_backward.cpp``; the fused Matryoshka prefixes, :mod:`.matryoshka`, in ``csrc/matryoshka_*.cpp``).
"""

from .backend import BACKEND, NativeBackend, unavailable_reason

__all__ = ["BACKEND", "NativeBackend", "unavailable_reason"]
