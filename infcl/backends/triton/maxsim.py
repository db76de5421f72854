"""The MaxSim (late-interaction) loss on the Triton kernels (:mod:`infcl.kernels.maxsim`; contract and rules:
:mod:`infcl.contract`, :func:`infcl.cal_maxsim_loss`), through the custom ops
``torch.ops.infcl.triton_maxsim_forward_block`` / ``triton_maxsim_backward_block``. GEMM-equivalents per block:
forward 1, backward 3 (a dq and a dk pass, no atomics). The scale stays a 0-d device tensor (no host sync)."""

from ...contract import Block, Tensor, block_ids
from ...kernels.maxsim import backward_op, forward_op
from .options import FALLBACK, TritonOptions, on_torch_tiles


def _operands(block: Block) -> tuple:
    """The block's operands in the order both ops take them first: q, k, q_weight, k_mask, scale, pos, q_ids, k_ids
    (the launch's flattening of the ids, ``Block.masks``)."""
    return (block.q, block.k, block.q_weight, block.k_mask, block.scale, block.pos, *block_ids(block))


class TritonMaxSim(TritonOptions):
    """The MaxSim loss's block operations on the kernels (``precision``: tl.dot's for float32, None: torch's
    float32 matmul precision, read by the launcher)."""

    def maxsim_forward_block(self, block: Block) -> Tensor:
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.maxsim_forward_block(block)
        return forward_op(*_operands(block), self.precision or "")

    def maxsim_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.maxsim_backward_block(block, dq, dk)
        return backward_op(*_operands(block), block.row_stats, block.g_row, dq, dk, self.precision or "")
