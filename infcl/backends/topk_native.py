"""The top-k search on the native CPU kernel (``csrc/topk.cpp``): the interface of
:class:`infcl.backends.topk_tiles.TopKTiles` on the custom op ``torch.ops.infcl.topk_block_`` (definitions
and tie rule: :mod:`infcl.backends.topk_tiles`)."""

from .base import Block, Tensor
from .rank_native import torch_ops
from .topk_tiles import Candidates


class NativeTopK:
    name = "cpu"

    def block_topk(self, block: Block, col_index: Tensor, found: Candidates, largest: bool, exclude_positive: bool):
        pos = block.pos if exclude_positive else None
        torch_ops().topk_block_(block.q, block.k, col_index, *found, largest, pos, block.q_ids, block.k_ids)


NATIVE_TOPK = NativeTopK()
