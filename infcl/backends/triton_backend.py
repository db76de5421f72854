"""The Triton backend: the block math of :mod:`infcl.backends.base` as fused kernels (:mod:`infcl.kernels`).

forward_block runs the LSE kernel once for the rows and, when the column LSEs are wanted, once more
with q and k swapped; backward_block runs the one backward kernel. GEMM-equivalents per block: 4 for
one direction (forward 1, backward 3), 5 for the symmetric loss (forward 2, backward 3).

Runs on CUDA tensors, and on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 was set
before this module was imported (that is how CI tests it). float64 inputs are computed in float64.
"""

from typing import Optional, Tuple

import torch

from .base import Tensor

try:
    from ..kernels import INTERPRETED, TileConfig, interpret_requested, lse_backward, lse_forward
except ImportError as err:  # triton missing (or broken): the backend reports why instead of failing import
    _IMPORT_ERROR: Optional[ImportError] = err
else:
    _IMPORT_ERROR = None


class TritonBackend:
    """``precision``: tl.dot input precision for float32 ("ieee", "tf32"; None follows
    torch.backends.cuda.matmul.allow_tf32). ``forward_config`` / ``backward_config``: block sizes
    (None: each kernel module's DEFAULT_CONFIG, the interpreter's big tiles under TRITON_INTERPRET=1, or
    the autotuner under INFCL_AUTOTUNE=1)."""

    name = "triton"

    def __init__(self, precision=None, forward_config: "TileConfig" = None, backward_config: "TileConfig" = None):
        self.precision = precision
        self.forward_config = forward_config
        self.backward_config = backward_config

    def forward_block(self, q: Tensor, k: Tensor, scale: float, want_cols: bool) -> Tuple[Tensor, Optional[Tensor]]:
        row_lse = lse_forward(q, k, scale, self.precision, self.forward_config)
        col_lse = lse_forward(k, q, scale, self.precision, self.forward_config) if want_cols else None
        return row_lse, col_lse

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
        return lse_backward(
            q, k, scale, row_lse, g_row, col_lse, g_col, dq, dk, self.precision, self.backward_config
        )


BACKEND = TritonBackend()


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the Triton kernels can run on ``device``, else a sentence saying why not."""
    if _IMPORT_ERROR is not None:
        return (
            f"backend 'triton' needs the triton package (pip install 'infcl[triton]'), which failed to import: "
            f"{_IMPORT_ERROR}"
        )
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if INTERPRETED:
            return None
        if interpret_requested():
            return (
                "backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before infcl's Triton kernels are "
                "imported; it was set later, so the kernels were built for a GPU"
            )
        return "backend 'triton' runs on CUDA tensors, or on CPU tensors only under TRITON_INTERPRET=1 (Triton's interpreter)"
    return f"backend 'triton' runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), not on {device.type}"
