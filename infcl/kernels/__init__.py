"""Fused Triton kernels for the softmax (InfoNCE / CLIP) loss's block steps (``backend="triton"``).

- :mod:`.triton_lse_forward`: row (and column) log-sum-exp stats and positive logits, one pass (1 GEMM).
- :mod:`.triton_backward`: the dq and dk kernels, deterministic, without atomics (4 GEMMs).
- :mod:`.tiles`: the jit helpers all three share (tile loads, the S tile, stats, dS).
- :mod:`.configs`: launch settings (tile configs, feature chunking, dtype options, split plans).
- :mod:`.ops`: the custom ops ``torch.ops.infcl.triton_forward_block`` / ``triton_backward_block``.

Importing this package needs triton; whether the kernels are interpreted (TRITON_INTERPRET=1, CPU
tensors) is fixed when it is imported.
"""

from .configs import INTERPRETED, INTERPRETER_TILING, TileConfig, Tiling, interpret_requested
from .ops import backward_block, default_tiling, forward_block

__all__ = [
    "INTERPRETED",
    "INTERPRETER_TILING",
    "TileConfig",
    "Tiling",
    "backward_block",
    "default_tiling",
    "forward_block",
    "interpret_requested",
]
