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

from .base import Block, Tensor, accum_dtype
from .native_build import load_error


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the native kernel can run on ``device`` (CPU, extension built), else a sentence saying why."""
    if torch.device(device).type != "cpu":
        return f"backend 'cpu' runs on CPU tensors only, got a tensor on {device}"
    return load_error()


def _register_fakes() -> None:
    """Shape-only implementations so torch.compile / FakeTensor can trace through the custom ops."""
    _register_sigmoid_fakes()

    @torch.library.register_fake("infcl::forward_block")
    def _forward_fake(q, k, scale, pos, want_cols):
        acc = accum_dtype(q.dtype)
        return q.new_empty(3, q.shape[0], dtype=acc), q.new_empty(2, k.shape[0] if want_cols else 0, dtype=acc)

    @torch.library.register_fake("infcl::backward_block")
    def _backward_fake(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq, dk):
        return q.new_empty(2, dtype=accum_dtype(q.dtype))


def _register_sigmoid_fakes() -> None:
    """Shape-only implementations of the sigmoid loss's ops (csrc/infcl_siglip.cpp)."""

    @torch.library.register_fake("infcl::sigmoid_forward_block")
    def _sigmoid_forward_fake(q, k, pos, scale, bias):
        return q.new_empty(q.shape[0], dtype=accum_dtype(q.dtype))

    @torch.library.register_fake("infcl::sigmoid_backward_block")
    def _sigmoid_backward_fake(q, k, pos, scale, bias, g_row, dq, dk):
        return q.new_empty(2, dtype=accum_dtype(q.dtype))


class NativeBackend:
    """The block contract (:mod:`infcl.backends.base`) on the custom ops; the scale goes in as a host float
    (reading a CPU tensor costs no device sync)."""

    name = "cpu"

    def forward_block(self, block: Block, want_cols: bool) -> Tuple[Tensor, Optional[Tensor]]:
        rows, cols = torch.ops.infcl.forward_block(block.q, block.k, float(block.scale), block.pos, bool(want_cols))
        return rows, (cols if want_cols else None)

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return torch.ops.infcl.backward_block(
            block.q, block.k, float(block.scale), block.pos, block.row_stats, block.g_row,
            block.col_stats, block.g_col, dq, dk,
        )

    # --- the sigmoid (SigLIP) loss: csrc/infcl_siglip.cpp (contract: infcl.backends.base) ------------

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        return torch.ops.infcl.sigmoid_forward_block(block.q, block.k, block.pos, float(block.scale), float(block.bias))

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return torch.ops.infcl.sigmoid_backward_block(
            block.q, block.k, block.pos, float(block.scale), float(block.bias), block.g_row, dq, dk
        )


BACKEND = NativeBackend()
