"""The Triton backend: the block contract of :mod:`infcl.backends.base` as fused kernels (:mod:`infcl.kernels`).

forward_block is one kernel launch (row stats, positive logits and, when wanted, column stats from
the same tiles); backward_block is two (dq, dk), without atomics. Both go through the custom ops
``torch.ops.infcl.triton_forward_block`` / ``triton_backward_block``. GEMM-equivalents per block: 5
for either loss (forward 1, backward 4) while D fits one backward slice (see
:mod:`infcl.kernels.softmax_backward`).

With mask options (``Block.masked``: ids, ``multi_positive``, a guide; :mod:`infcl.masks`) the same kernels
run with their mask flags set, through ``triton_masked_forward_block`` / ``triton_masked_backward_block``:
the positives and exclusions are formed inside each tile, from the ids and the guide scores of one extra
guide GEMM (width D') per tile in each of the three kernels (none without a guide).

Runs on CUDA tensors, and on CPU tensors through Triton's interpreter when TRITON_INTERPRET=1 was set
before this module was imported (that is how CI tests it). float64 inputs are computed in float64
(with Triton 3.2, whose tl.dot has no float64, by the torch tiles).
"""

from typing import Optional, Tuple

import torch

from . import _constant_for_compile
from .base import Block, Tensor
from .torch_tiles import TORCH_TILES

try:
    from ..kernels import INTERPRETED, Tiling, backward_block, forward_block, interpret_requested
    from ..kernels.configs import DOT_PRECISIONS, FLOAT64_DOT
    from ..kernels.kernel_args import torch_matmul_precision
    from ..kernels.ops import (
        guide_label_scores,
        masked_backward_block,
        masked_forward_block,
        sigmoid_backward_block,
        sigmoid_forward_block,
    )
    from ..kernels.target import target_facts, unsupported_reason
except Exception as err:  # triton missing or broken (or a driver error): the backend reports why instead
    _IMPORT_ERROR: Optional[Exception] = err
else:
    _IMPORT_ERROR = None


@_constant_for_compile
def _matmul_precision() -> str:
    """torch's float32 matmul precision, read outside torch.compile's graph (``fp32_precision`` is a C
    getter dynamo cannot trace): a constant of the compiled graph, as ``allow_tf32`` was."""
    return torch_matmul_precision()


