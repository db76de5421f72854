"""The sigmoid (SigLIP) loss on the native CPU kernel: ``torch.ops.infcl.sigmoid_forward_block`` /
``sigmoid_backward_block`` (``csrc/infcl_siglip.cpp``; contract: :mod:`infcl.contract`). With ids
(``Block.masks``) the ops take them last, and every column with the row's id is a positive."""

import torch

from ...contract import Block, Tensor, block_ids


class NativeSigmoid:
    """The sigmoid loss's block operations on the custom ops; the scale and bias go in as host floats."""

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        return torch.ops.infcl.sigmoid_forward_block(
            block.q, block.k, float(block.scale), block.pos, float(block.bias), *block_ids(block)
        )

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return torch.ops.infcl.sigmoid_backward_block(
            block.q, block.k, float(block.scale), block.pos, float(block.bias), block.g_row, dq, dk, *block_ids(block)
        )
