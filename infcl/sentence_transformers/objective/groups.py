"""Which process group ``cal_inf_loss`` rings over, and where this rank's rows sit in it: the global indices
the objectives' labels and ids are built from."""

from typing import Optional, Tuple

import torch
import torch.distributed as dist

_OWN_RANK_GROUPS = {}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def loss_group(gather_across_devices: bool, group):
    """The group ``cal_inf_loss`` rings over: ``group`` (None: the world) when gathering; without
    gathering, a group of this rank alone, since ``cal_inf_loss`` would ring over an initialized
    world by default."""
    if gather_across_devices:
        return group
    if not _distributed() or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if world not in _OWN_RANK_GROUPS:  # created once per process group; only this rank takes part
        _OWN_RANK_GROUPS[world] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return _OWN_RANK_GROUPS[world]


def world_and_rank(group) -> Tuple[int, int]:
    """(world size, this rank) of the group ``cal_inf_loss`` rings over; (1, 0) for a single process."""
    if not _distributed():
        return 1, 0
    ring = dist.group.WORLD if group is None else group
    return dist.get_world_size(ring), dist.get_rank(ring)


def rows_before(rows: int, group, device: torch.device) -> int:
    """How many rows the ranks before this one in ``group`` hold (one all_gather of an int)."""
    world, rank = world_and_rank(group)
    if world == 1:
        return 0
    ring = dist.group.WORLD if group is None else group
    # A CPU tensor wherever the group has gloo (also 'cpu:gloo,cuda:nccl'); else the features' device.
    comm_device = torch.device("cpu") if "gloo" in str(dist.get_backend(ring)) else device
    sizes = [torch.zeros(1, dtype=torch.int64, device=comm_device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([rows], dtype=torch.int64, device=comm_device), group=ring)
    return int(sum(int(s) for s in sizes[:rank]))


def positive_columns(rows: torch.Tensor, keys: torch.Tensor, group) -> Optional[torch.Tensor]:
    """Global column of each row's positive, which is the local key row of the same index; None
    (the diagonal, which cal_inf_loss places itself) when there are as many keys as rows."""
    if keys.shape[0] == rows.shape[0]:
        return None
    offset = rows_before(keys.shape[0], group, keys.device)
    return torch.arange(offset, offset + rows.shape[0], device=rows.device)


def global_rows(b: int, group, device: torch.device) -> Tuple[int, torch.Tensor]:
    """(the global index of this rank's first row, the global index of each of its ``b`` rows [b])."""
    first_row = rows_before(b, group, device)
    return first_row, torch.arange(first_row, first_row + b, device=device)
