"""The softmax (InfoNCE / CLIP) loss on the native CPU kernel: ``torch.ops.infcl.forward_block`` /
``backward_block``, their masked twins ``masked_forward_block`` / ``masked_backward_block`` (the mask options of
:mod:`infcl.masks`: the plain ops stay as they were, so a loss without masks pays nothing for them) and
``guide_label_scores``. The ops: ``csrc/softmax_ops.cpp`` (phases in ``csrc/softmax_forward.cpp`` and
``csrc/softmax_backward.cpp``).
"""

from typing import Optional, Tuple

import torch

from ...contract import Block, MaskOptions, Tensor


def op_masks(masks: MaskOptions) -> tuple:
    """The launch's flattening of the mask options: the masked ops' arguments (multi_positive, q_ids, k_ids,
    guide_q, guide_k, row_threshold, col_threshold), the flat schema a custom op needs."""
    return (
        masks.multi_positive,
        masks.q_ids,
        masks.k_ids,
        masks.guide_q,
        masks.guide_k,
        masks.row_threshold,
        masks.col_threshold,
    )


class NativeSoftmax:
    """The softmax loss's block operations (:mod:`infcl.contract`) on the custom ops; the scale goes in as a host
    float (reading a CPU tensor costs no device sync)."""

    kept_sums = True  # label smoothing's uniform part over the kept entries, in the masked kernel

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        if block.masked:
            rows, cols = torch.ops.infcl.masked_forward_block(
                block.q,
                block.k,
                float(block.scale),
                block.pos,
                bool(symmetric),
                *op_masks(block.masks),
                block.kept_sums,
            )
        else:
            rows, cols = torch.ops.infcl.forward_block(block.q, block.k, float(block.scale), block.pos, bool(symmetric))
        return rows, (cols if symmetric else None)

    def guide_label_scores(self, guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype) -> Tensor:
        """``[Bq]`` G[i, pos[i]] (contract: infcl.contract), read off the kernel's own guide tiles."""
        return torch.ops.infcl.guide_label_scores(guide_q, guide_k, pos)

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        if block.masked:
            return torch.ops.infcl.masked_backward_block(
                block.q,
                block.k,
                float(block.scale),
                block.pos,
                *block.upstream,
                *op_masks(block.masks),
                block.row_pos_count,
                block.row_pos_stats,
                block.col_pos_count,
                block.col_pos_stats,
                dq,
                dk,
                block.row_uniform,
                block.col_uniform,
            )
        return torch.ops.infcl.backward_block(
            block.q,
            block.k,
            float(block.scale),
            block.pos,
            *block.upstream,
            dq,
            dk,
        )
