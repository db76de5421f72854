"""The sigmoid (SigLIP) loss on the fused Triton kernels (:mod:`infcl.kernels.sigmoid`; contract:
:mod:`infcl.contract`). GEMM-equivalents per block: forward 1, backward 4 (a q-owning and a k-owning pass, no
atomics). With ids (``Block.masks``) every column with the row's id is a positive."""

from ...contract import Block, Tensor, block_ids
from ...kernels.sigmoid import sigmoid_backward_block, sigmoid_forward_block
from .options import FALLBACK, TritonOptions, on_torch_tiles


def _operands(block: Block) -> tuple:
    """The block's operands in the order both ops take them first: q, k, scale, pos, bias, q_ids, k_ids (the
    launch's flattening of the ids, ``Block.masks``)."""
    return (block.q, block.k, block.scale, block.pos, block.bias, *block_ids(block))


class TritonSigmoid(TritonOptions):
    """The sigmoid loss's block operations on the fused kernels."""

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.sigmoid_forward_block(block)
        return sigmoid_forward_block(*_operands(block), *self._options())

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.sigmoid_backward_block(block, dq, dk)
        return sigmoid_backward_block(*_operands(block), block.g_row, dq, dk, *self._options())
