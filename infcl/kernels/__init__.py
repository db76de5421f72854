"""The Triton kernels of every API, their launchers and their registration as custom ops (``backend="triton"``; the
backend objects that call them: :mod:`infcl.backends.triton`). Named by loss and phase; nothing here imports
from above but :mod:`infcl.contract` and the shared numerics (:mod:`infcl.lse`, :mod:`infcl.masks`).

- Softmax (InfoNCE / CLIP): :mod:`.softmax_forward` (the row (and, symmetric, column) log-sum-exp stats and
  positive logits, one pass, 1 GEMM; its per-tile helpers in :mod:`.softmax_forward_tiles`);
  :mod:`.softmax_backward` (the dq and dk launcher, deterministic, without atomics, 4 GEMMs; the one kernel, with
  a ``BY_COLUMN`` constexpr, in :mod:`.softmax_backward_kernels`, its per-tile helpers in
  :mod:`.softmax_backward_tiles`); the mask options' tiles in :mod:`.softmax_mask_tiles`; the guide thresholds'
  pass in :mod:`.softmax_guide_scores`.
- Sigmoid (SigLIP): :mod:`.sigmoid` (forward and backward kernels and launchers, 1 + 4 GEMMs).
- Distillation: :mod:`.distill`; retrieval ranks: :mod:`.rank` (both with a ``BY_COLUMN`` constexpr too).
- Matryoshka prefixes (the softmax loss of every prefix dimension in one walk): :mod:`.matryoshka` (forward and
  backward kernels and launchers, ``BY_COLUMN`` too).
- MaxSim (late interaction): :mod:`.maxsim` (forward, dq and dk kernels and launchers; token tiles).
- The jit helpers every kernel shares: :mod:`.score_tiles` (tile loads, the S tile in its forms, the dq / dk
  products), :mod:`.tile_stats` (exp, log-sum-exp stats and their merge, dS).
- Which tile each kernel takes on each GPU: :mod:`.tiling` (the one tiling module); the config dataclasses:
  :mod:`.configs`; launch arguments: :mod:`.kernel_args`; the GPU: :mod:`.target`; :mod:`.split_plan`,
  :mod:`.autotune`, :mod:`.env`.
- The custom ops ``torch.ops.infcl.triton_*``: each loss registers its own, all through
  :func:`.registration.register_op`: the softmax loss's in :mod:`.softmax_ops`, the others at the end of their
  module (:mod:`.sigmoid`, :mod:`.distill`, :mod:`.rank`, :mod:`.topk`, :mod:`.matryoshka`, :mod:`.maxsim`).

Importing this package needs triton; whether the kernels are interpreted (TRITON_INTERPRET=1, CPU
tensors) is fixed when it is imported.
"""

from .configs import INTERPRETER_TILING, TileConfig, Tiling
from .env import INTERPRETED, interpret_requested
from .softmax_ops import backward_block, forward_block
from .tiling import target_tiling

__all__ = [
    "INTERPRETED",
    "INTERPRETER_TILING",
    "TileConfig",
    "Tiling",
    "backward_block",
    "forward_block",
    "interpret_requested",
    "target_tiling",
]
