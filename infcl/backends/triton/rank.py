"""The retrieval ranks' two passes on the Triton kernels (:mod:`infcl.kernels.rank`; contract and tie rule:
:mod:`infcl.contract`, :mod:`infcl.backends.torch_tiles.rank`)."""

from ...contract import Best, Block, Tensor, any_positive, block_ids
from ...kernels.rank import ahead_counts, best_positives
from .options import FALLBACK, TritonOptions, on_torch_tiles


class TritonRanks(TritonOptions):
    """The two passes on the kernels (``precision``: tl.dot's for float32, None: torch's float32 matmul
    precision, read by the launcher)."""

    def best_positives(self, block: Block, row_index: Tensor, col_index: Tensor, symmetric: bool):
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.best_positives(block, row_index, col_index, symmetric)
        ids = block_ids(block) if any_positive(block) else (None, None)
        return best_positives(block.q, block.k, block.pos, row_index, col_index, symmetric, *ids, self.precision)

    def ahead_counts(self, block: Block, rows: Best, cols, row_index: Tensor, col_index: Tensor):
        if on_torch_tiles(block.q.dtype):
            return FALLBACK.ahead_counts(block, rows, cols, row_index, col_index)
        excluding = block.masks is not None and not any_positive(block)
        ids = block_ids(block) if excluding else (None, None)
        return ahead_counts(block.q, block.k, rows, cols, row_index, col_index, *ids, self.precision)
