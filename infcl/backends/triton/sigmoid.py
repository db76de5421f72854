"""The sigmoid (SigLIP) loss on the fused Triton kernels (:mod:`infcl.kernels.sigmoid`; contract:
:mod:`infcl.contract`). GEMM-equivalents per block: forward 1, backward 4 (a q-owning and a k-owning pass, no
atomics). With ids (``Block.masks``) every column with the row's id is a positive."""

from ...contract import Block, Tensor, block_ids
from ...kernels.sigmoid import sigmoid_backward_block, sigmoid_forward_block
from .options import FALLBACK, TritonOptions, on_torch_tiles


class TritonSigmoid(TritonOptions):
    """The sigmoid loss's block operations on the fused kernels."""

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.sigmoid_forward_block(block)
        ids = block_ids(block)  # the launch's flattening of the ids (Block.masks)
        return sigmoid_forward_block(block.q, block.k, block.scale, block.pos, block.bias, *ids, *self._options())

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.sigmoid_backward_block(block, dq, dk)
        return sigmoid_backward_block(
            block.q,
            block.k,
            block.scale,
            block.pos,
            block.bias,
            *block_ids(block),
            block.g_row,
            dq,
            dk,
            *self._options(),
        )
