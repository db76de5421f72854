"""The retrieval ranks' two passes on the native CPU kernel (``csrc/retrieval.cpp``): the custom ops
``torch.ops.infcl.rank_best_positives`` and ``torch.ops.infcl.rank_ahead_counts`` (contract and tie rule:
:mod:`infcl.contract`, :mod:`infcl.backends.torch_tiles.rank`)."""

from typing import Optional

from ...contract import Ahead, Best, Block, Tensor, any_positive, block_ids
from .build import torch_ops


class NativeRanks:
    """The two passes on the custom ops."""

    def best_positives(self, block: Block, row_index: Tensor, col_index: Tensor, symmetric: bool):
        ids = block_ids(block) if any_positive(block) else (None, None)
        out = torch_ops().rank_best_positives(block.q, block.k, block.pos, row_index, col_index, symmetric, *ids)
        return Best(*out[:3]), (Best(*out[3:]) if symmetric else None)

    def ahead_counts(self, block: Block, rows: Best, cols: Optional[Best], row_index: Tensor, col_index: Tensor):
        excluding = block.masks is not None and not any_positive(block)  # duplicates of the positive left out
        ids = block_ids(block) if excluding else (None, None)
        col_score, col_best = (None, None) if cols is None else (cols.score, cols.index)
        out = torch_ops().rank_ahead_counts(
            block.q, block.k, rows.score, rows.index, col_score, col_best, row_index, col_index, *ids
        )
        return Ahead(*out[:2]), (Ahead(*out[2:]) if cols is not None else None)