class TritonBackend:
    """``precision``: tl.dot's input precision for float32 ("ieee", "tf32", "tf32x3"; None follows torch's
    float32 matmul precision at each call, :func:`infcl.kernels.configs.torch_matmul_precision`; at "tf32"
    the operands are rounded to TF32 to nearest, not truncated). ``tiling``: a :class:`infcl.kernels.Tiling` pinning
    the three kernels' tiles and splits (None: the device's per-architecture defaults, the interpreter's
    big tiles under TRITON_INTERPRET=1, or the autotuner under INFCL_AUTOTUNE=1)."""

    name = "triton"

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

    @staticmethod
    def _on_torch_tiles(block: Block) -> bool:
        """float64 (features or guide) on a GPU with Triton 3.2, whose tl.dot has no float64: the torch tiles
        run the block."""
        float64 = block.q.dtype == torch.float64 or (block.guide_q is not None and block.guide_q.dtype == torch.float64)
        return float64 and not FLOAT64_DOT and not INTERPRETED

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        if self._on_torch_tiles(block):
            return TORCH_TILES.forward_block(block, symmetric)
        if block.masked:
            rows, cols = masked_forward_block(
                block.q, block.k, block.scale, block.pos, symmetric, *self._masks(block, symmetric), *self._options()
            )
        else:
            rows, cols = forward_block(block.q, block.k, block.scale, block.pos, symmetric, *self._options())
        return rows, (cols if symmetric else None)

    def guide_label_scores(self, guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype) -> Tensor:
        """``[Bq]`` G[i, pos[i]] (contract: infcl.backends.base) by the masked kernels' guide product, at the
        precision they take for features of ``feature_dtype`` (:mod:`infcl.kernels.guide_scores`)."""
        float64 = feature_dtype == torch.float64 or guide_q.dtype == torch.float64
        if float64 and not FLOAT64_DOT and not INTERPRETED:
            return TORCH_TILES.guide_label_scores(guide_q, guide_k, pos, feature_dtype)
        return guide_label_scores(guide_q, guide_k, pos, feature_dtype, self._options()[0])

    @staticmethod
    def _masks(block: Block, symmetric: bool) -> tuple:
        """The masked ops' mask arguments: (q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold,
        multi_positive as a string)."""
        col_threshold = block.col_threshold if symmetric else None
        return (
            block.q_ids,
            block.k_ids,
            block.guide_q,
            block.guide_k,
            block.row_threshold,
            col_threshold,
            block.multi_positive or "",
        )

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        if self._on_torch_tiles(block):
            return TORCH_TILES.backward_block(block, dq, dk)
        if block.masked:
            if block.multi_positive == "sum":
                row_positives, col_positives = block.row_pos_stats, block.col_pos_stats
            elif block.multi_positive == "mean":
                row_positives, col_positives = block.row_pos_count, block.col_pos_count
            else:  # one positive per row: pos
                row_positives = col_positives = None
            return masked_backward_block(
                block.q,
                block.k,
                block.scale,
                block.pos,
                block.row_stats,
                block.g_row,
                block.col_stats,
                block.g_col,
                row_positives,
                col_positives if block.symmetric else None,
                *self._masks(block, block.symmetric),
                dq,
                dk,
                *self._options(),
            )
        return backward_block(
            block.q,
            block.k,
            block.scale,
            block.pos,
            block.row_stats,
            block.g_row,
            block.col_stats,
            block.g_col,
            dq,
            dk,
            *self._options(),
        )

    # --- the sigmoid (SigLIP) loss: infcl/kernels/sigmoid.py (contract: infcl.backends.base) -----
    # GEMM-equivalents per block: forward 1, backward 4 (a q-owning and a k-owning pass, no atomics).

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        if self._on_torch_tiles(block):
            return TORCH_TILES.sigmoid_forward_block(block)
        return sigmoid_forward_block(block.q, block.k, block.scale, block.pos, block.bias, *self._options())

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        if self._on_torch_tiles(block):
            return TORCH_TILES.sigmoid_backward_block(block, dq, dk)
        return sigmoid_backward_block(
            block.q,
            block.k,
            block.scale,
            block.pos,
            block.bias,
            block.g_row,
            dq,
            dk,
            *self._options(),
        )


BACKEND = TritonBackend()


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the Triton kernels can run on ``device``, else a sentence saying why not: triton missing, a
    device Triton's active driver does not launch on, or a GPU infcl has no compiled configs for."""
    if _IMPORT_ERROR is not None:
        return (
            f"backend 'triton' needs the triton package (pip install 'infcl[triton]'), which failed to import: "
            f"{_IMPORT_ERROR}"
        )
    if INTERPRETED:
        return None if device.type in ("cpu", "cuda") else _wrong_device(device)
    try:
        facts = target_facts()
    except Exception as err:  # no GPU, or no driver for it: Triton's own message says which
        facts, driver_error = None, err
    if facts is not None and device.type == facts.device_type:
        why = unsupported_reason(facts)
        return None if why is None else f"backend 'triton': {why}"
    if device.type == "cpu":
        if interpret_requested():
            return (
                "backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before infcl's Triton kernels are "
                "imported; it was set later, so the kernels were built for a GPU"
            )
        return (
            "backend 'triton' runs on CUDA tensors, or on CPU tensors only under TRITON_INTERPRET=1 "
            "(Triton's interpreter)"
        )
    if device.type == "cuda" and facts is None:
        return f"backend 'triton' found no GPU driver for Triton: {type(driver_error).__name__}: {driver_error}"
    return _wrong_device(device)


def _wrong_device(device: torch.device) -> str:
    return f"backend 'triton' runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), not on {device.type}"
