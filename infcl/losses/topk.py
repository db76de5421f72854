"""The top-k search's ring step (:func:`infcl.topk_scores`): each rank's rows against every k block, on the
one ring loop (:func:`infcl.ring.driver.ring_forward`), forward only, on a
:class:`infcl.contract.TopKBlockBackend` (definitions and tie rule: :mod:`infcl.contract`).

The rows' lists (:class:`infcl.contract.Candidates`, global indices: the block's ``col_index`` travels with
k, and its ids where given) stay on their rank; at every step the backend continues them in place with the
held block's columns (so a later block starts from the best so far, and no second [Bq, n] list is made),
which merges the lists (the n best of a union are the n best of its parts' n best). After W steps each row
holds its n best over the global k. Nothing travels home (the search is not symmetric).
"""

from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from ..contract import NO_INDEX, Block, Candidates, MaskOptions, Tensor, TopKBlockBackend, accum_dtype
from ..ring.driver import ring_forward
from ..ring.layout import RingLayout


class TopK(NamedTuple):
    """:func:`infcl.topk_scores`' result: each row's n best columns, best first."""

    scores: Tensor  # [Bq, n] accumulation dtype (float32; float64 for float64 inputs)
    indices: Tensor  # [Bq, n] int64 global column indices; -1 in a slot past the eligible columns


class TopKSearch:
    """:class:`infcl.ring.driver.RingLoss` (forward only): the n best columns of each local row."""

    symmetric = False
    n_params = 0

    def __init__(self, n: int, largest: bool, exclude_positive: bool, col_index: Tensor, q_ids, k_ids):
        self.n, self.largest, self.exclude_positive = n, largest, exclude_positive
        self.q_ids = q_ids
        self.k_side = (col_index,) if k_ids is None else (col_index, k_ids)

    def init_rows(self, rows: int, dtype: torch.dtype, device: torch.device) -> Candidates:
        self.found = Candidates.empty(rows, self.n, dtype, device)
        return self.found

    @staticmethod
    def merge(acc: Candidates, part: Candidates) -> None:
        """Nothing left to do: each step continued ``acc`` itself (``part is acc``)."""
        assert part is acc

    def forward_step(self, backend: TopKBlockBackend, block: Block, k_side=()):
        col_index, *k_ids = k_side
        if k_ids:
            block = replace(block, masks=MaskOptions(self.q_ids, k_ids[0]))
        backend.block_topk(block, col_index, self.found, self.largest, self.exclude_positive)
        return self.found, None


def ring_topk(
    q: Tensor,
    k: Tensor,
    n: int,
    labels: Optional[Tensor],
    q_ids,
    k_ids,
    largest: bool,
    backend: TopKBlockBackend,
    layout: RingLayout,
) -> TopK:
    """Each local row's n best global columns of q @ k.T (``labels``: the global column of each row's
    positive to leave out, -1 for none; None: leave none out)."""
    dev = q.device
    col_index = torch.arange(k.shape[0], device=dev) + layout.k_offsets[layout.rank]
    exclude_positive = labels is not None
    if labels is None:
        labels = torch.full((q.shape[0],), -1, dtype=torch.int64, device=dev)
    search = TopKSearch(n, largest, exclude_positive, col_index, q_ids, k_ids)
    one = torch.ones((), dtype=accum_dtype(q.dtype), device=dev)  # Block needs a scale; the search uses none
    found, _ = ring_forward(q, k, one, labels, search, backend, layout)
    return finish(found, largest)


def finish(found: Candidates, largest: bool) -> TopK:
    """The public result, in place: keys back to scores, empty slots to index -1 (score -inf, or +inf when
    not ``largest``), and a row with a NaN among its eligible scores to NaN scores and index -1."""
    scores = found.key if largest else found.key.neg_()
    nan_row = (found.nan > 0)[:, None]
    scores.masked_fill_(nan_row, float("nan"))
    indices = found.index.masked_fill_((found.index == NO_INDEX) | nan_row, -1)
    return TopK(scores, indices)
