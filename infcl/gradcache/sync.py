"""Deferred gradient synchronization for ``no_sync_except_last``: DDP, FSDP and FSDP2.

GradCache back-propagates every chunk separately; a data-parallel wrapper would reduce the gradients
after each of those backward passes. ``no_sync(model)`` suspends that for one chunk, so the
gradients are reduced once, on the last chunk, for:

* ``DistributedDataParallel`` and ``FullyShardedDataParallel`` (FSDP1): their ``no_sync()``
  context manager (FSDP1 then accumulates unsharded gradients until the synced backward).
* FSDP2 (a module passed to ``torch.distributed.fsdp.fully_shard``, an ``FSDPModule``):
  ``set_requires_gradient_sync(False)`` for the block; on exit every FSDP submodule's own setting
  is put back, so an outer gradient-accumulation ``set_requires_gradient_sync(False)`` survives.

A ``torch.compile``'d wrapper (``OptimizedModule``) is looked through via its ``_orig_mod``.
"""

from contextlib import contextmanager
from typing import Iterator, List, Optional, Sequence

import torch.distributed as dist
from torch import nn

SUPPORTED = "DistributedDataParallel, FullyShardedDataParallel or an FSDP2 module (fully_shard)"


def _fsdp_classes():
    """(FSDP1 class, FSDP2 ``FSDPModule`` class), each None where this torch build lacks it."""
    if not dist.is_available():
        return None, None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        FullyShardedDataParallel = None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None
    return FullyShardedDataParallel, FSDPModule


def _unwrap_compiled(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def sync_kind(model: nn.Module) -> Optional[str]:
    """ "ddp", "fsdp" (FSDP1), "fsdp2", or None for a module whose gradients nothing synchronizes."""
    model = _unwrap_compiled(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "ddp"
    fsdp1, fsdp2 = _fsdp_classes()
    if fsdp1 is not None and isinstance(model, fsdp1):
        return "fsdp"
    if fsdp2 is not None and isinstance(model, fsdp2):
        return "fsdp2"
    return None


def check_syncable(models: Sequence[nn.Module]) -> None:
    """TypeError naming every model that ``no_sync`` cannot defer."""
    unsupported = [f"models[{i}] is {type(m).__name__}" for i, m in enumerate(models) if sync_kind(m) is None]
    if unsupported:
        raise TypeError(f"no_sync_except_last=True needs every model wrapped in {SUPPORTED}; " + ", ".join(unsupported))


def _fsdp2_sync_flags(model: nn.Module) -> Optional[List[tuple]]:
    """(param group, reduce_grads, all_reduce_grads) of every FSDP2 submodule, or None where this
    torch version keeps them elsewhere (the flags set_requires_gradient_sync writes)."""
    _, fsdp2 = _fsdp_classes()
    flags = []
    try:
        for module in model.modules():
            if isinstance(module, fsdp2):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    flags.append((group, group.reduce_grads, group.all_reduce_grads))
    except AttributeError:
        return None
    return flags


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Suspend ``model``'s gradient synchronization for the block (see the module docstring)."""
    inner = _unwrap_compiled(model)
    kind = sync_kind(inner)
    if kind in ("ddp", "fsdp"):
        with inner.no_sync():
            yield
        return
    if kind != "fsdp2":
        raise TypeError(f"no_sync needs {SUPPORTED}, got {type(model).__name__}")
    saved = _fsdp2_sync_flags(inner)
    inner.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        if saved is None:
            inner.set_requires_gradient_sync(True)
        else:
            for group, reduce_grads, all_reduce_grads in saved:
                group.reduce_grads, group.all_reduce_grads = reduce_grads, all_reduce_grads
