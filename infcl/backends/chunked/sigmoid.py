"""The sigmoid (SigLIP) loss on the chunked route: handed to the fused kernels (:func:`.options.fused`). A chunked
sigmoid pass is not worth it yet: the fused backward is already 4 GEMM-equivalents, the route's count."""

from ...contract import Block, Tensor
from .options import ChunkedOptions, fused


class ChunkedSigmoid(ChunkedOptions):
    """The sigmoid loss's block operations: the fused kernels' (the Triton kernels where they run, else the torch
    tiles)."""

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        return fused(block.q.device).sigmoid_forward_block(block)

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return fused(block.q.device).sigmoid_backward_block(block, dq, dk)
