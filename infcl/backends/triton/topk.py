"""The top-k search on the Triton kernel (:mod:`infcl.kernels.topk`): the interface of
:class:`infcl.backends.topk_tiles.TopKTiles` (definitions and tie rule there). The kernel continues the
rows' lists unsorted; they are sorted best first after each block. n above
:func:`infcl.kernels.topk.max_top` (64; 32 in float64), and float64 where Triton has no float64 tl.dot, run
on the torch tiles."""

from ...kernels.rank import on_torch_tiles
from ...kernels.topk import max_top, topk_block_op
from ..base import Block, Tensor
from ..topk_tiles import TOPK_TILES, Candidates, best_first


class TritonTopK:
    """``precision``: tl.dot's for float32, "ieee" by default (exact float32 products, as on the CPU backends;
    "tf32" rounds the operands to 10-bit mantissas first)."""

    name = "triton"

    def __init__(self, precision: str = "ieee"):
        self.precision = precision

    def block_topk(self, block: Block, col_index: Tensor, found: Candidates, largest: bool, exclude_positive: bool):
        n = found.key.shape[1]
        if n > max_top(block.q.dtype) or on_torch_tiles(block.q.dtype):
            return TOPK_TILES.block_topk(block, col_index, found, largest, exclude_positive)
        pos = block.pos if exclude_positive else None
        topk_block_op(block.q, block.k, col_index, *found, largest, pos, block.q_ids, block.k_ids, self.precision)
        key, index = best_first(found.key, found.index, n)
        found.key.copy_(key)
        found.index.copy_(index)


TRITON_TOPK = TritonTopK()
