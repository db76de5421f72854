"""Fused Triton kernels for both losses' block steps (``backend="triton"``), one module per loss and phase.

- :mod:`.softmax_forward`: the softmax (InfoNCE / CLIP) loss's row (and, symmetric, column) log-sum-exp
  stats and positive logits, one pass (1 GEMM); its per-tile helpers in :mod:`.forward_tiles`.
- :mod:`.softmax_backward`: its dq and dk kernels' launcher, deterministic, without atomics (4 GEMMs); the
  kernels in :mod:`.backward_kernels`, their per-tile helpers in :mod:`.backward_tiles`.
- :mod:`.sigmoid`: the sigmoid (SigLIP) loss's forward and backward kernels (1 + 4 GEMMs).
- the jit helpers the kernels share: :mod:`.tiles` (tile loads, the S tile, the dq / dk products),
  :mod:`.tile_stats` (exp, log-sum-exp stats and their merge, dS), :mod:`.masked_tiles` (the mask options).
- :mod:`.configs`: launch settings (the target, tile configs, feature chunking, dtype options, split plans).
- :mod:`.ops`: the custom ops ``torch.ops.infcl.triton_forward_block`` / ``triton_backward_block`` (with
  mask options ``triton_masked_forward_block`` / ``triton_masked_backward_block``) /
  ``triton_sigmoid_forward_block`` / ``triton_sigmoid_backward_block``, registered one way.

Importing this package needs triton; whether the kernels are interpreted (TRITON_INTERPRET=1, CPU
tensors) is fixed when it is imported.
"""

from .configs import INTERPRETER_TILING, TileConfig, Tiling
from .env import INTERPRETED, interpret_requested
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
