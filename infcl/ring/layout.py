"""Who holds which rows: the ring layout of one ``cal_inf_loss`` call.

A single process is the ring of one rank. With ``torch.distributed`` initialized and a group of more
than one rank, every rank contributes its local q rows and k rows; the global k is the concatenation
of every rank's k in rank order. Local sizes may differ between ranks, so they are exchanged once per
call (one small ``all_gather``), and D and dtype are checked to agree on every rank.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from .comm import RingError

# dtype <-> small integer, for the one all_gather that checks every rank agrees.
_DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The dtype code of a rank whose own arguments failed their local checks (see rejected_everywhere).
_REJECTED = -2


@dataclass(frozen=True)
class RingLayout:
    """Sizes and offsets of every rank's block; ``world == 1`` for a single process."""

    rank: int
    world: int
    q_sizes: Tuple[int, ...]
    k_sizes: Tuple[int, ...]
    group: Optional[object] = None
    # (min, max) of every rank's custom labels, or None where a rank uses the default diagonal: gathered
    # with the sizes so that one rank's out-of-range labels fail on every rank, not as a hang.
    label_ranges: Tuple[Optional[Tuple[int, int]], ...] = (None,)

    @property
    def k_offsets(self) -> Tuple[int, ...]:
        """Global index of each rank's first k row (column of S)."""
        return _starts(self.k_sizes)

    @property
    def q_offsets(self) -> Tuple[int, ...]:
        """Global index of each rank's first q row."""
        return _starts(self.q_sizes)

    @property
    def total_k(self) -> int:
        return sum(self.k_sizes)

    @property
    def total_q(self) -> int:
        return sum(self.q_sizes)

    def block_at_step(self, step: int) -> int:
        """The rank whose k block this rank holds at ring step ``step`` (blocks move to rank+1)."""
        return (self.rank - step) % self.world


def _starts(sizes: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(sum(sizes[:r]) for r in range(len(sizes)))


# ``group=LOCAL``: this rank's features only, no ring, even under an initialized torch.distributed (what
# open_clip's losses compute with their default ``world_size=1``).
LOCAL = "local"


def ring_group(group) -> Optional[object]:
    """The process group to ring over, or None when the call is single-process.

    ``group=None`` means the default (world) group when ``torch.distributed`` is initialized;
    ``group="local"`` (:data:`LOCAL`) means no ring whatever torch.distributed holds.
    """
    if isinstance(group, str):
        if group != LOCAL:
            raise ValueError(f"group must be a torch.distributed process group, None or {LOCAL!r}, got {group!r}")
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is None:
        group = dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def _label_range(labels: Optional[torch.Tensor]) -> Optional[Tuple[int, int]]:
    return None if labels is None else (int(labels.min()), int(labels.max()))


def single_layout(bq: int, bk: int, labels: Optional[torch.Tensor] = None) -> RingLayout:
    return RingLayout(rank=0, world=1, q_sizes=(bq,), k_sizes=(bk,), label_ranges=(_label_range(labels),))


@contextmanager
def rejected_everywhere(group) -> Iterator[None]:
    """Run a rank's local argument checks so that a failure stops every rank of the ring at once.

    A rank whose own arguments fail (say an empty shard, or labels of the wrong dtype) raises its
    TypeError / ValueError, but first joins the layout exchange that the other ranks are waiting in,
    marked as rejected, so they raise a ValueError naming it instead of waiting for the process
    group's timeout. ``group=None`` (a single process) just runs the checks.
    """
    try:
        yield
    except (TypeError, ValueError):
        if group is not None:
            _announce_rejection(group)
        raise


def _announce_rejection(group) -> None:
    # The layout exchange's all_gather, with a row that only says "rejected". NCCL (alone, or the CUDA
    # half of "cpu:gloo,cuda:nccl") needs a tensor on this rank's current GPU; the checks may have failed
    # on q itself, so q's device is not used.
    on_gpu = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    row = torch.tensor([0, 0, 0, _REJECTED, 0, -1, 0, 0], dtype=torch.int64, device=device)
    try:
        _gather_rows(row, group, dist.get_rank(group), dist.get_world_size(group))
    except RingError:
        pass  # a broken ring: this rank's own error, raised next, is what matters here


def _gather_rows(mine: torch.Tensor, group, rank: int, world: int) -> list:
    every = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(every, mine, group=group)
    except RuntimeError as err:
        # A peer that died or hangs before the call shows up here first, before ring step 0.
        raise RingError(
            f"infcl ring exchange failed at the layout exchange before step 0 (all_gather of batch sizes, "
            f"rank {rank} of {world}): {err}"
        ) from err
    return torch.stack(every).cpu().tolist()


def _options_code(masks) -> Tuple[int, int]:
    """(code, guide width) of a call's mask options (:class:`infcl.masks.MaskOptions`, or None): every
    rank must pass the same kinds, since the ids and guide features travel with k through the ring."""
    if masks is None:
        return 0, 0
    modes, strategies = (None, "mean", "sum"), ("absolute", "relative")
    code = 1 + 2 * int(masks.has_ids) + 4 * modes.index(masks.multi_positive) + 16 * strategies.index(masks.strategy)
    if not masks.has_guide:
        return code, 0
    return code + 32 * (1 + _DTYPE_CODES.index(masks.guide_q.dtype)), masks.guide_q.shape[1]


def exchange_layout(
    q: torch.Tensor, k: torch.Tensor, group, labels: Optional[torch.Tensor] = None, masks=None
) -> RingLayout:
    """All-gather (Bq, Bk, D, dtype, label range, mask options) from every rank; raise the same ValueError
    on every rank on mismatch."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    code = _DTYPE_CODES.index(q.dtype) if q.dtype in _DTYPE_CODES else -1
    lo, hi = _label_range(labels) or (0, -1)  # an empty range marks the default labels
    options, guide_dim = _options_code(masks)
    mine = torch.tensor(
        [q.shape[0], k.shape[0], q.shape[1], code, lo, hi, options, guide_dim], dtype=torch.int64, device=q.device
    )
    table = _gather_rows(mine, group, rank, world)
    rejected = [r for r, row in enumerate(table) if row[3] == _REJECTED]
    if rejected:
        ranks = ", ".join(str(r) for r in rejected)
        raise ValueError(
            f"infcl: the arguments on rank {ranks} of this ring failed that rank's own checks (its error "
            f"says why); every rank stops at this call"
        )
    dims = {row[2] for row in table}
    codes = {row[3] for row in table}
    if len(dims) > 1 or len(codes) > 1:
        described = ", ".join(
            f"rank {r}: q [{row[0]}, {row[2]}] {_DTYPE_CODES[row[3]] if row[3] >= 0 else 'unsupported'}"
            for r, row in enumerate(table)
        )
        raise ValueError(f"q and k must have the same feature dimension and dtype on every rank; got {described}")
    if len({(row[6], row[7]) for row in table}) > 1:
        raise ValueError(
            "q_ids/k_ids, multi_positive, guide (width and dtype) and guide_margin_strategy must be passed alike on "
            "every rank; got (options code, guide width) "
            + ", ".join(f"rank {r}: ({row[6]}, {row[7]})" for r, row in enumerate(table))
        )
    return RingLayout(
        rank=rank,
        world=world,
        q_sizes=tuple(row[0] for row in table),
        k_sizes=tuple(row[1] for row in table),
        group=group,
        label_ranges=tuple(None if row[5] < row[4] else (row[4], row[5]) for row in table),
    )
