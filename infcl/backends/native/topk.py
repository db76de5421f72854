"""The top-k search on the native CPU kernel (``csrc/topk.cpp``): the custom op ``torch.ops.infcl.topk_block_``
(contract, order and eligibility: :mod:`infcl.contract`; the torch tiles' version:
:mod:`infcl.backends.torch_tiles.topk`)."""

from ...contract import Block, Candidates, Tensor, block_ids
from .build import torch_ops


class NativeTopK:
    """``block_topk`` on the custom op, which continues the rows' lists in place."""

    def block_topk(self, block: Block, col_index: Tensor, found: Candidates, largest: bool, exclude_positive: bool):
        pos = block.pos if exclude_positive else None
        torch_ops().topk_block_(block.q, block.k, col_index, *found, largest, pos, *block_ids(block))
