"""How a block is split into programs: the forward's row groups and k splits (:func:`plan_forward`) and the
backward's k (q) splits (:func:`plan_backward_splits`), from the device's SM count."""

import math
from dataclasses import dataclass

import triton

from .configs import Tiling

# Programs to aim for per SM: two resident programs hide each other's loads and tails.
PROGRAMS_PER_SM = 2
# Bounds on the per-split buffers, so extra memory stays linear in B: the forward's row partials
# are [3, splits, Bq] and the symmetric column partials [2, groups, Bk]; the backward's partial dq
# (dk) is [backward_splits, Bq (Bk), D], so it splits only a few ways.
MAX_SPLITS = 16
MAX_GROUPS = 32
MAX_BACKWARD_SPLITS = 4


@dataclass(frozen=True)
class ForwardPlan:
    groups: int  # grid axis 0: row groups (one row block each, unless symmetric)
    splits: int  # grid axis 1: contiguous shares of the k blocks


def plan_forward(n_q: int, n_k: int, tiling: Tiling, symmetric: bool, sms: int, row_tiles: int = 1) -> ForwardPlan:
    """How many programs share the forward: every unit of ``row_tiles`` row blocks its own program (one
    direction) or at most MAX_GROUPS row groups (symmetric: each group keeps its own column partials),
    times as many k splits as fit PROGRAMS_PER_SM programs per SM in one wave: rounded down, since rounding
    up adds a second wave of a few programs (32 groups on 132 SMs: 9 splits are 288 programs, 1.09 waves,
    the second nearly empty; 8 are 256, 0.97). Independent of the autotuned block sizes: a program whose
    share is empty writes the empty stats."""
    cfg = tiling.forward
    n_rb, n_cb = triton.cdiv(triton.cdiv(n_q, cfg.block_m), row_tiles), triton.cdiv(n_k, cfg.block_n)
    groups = tiling.groups or (min(n_rb, MAX_GROUPS) if symmetric else n_rb)
    splits = tiling.splits or min(max(PROGRAMS_PER_SM * sms // groups, 1), n_cb, MAX_SPLITS)
    return ForwardPlan(groups, splits)


def plan_backward_splits(n_owned: int, n_other: int, slices: int, tiling: Tiling, sms: int) -> int:
    """k (q) splits of the dq (dk) kernel: more than 1 only when the owned blocks times the D slices
    leave SMs idle."""
    if tiling.backward_splits is not None:
        return tiling.backward_splits
    programs = n_owned * slices
    return min(max(math.ceil(PROGRAMS_PER_SM * sms / programs), 1), n_other, MAX_BACKWARD_SPLITS)
