"""Fused Triton kernels for the contrastive loss's block math (used by ``backend="triton"``).

- :mod:`.triton_lse_forward`: row log-sum-exps of S = scale * q @ k.T with an online LSE (1 GEMM).
- :mod:`.triton_backward`: recomputes S per tile and accumulates dq, dk and the scale gradient (3 GEMMs).
- :mod:`.tiles`: the strided tile loads, the S tile and the launch options both phases share.

Importing this package needs triton; whether the kernels are interpreted (TRITON_INTERPRET=1, CPU
tensors) is fixed when it is imported.
"""

from .tiles import INTERPRETED, TileConfig, interpret_requested
from .triton_backward import lse_backward
from .triton_lse_forward import lse_forward

__all__ = ["INTERPRETED", "TileConfig", "interpret_requested", "lse_backward", "lse_forward"]
