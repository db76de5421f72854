"""What every Triton block operation shares: the backend's options (tl.dot's precision, a pinned tiling) and the
one rule for float64 on a Triton whose ``tl.dot`` has no float64 (Triton 3.4, the floor): those blocks run on the
torch tiles, whatever the API."""

from typing import Optional

import torch

from ...kernels import INTERPRETED, Tiling
from ...kernels.configs import DOT_PRECISIONS, FLOAT64_DOT
from ...kernels.kernel_args import torch_matmul_precision
from ..resolve import constant_for_compile
from ..torch_tiles import TORCH_TILES

# Where a float64 block runs when the kernels cannot take it (:func:`on_torch_tiles`).
FALLBACK = TORCH_TILES


def on_torch_tiles(*dtypes: torch.dtype) -> bool:
    """Whether a block with operands of ``dtypes`` (features, guide) runs on the torch tiles: float64 on a GPU
    with Triton 3.4, whose tl.dot has no float64 (never under the interpreter)."""
    return torch.float64 in dtypes and not FLOAT64_DOT and not INTERPRETED


@constant_for_compile
def _matmul_precision() -> str:
    """torch's float32 matmul precision, read outside torch.compile's graph (``fp32_precision`` is a C
    getter dynamo cannot trace): a constant of the compiled graph, as ``allow_tf32`` was."""
    return torch_matmul_precision()


class TritonOptions:
    """``precision``: tl.dot's input precision for float32 ("ieee", "tf32", "tf32x3"; None follows torch's
    float32 matmul precision at each call, :func:`infcl.kernels.kernel_args.torch_matmul_precision`; at "tf32"
    the operands are rounded to TF32 to nearest, not truncated). ``tiling``: a :class:`infcl.kernels.Tiling`
    pinning the softmax and sigmoid kernels' tiles and splits (None: the device's per-architecture defaults,
    the interpreter's big tiles under TRITON_INTERPRET=1, or the autotuner under INFCL_AUTOTUNE=1)."""

    def __init__(self, precision: Optional[str] = None, tiling: "Optional[Tiling]" = None):
        if precision is not None and precision not in DOT_PRECISIONS:
            raise ValueError(f"precision must be None or one of {DOT_PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.tiling = tiling

    def _options(self):
        precision = self.precision
        if precision is None:
            precision = _matmul_precision()
        return precision, (self.tiling.to_ints() if self.tiling is not None else [])
