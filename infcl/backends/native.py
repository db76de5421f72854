"""The native CPU backend: the fused C++ block kernel (the repository's ``csrc/``).

The kernel registers the custom ops ``torch.ops.infcl.forward_block`` and ``torch.ops.infcl.backward_block``
(with fake impls here, so ``torch.compile`` can trace them). It is compiled just-in-time on first use, or ahead
of time by ``python -m infcl build``, and cached per machine and version of the sources:
:mod:`infcl.backends.native_build` finds the sources (shipped inside the package), builds, caches and loads
them, and says why the backend is unavailable when it is (turned off by ``INFCL_NATIVE=0``, no compiler, no
ninja): ``backend="auto"`` then uses the pure-PyTorch tiles (after one warning for a failure) and an explicit
``backend="cpu"`` raises a RuntimeError with the reason.

Block contract and math: :mod:`infcl.backends.base`. Kernel layout, tiling and determinism:
``csrc/infcl_cpu.cpp``.
"""

from typing import Optional, Tuple

import torch

from .base import Tensor, accum_dtype
from .native_build import load_error


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the native kernel can run on ``device`` (CPU, extension built), else a sentence saying why."""
    if torch.device(device).type != "cpu":
        return f"backend 'cpu' runs on CPU tensors only, got a tensor on {device}"
    return load_error()


def _register_fakes() -> None:
    """Shape-only implementations so torch.compile / FakeTensor can trace through the custom ops."""

    @torch.library.register_fake("infcl::forward_block")
    def _forward_fake(q, k, scale, want_cols):
        acc = accum_dtype(q.dtype)
        return q.new_empty(q.shape[0], dtype=acc), q.new_empty(k.shape[0] if want_cols else 0, dtype=acc)

    @torch.library.register_fake("infcl::backward_block")
    def _backward_fake(q, k, scale, row_lse, g_row, col_lse, g_col, dq, dk):
        return q.new_empty(2, dtype=accum_dtype(q.dtype))


class NativeBackend:
    name = "cpu"

    def forward_block(self, q: Tensor, k: Tensor, scale: float, want_cols: bool) -> Tuple[Tensor, Optional[Tensor]]:
        row_lse, col_lse = torch.ops.infcl.forward_block(q, k, float(scale), bool(want_cols))
        return row_lse, (col_lse if want_cols else None)

    def backward_block(
        self,
        q: Tensor,
        k: Tensor,
        scale: float,
        row_lse: Tensor,
        g_row: Tensor,
        col_lse: Optional[Tensor],
        g_col: Optional[Tensor],
        dq: Tensor,
        dk: Tensor,
    ) -> Tuple[Tensor, Tensor]:
        dscale = torch.ops.infcl.backward_block(q, k, float(scale), row_lse, g_row, col_lse, g_col, dq, dk)
        return dscale[0], dscale[1]


BACKEND = NativeBackend()
