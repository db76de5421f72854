"""The Triton block steps as torch.library custom ops, so the dispatcher and torch.compile see them.

- ``torch.ops.infcl.triton_forward_block(q, k, scale, pos, want_cols, precision, tiling) -> (rows, cols)``
- ``torch.ops.infcl.triton_backward_block(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq!, dk!,
  precision, tiling) -> dscale`` (accumulates into dq and dk)

``precision`` is tl.dot's input precision for float32 ("ieee", "tf32", "tf32x3"), resolved by the
caller; ``tiling`` is a :class:`Tiling` as ``Tiling.to_ints()``, or ``[]`` for the device's defaults
(:func:`default_tiling`, or the autotuner under INFCL_AUTOTUNE=1). cols is ``[2, 0]`` when not wanted.

Registration, by what the installed torch offers: ``torch.library.triton_op`` + ``wrap_triton``
(torch >= 2.6, on a GPU: torch.compile traces into the kernels), else ``torch.library.custom_op``
with fake impls (torch >= 2.4, and always under the interpreter, whose kernels torch.compile cannot
trace), else plain functions under the same names in this module.
"""

from typing import List, Optional, Tuple

import torch

from . import triton_backward, triton_lse_forward
from .configs import (
    FEATURE_CHUNKS,
    INTERPRETED,
    TileConfig,
    Tiling,
    arch_key,
    autotuning,
    device_facts,
    operand_class,
)

Tensor = torch.Tensor

# Under the interpreter a kernel costs ~1 ms of Python per tile operation whatever the tile's size,
# while the flops are numpy's: few big tiles run fastest (B=1000, D=1000 takes minutes with a GPU's
# 64-wide tiles, seconds with these). The interpreter's S product materializes [BLOCK_M, BLOCK_N, chunk]
# (tiles.score_dot), and Triton caps a tensor at 2**20 entries: 128 x 128 x 64. Tests pin GPU-like
# tilings explicitly.
_BIG = TileConfig(block_m=128, block_n=128, block_out=1024)
INTERPRETER_TILING = Tiling(forward=_BIG, dq=_BIG, dk=_BIG, resident_d=64, chunk_d=64)


def default_tiling(device: torch.device, dtype: torch.dtype, precision: str) -> Tiling:
    """The per-architecture default configs of the three kernels for inputs of ``dtype`` on ``device``
    (the interpreter's big tiles under TRITON_INTERPRET=1)."""
    if INTERPRETED:
        return INTERPRETER_TILING
    return arch_tiling(arch_key(device_facts(device)[0]), dtype, precision)


def arch_tiling(arch: int, dtype: torch.dtype, precision: str) -> Tiling:
    """The default configs for architecture family ``arch`` (:func:`infcl.kernels.configs.arch_key`)."""
    klass = operand_class(dtype, precision)
    resident_d, chunk_d = FEATURE_CHUNKS[klass]
    return Tiling(
        forward=triton_lse_forward.DEFAULT_CONFIGS[arch, klass],
        dq=triton_backward.DQ_CONFIGS[arch, klass],
        dk=triton_backward.DK_CONFIGS[arch, klass],
        resident_d=resident_d,
        chunk_d=chunk_d,
    )


def _tiling(tiling: List[int], q: Tensor, precision: str) -> Tuple[Tiling, bool]:
    """(the Tiling to use, whether to autotune)."""
    if tiling:
        return Tiling.from_ints(tiling), False
    return default_tiling(q.device, q.dtype, precision), autotuning()


def _forward(q: Tensor, k: Tensor, scale: Tensor, pos: Tensor, want_cols: bool, precision: str,
             tiling: List[int]) -> Tuple[Tensor, Tensor]:
    chosen, autotune = _tiling(tiling, q, precision)
    rows, cols = triton_lse_forward.softmax_forward(
        q, k, scale, pos.contiguous(), want_cols, chosen, precision or None, autotune,
        sms=device_facts(q.device)[1], wrap=_WRAP,
    )
    return rows, (cols if cols is not None else rows.new_empty(2, 0))


def _backward(q: Tensor, k: Tensor, scale: Tensor, pos: Tensor, row_stats: Tensor, g_row: Tensor,
              col_stats: Optional[Tensor], g_col: Optional[Tensor], dq: Tensor, dk: Tensor, precision: str,
              tiling: List[int]) -> Tensor:
    chosen, autotune = _tiling(tiling, q, precision)
    return triton_backward.softmax_backward(
        q, k, scale, pos.contiguous(), row_stats, g_row, col_stats, g_col, dq, dk, chosen, precision or None,
        autotune, sms=device_facts(q.device)[1], wrap=_WRAP,
    )


def _forward_fake(q, k, scale, pos, want_cols, precision, tiling):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(3, q.shape[0], dtype=acc), q.new_empty(2, k.shape[0] if want_cols else 0, dtype=acc)


def _backward_fake(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq, dk, precision, tiling):
    return dq.new_empty(2)


FORWARD_OP = "infcl::triton_forward_block"
BACKWARD_OP = "infcl::triton_backward_block"
_WRAP = lambda kernel: kernel  # noqa: E731

if not INTERPRETED and hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton"):
    _WRAP = torch.library.wrap_triton
    forward_block = torch.library.triton_op(FORWARD_OP, _forward, mutates_args=())
    backward_block = torch.library.triton_op(BACKWARD_OP, _backward, mutates_args=("dq", "dk"))
    REGISTRATION = "triton_op"
elif hasattr(torch.library, "custom_op"):
    forward_block = torch.library.custom_op(FORWARD_OP, _forward, mutates_args=())
    backward_block = torch.library.custom_op(BACKWARD_OP, _backward, mutates_args=("dq", "dk"))
    forward_block.register_fake(_forward_fake)
    backward_block.register_fake(_backward_fake)
    REGISTRATION = "custom_op"
else:  # torch < 2.4: no custom-op API worth the name; eager only
    forward_block, backward_block = _forward, _backward
    REGISTRATION = "python"


def gemm_equivalents(dim: int, dtype: torch.dtype, device: torch.device, precision: str = "ieee") -> Tuple[int, int]:
    """(forward, backward) GEMM-equivalents (each 2 * Bq * Bk * D flops) with the device's default tiling,
    for either loss: forward 1 (S once; the column stats come from the same tiles), backward S and the
    product once per dq (dk) slice: 4 while D fits one slice (256 columns by default)."""
    tiling = default_tiling(device, dtype, precision)
    slices = [-(-dim // tiling.block_out(config, dim)) for config in (tiling.dq, tiling.dk)]
    return 1, sum(slices) + 2
