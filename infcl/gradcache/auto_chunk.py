"""``chunk_sizes="auto"``: the largest chunk whose activations fit a memory budget.

One probe chunk of ``PROBE_ROWS`` samples is run forward with grad enabled (RNG snapshot restored
afterwards, no backward, so parameters and the random stream are untouched). Every tensor autograd
saves for backward is counted once per storage, parameters excluded: those activations are what a
chunk holds at its peak and what grows linearly with its size. The chunk is then
``budget // bytes_per_sample``, clamped to [1, batch]. The estimate ignores temporaries that are
freed during the forward and the gradient buffers, which is why the default CUDA budget is only a
fraction of the free memory.
"""

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from .inputs import batch_size_of, call_model, input_tensors
from .rand_context import RandContext

logger = logging.getLogger(__name__)

# Samples in the probe chunk: enough that per-sample activations dominate fixed per-call costs,
# small enough to fit wherever one training sample fits a few times over.
PROBE_ROWS = 8
# Default budget on CUDA: this fraction of the free memory at probe time (the rest covers gradients,
# optimizer temporaries and allocator fragmentation, which the saved-tensor count does not see).
CUDA_FREE_FRACTION = 0.5


def saved_activation_bytes(model: nn.Module, chunk: Any, model_call: Callable[[nn.Module, Any], Any]) -> int:
    """Bytes autograd saves for backward in ``model_call(model, chunk)``, parameters and inputs excluded."""
    resident = [*model.parameters(), *input_tensors(chunk)]
    skip = {(t.device, t.untyped_storage().data_ptr()) for t in resident}
    seen = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in skip and key not in seen:
            seen.add(key)
            total += storage.nbytes()
        return t

    with RandContext(*input_tensors(chunk)), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model_call(model, chunk)
    del out
    return total


def default_budget(device: Optional[torch.device]) -> int:
    """``CUDA_FREE_FRACTION`` of the free memory of a CUDA device; elsewhere the caller must give one."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_FRACTION)
    raise ValueError(
        "chunk_sizes='auto' needs memory_budget=<bytes> on devices other than CUDA (no free-memory query)"
    )


def auto_chunk_size(
    model: nn.Module,
    model_input: Any,
    split: Callable[[Any, int], list],
    model_call: Callable[[nn.Module, Any], Any],
    budget: Optional[int],
    what: str,
) -> int:
    """The largest chunk (in samples) of ``model_input`` whose saved activations fit ``budget`` bytes."""
    try:
        total = batch_size_of(model_input)
    except ValueError:  # e.g. Qwen-VL pixel_values: count samples the way the split function does
        total = len(split(model_input, 1))
    rows = min(PROBE_ROWS, total)
    probe = split(model_input, rows)[0]
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    devices = input_tensors(probe)
    if budget is None:
        budget = default_budget(devices[0].device if devices else None)
    per_sample = saved_activation_bytes(inner, probe, model_call) / rows
    chunk = total if per_sample == 0 else max(1, min(total, int(budget // per_sample)))
    logger.debug(
        "GradCache auto chunk for %s: %.0f activation bytes/sample (probe of %d), budget %d bytes -> chunk %d of %d",
        what, per_sample, rows, budget, chunk, total,
    )
    return chunk
