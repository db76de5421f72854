"""The top-k search on the Triton kernel (:mod:`infcl.kernels.topk`; contract, order and eligibility:
:mod:`infcl.contract`). The kernel continues the rows' lists unsorted; they are sorted best first after each
block. n above :func:`infcl.kernels.topk.max_top` (64; 32 in float64), and float64 where Triton has no float64
tl.dot (:func:`.options.on_torch_tiles`), run on the torch tiles."""

from ...contract import Block, Candidates, Tensor, block_ids
from ...kernels.topk import max_top, topk_block_op
from ..torch_tiles.topk import best_first
from .options import FALLBACK, TritonOptions, on_torch_tiles

# tl.dot's precision for float32 when the backend pins none: exact float32 products, as on the CPU backends,
# whatever torch's float32 matmul precision (a pinned "tf32" rounds the operands to 10-bit mantissas first).
TOPK_PRECISION = "ieee"


class TritonTopK(TritonOptions):
    """``block_topk`` on the kernel (``precision``: tl.dot's for float32, :data:`TOPK_PRECISION` when None)."""

    def block_topk(self, block: Block, col_index: Tensor, found: Candidates, largest: bool, exclude_positive: bool):
        n = found.key.shape[1]
        if n > max_top(block.q.dtype) or on_torch_tiles(block.q.dtype):
            return FALLBACK.block_topk(block, col_index, found, largest, exclude_positive)
        pos = block.pos if exclude_positive else None
        precision = self.precision or TOPK_PRECISION
        topk_block_op(block.q, block.k, col_index, *found, largest, pos, *block_ids(block), precision)
        key, index = best_first(found.key, found.index, n)
        found.key.copy_(key)
        found.index.copy_(index)
