"""The features the objectives hand ``cal_inf_loss``: embeddings prepared as sentence-transformers'
similarity reads them, parts side by side in a padded row, and key columns in blocks with the ids that
leave a row's own entries out of its softmax."""

from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

COSINE, DOT = "cosine", "dot"


def prepare(embeddings: torch.Tensor, similarity: str) -> torch.Tensor:
    """``embeddings`` as ``similarity`` ("cosine" or "dot") compares them: float32 for 16-bit inputs, unit rows
    for cosine."""
    # sentence-transformers' similarity functions compute in float32 for 16-bit inputs; so do we.
    if embeddings.dtype in (torch.float16, torch.bfloat16):
        embeddings = embeddings.float()
    return F.normalize(embeddings, p=2, dim=-1) if similarity == COSINE else embeddings


def segments(parts: Sequence[Optional[torch.Tensor]], widths: Sequence[int]) -> torch.Tensor:
    """[B, sum(widths)]: the parts side by side, zeros where a part is None."""
    rows = next(p for p in parts if p is not None)
    return torch.cat([p if p is not None else rows.new_zeros(rows.shape[0], w) for p, w in zip(parts, widths)], dim=1)


class KeyBlocks:
    """The key columns of one call: blocks of B columns each (B: this rank's rows), with their ids.

    Ids: the owner (the global index of the query a column belongs to) excludes the row's own entries;
    a unique negative id (no row has one) keeps every entry.
    """

    def __init__(self, owner: torch.Tensor):
        self.owner = owner  # [B] global row indices of this rank
        self.blocks: List[torch.Tensor] = []
        self.own_excluded: List[bool] = []

    def add(self, feats: torch.Tensor, own_excluded: bool) -> None:
        self.blocks.append(feats)
        self.own_excluded.append(own_excluded)

    def first_key(self, first_row: int) -> int:
        """This rank's first global key column: every rank holds the same blocks of its own B rows."""
        return first_row * len(self.blocks)

    def build(self, first_row: int):
        """(keys [blocks * B, width], the ids ``cal_inf_loss`` takes (q_ids, k_ids; none when no block excludes),
        the labels [B]: the diagonal of the first block, which holds each row's positive)."""
        b = self.owner.shape[0]
        labels = self.first_key(first_row) + torch.arange(b, device=self.owner.device)
        if not any(self.own_excluded):
            return torch.cat(self.blocks), {}, labels
        unique = -(1 + self.first_key(first_row) + torch.arange(b * len(self.blocks), device=self.owner.device))
        ids = [self.owner if own else unique[i * b : (i + 1) * b] for i, own in enumerate(self.own_excluded)]
        return torch.cat(self.blocks), dict(q_ids=self.owner, k_ids=torch.cat(ids)), labels
