"""The softmax (InfoNCE / CLIP) loss on the fused Triton kernels (:mod:`infcl.kernels`; contract:
:mod:`infcl.contract`).

forward_block is one kernel launch (row stats, positive logits and, when wanted, column stats from
the same tiles); backward_block is two (dq, dk), without atomics. Both go through the custom ops
``torch.ops.infcl.triton_forward_block`` / ``triton_backward_block``. GEMM-equivalents per block: 5
for either loss (forward 1, backward 4) while D fits one backward slice (see
:mod:`infcl.kernels.softmax_backward`).

With mask options (``Block.masked``: ids, ``multi_positive``, a guide; :mod:`infcl.masks`) the same kernels
run with their mask flags set, through ``triton_masked_forward_block`` / ``triton_masked_backward_block``:
the positives and exclusions are formed inside each tile, from the ids and the guide scores of one extra
guide GEMM (width D') per tile in each of the three kernels (none without a guide).
"""

from typing import Optional, Tuple

import torch

from ...contract import Block, Tensor
from ...kernels import backward_block, forward_block
from ...kernels.softmax_ops import guide_label_scores, masked_backward_block, masked_forward_block
from .options import FALLBACK, TritonOptions, on_torch_tiles


def _dtypes(block: Block) -> tuple:
    """The dtypes of the block's products: the features' and, with a guide, the guide's."""
    return (block.q.dtype,) if block.guide_q is None else (block.q.dtype, block.guide_q.dtype)


class TritonSoftmax(TritonOptions):
    """The softmax loss's block operations on the fused kernels."""

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        if on_torch_tiles(*_dtypes(block)):
            return FALLBACK.forward_block(block, symmetric)
        if block.masked:
            rows, cols = masked_forward_block(
                block.q, block.k, block.scale, block.pos, symmetric, *self._masks(block, symmetric), *self._options()
            )
        else:
            rows, cols = forward_block(block.q, block.k, block.scale, block.pos, symmetric, *self._options())
        return rows, (cols if symmetric else None)

    def guide_label_scores(self, guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype) -> Tensor:
        """``[Bq]`` G[i, pos[i]] (contract: infcl.contract) by the masked kernels' guide product, at the
        precision they take for features of ``feature_dtype`` (:mod:`infcl.kernels.softmax_guide_scores`)."""
        if on_torch_tiles(feature_dtype, guide_q.dtype):
            return FALLBACK.guide_label_scores(guide_q, guide_k, pos, feature_dtype)
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
        if on_torch_tiles(*_dtypes(block)):
            return FALLBACK.backward_block(block, dq, dk)
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
                *block.upstream,
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
            *block.upstream,
            dq,
            dk,
            *self._options(),
        )
