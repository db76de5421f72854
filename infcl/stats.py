"""What trainers log, from the loss's own statistics (no extra pass), and the masked losses' reductions.

Each direction's forward leaves a ``[3, n]`` per-row *info* beside its losses (rows: :data:`HIT`,
:data:`POS_LOGIT`, :data:`HAS_POS`): whether the row's largest logit over its non-excluded columns is a
positive (ties count as hits: the positive is one of the values the maximum was taken over), the mean
of its positives' logits, and whether it has a positive at all (always, without ``multi_positive``).
"""

from typing import NamedTuple, Optional

import torch

Tensor = torch.Tensor

HIT, POS_LOGIT, HAS_POS = 0, 1, 2  # rows of a direction's per-row info


class InfLossStats(NamedTuple):
    """``cal_inf_loss(..., return_stats=True)``'s second output: 0-d tensors over this rank's rows that
    have a positive (NaN when none has); the k->q fields are None for a one-directional loss."""

    q2k_accuracy: Tensor  # fraction of rows whose top-1 column (over non-excluded columns) is a positive
    q2k_positive_logit: Tensor  # mean over rows of the mean logit S = scale * q.k of the row's positives
    k2q_accuracy: Optional[Tensor] = None  # the same for the columns (symmetric loss)
    k2q_positive_logit: Optional[Tensor] = None


def row_info(hit: Tensor, positive_logit: Tensor, has_positive: Tensor) -> Tensor:
    """``[3, n]`` per-row info, rows in the order :data:`HIT`, :data:`POS_LOGIT`, :data:`HAS_POS` (each ``[n]``;
    bools become 0/1 in ``positive_logit``'s dtype)."""
    dtype = positive_logit.dtype
    return torch.stack((hit.to(dtype), positive_logit, has_positive.to(dtype)))


def _mean_over_valid(values: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, values, 0).sum() / valid.sum()


def loss_stats(row_info: Tensor, col_info: Optional[Tensor]) -> InfLossStats:
    """The stats of one call from its directions' ``[3, n]`` infos (``col_info`` None: one direction)."""
    out = []
    for info in (row_info, col_info):
        if info is None:
            continue
        valid = info[HAS_POS] > 0
        out += [_mean_over_valid(info[HIT], valid), _mean_over_valid(info[POS_LOGIT], valid)]
    return InfLossStats(*(t.detach() for t in out))


def reduce_masked(row_loss: Tensor, col_loss: Optional[Tensor], row_valid: Tensor, col_valid, reduction: str) -> Tensor:
    """Reduce losses where some rows (and columns) may have no positive (NaN losses, ``*_valid`` False).

    "none": per row, or per pair (row_i + column_i) / 2 for the symmetric loss (NaN where either has no
    positive). "sum": the sum over rows (and columns, halved) that have a positive. "mean": that sum over
    half the number of directed items with a positive, i.e. the mean over the rows (and columns) that
    have one; 0 when none has (no gradient). With every row valid this is bit for bit the plain loss's
    ``mean((row + col) / 2)`` (``torch.where`` picks it, so no host sync decides).
    """
    both = col_loss is not None
    per_item = (row_loss + col_loss) / 2 if both else row_loss
    if reduction == "none":
        return per_item
    kept = torch.where(row_valid, row_loss, 0)
    count, every = row_valid.sum(), row_valid.all()
    if both:
        kept = (kept + torch.where(col_valid, col_loss, 0)) / 2
        count, every = (count + col_valid.sum()) / 2, every & col_valid.all()
    if reduction == "sum":
        return kept.sum()
    return torch.where(every, per_item.mean(), kept.sum() / count.clamp(min=1))
