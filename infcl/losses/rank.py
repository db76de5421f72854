"""The retrieval ranks' two passes as ring steps (:class:`infcl.ring.driver.RingLoss`, forward only, no-grad),
on a :class:`infcl.contract.RankBlockBackend` (definitions and tie rule: :mod:`infcl.contract`; the API:
:func:`infcl.metrics.retrieval_metrics`).

1. :class:`BestPositives`: each row's (and column's) best positive, its score read off the tile that
   holds it (the same product the counts compare with: ties compare equal), and its global index.
2. :class:`AheadCounts`: the number of columns (rows) ahead of it; the column thresholds travel with k,
   the column counts travel home like a symmetric loss's column partials.
"""

from dataclasses import replace

import torch

from ..contract import Ahead, Best, Block, MaskOptions, RankBlockBackend, Tensor
from ..ring.driver import MergedParts, SummedParts


class BestPositives(MergedParts):
    """:class:`infcl.ring.driver.RingLoss` (forward only) for pass 1: each row's and column's best positive."""

    symmetric = True
    n_params = 0
    parts = Best

    def __init__(self, row_index: Tensor, col_index: Tensor, ids, any_positive: bool):
        self.row_index, self.any_positive = row_index, any_positive
        self.q_ids, k_ids = ids
        self.k_side = (col_index,) if k_ids is None else (col_index, k_ids)

    def forward_step(self, backend: RankBlockBackend, block: Block, k_side=()):
        col_index, *k_ids = k_side
        if self.any_positive:
            block = replace(block, masks=MaskOptions(self.q_ids, k_ids[0], "any"))
        return backend.best_positives(block, self.row_index, col_index, True)


class AheadCounts(SummedParts):
    """:class:`infcl.ring.driver.RingLoss` (forward only) for pass 2: the entries ahead of each best positive.
    The columns' :class:`Best` travels with k (``k_side``), beside their global indices and ids."""

    parts = Ahead
    symmetric = True
    n_params = 0

    def __init__(self, rows: Best, cols: Best, row_index: Tensor, col_index: Tensor, ids, any_positive: bool):
        self.rows, self.row_index = rows, row_index
        self.q_ids, k_ids = ids
        self.any_positive = any_positive
        self.k_side = (col_index, *cols) + (() if k_ids is None else (k_ids,))

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Ahead:
        return super().init_rows(n, torch.int64, device)

    def forward_step(self, backend: RankBlockBackend, block: Block, k_side=()):
        col_index, score, index, count, *k_ids = k_side
        if k_ids:
            mode = "any" if self.any_positive else None
            block = replace(block, masks=MaskOptions(self.q_ids, k_ids[0], mode))
        return backend.ahead_counts(block, self.rows, Best(score, index, count), self.row_index, col_index)
