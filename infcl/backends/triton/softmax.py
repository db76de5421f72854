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
guide GEMM (width D') per tile in each of the three kernels (none without a guide). Label smoothing over the kept
entries (``kept_sums``; :mod:`infcl.losses.smoothing`): the masked forward also sums and counts each line's kept
logits (``Block.kept_sums``, ``[8, n]``) and the masked backward subtracts ``Block.row_uniform`` /
``col_uniform`` from dS on the kept entries, in the tiles that decide them.
"""

from typing import Optional, Tuple

import torch

from ...contract import Block, MaskOptions, Tensor
from ...kernels import backward_block, forward_block
from ...kernels.softmax_ops import guide_label_scores, masked_backward_block, masked_forward_block
from .options import FALLBACK, TritonOptions, on_torch_tiles


def _dtypes(block: Block) -> tuple:
    """The dtypes of the block's products: the features' and, with a guide, the guide's."""
    if block.masks is None or block.masks.guide_q is None:
        return (block.q.dtype,)
    return block.q.dtype, block.masks.guide_q.dtype


def op_masks(masks: MaskOptions, symmetric: bool) -> tuple:
    """The launch's flattening of the mask options: the masked custom ops' arguments (q_ids, k_ids, guide_q,
    guide_k, row_threshold, col_threshold, multi_positive as a string), the flat schema torch.library needs;
    the ops take them back as one :class:`~infcl.masks.MaskOptions` (:mod:`infcl.kernels.softmax_ops`)."""
    return (
        masks.q_ids,
        masks.k_ids,
        masks.guide_q,
        masks.guide_k,
        masks.row_threshold,
        masks.col_threshold if symmetric else None,
        masks.multi_positive or "",
    )


class TritonSoftmax(TritonOptions):
    """The softmax loss's block operations on the fused kernels."""

    kept_sums = True  # label smoothing's uniform part over the kept entries, in the masked kernels

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        if on_torch_tiles(*_dtypes(block)):
            return FALLBACK.forward_block(block, symmetric)
        if block.masked:
            masks = op_masks(block.masks, symmetric)
            rows, cols = masked_forward_block(
                block.q, block.k, block.scale, block.pos, symmetric, *masks, *self._options(), block.kept_sums
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

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        if on_torch_tiles(*_dtypes(block)):
            return FALLBACK.backward_block(block, dq, dk)
        if block.masked:
            multi_positive = block.masks.multi_positive
            if multi_positive == "sum":
                row_positives, col_positives = block.row_pos_stats, block.col_pos_stats
            elif multi_positive == "mean":
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
                *op_masks(block.masks, block.symmetric),
                dq,
                dk,
                *self._options(),
                block.row_uniform,
                block.col_uniform if block.symmetric else None,
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
