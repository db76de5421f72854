"""``chunk_sizes="auto"``: the largest chunk whose activations fit a memory budget.

Two probe chunks, of ``PROBE_ROWS`` and ``2 * PROBE_ROWS`` samples, are run forward with grad enabled
(RNG snapshot restored afterwards, no backward, so parameters and the random stream are untouched).
Every tensor autograd saves for backward is counted once per storage, except parameters and the
chunk's own inputs (a view of the batch, resident anyway): those activations are what a chunk holds
at its peak. Their difference gives the bytes per sample, which grow with the chunk, apart from the
fixed part (e.g. autocast's low-precision copies of the weights). The chunk is then
``(budget - fixed) // bytes_per_sample``, clamped to [1, batch]. The estimate ignores temporaries
freed during the forward and the gradient buffers, which is why the default CUDA budget is only a
fraction of the free memory.
"""

import logging
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .inputs import batch_size_of, input_tensors
from .rand_context import RandContext, module_devices

logger = logging.getLogger(__name__)

# Samples in the probe chunk: enough that per-sample activations dominate fixed per-call costs,
# small enough to fit wherever one training sample fits a few times over.
PROBE_ROWS = 8
# Default budget on CUDA: this fraction of the free memory at probe time (the rest covers gradients,
# optimizer temporaries and allocator fragmentation, which the saved-tensor count does not see).
CUDA_FREE_FRACTION = 0.5


def saved_activation_bytes(
    model: nn.Module,
    chunk: Any,
    model_call: Callable[[nn.Module, Any], Any],
    tensors: Callable[[Any], List[torch.Tensor]] = input_tensors,
) -> int:
    """Bytes autograd saves for backward in ``model_call(model, chunk)``, parameters and the input's
    ``tensors(chunk)`` excluded."""
    inputs = tensors(chunk)
    resident = [*model.parameters(), *inputs]
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

    with RandContext(*inputs, devices=module_devices(model)), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model_call(model, chunk)
    del out
    return total


def default_budget(device: Optional[torch.device]) -> int:
    """``CUDA_FREE_FRACTION`` of the free memory of a CUDA device; elsewhere the caller must give one."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_FRACTION)
    raise ValueError("chunk_sizes='auto' needs memory_budget=<bytes> on devices other than CUDA (no free-memory query)")


def auto_chunk_size(
    model: nn.Module,
    model_input: Any,
    split: Callable[[Any, int], list],
    model_call: Callable[[nn.Module, Any], Any],
    budget: Optional[int],
    what: str,
    tensors: Callable[[Any], List[torch.Tensor]] = input_tensors,
) -> int:
    """The largest chunk (in samples) of ``model_input`` whose saved activations fit ``budget`` bytes.

    ``split``, ``model_call`` and ``tensors`` are GradCache's hooks (``split_inputs``, ``model_call``,
    ``get_input_tensors``), so that a subclass's overrides hold for the probes too."""
    try:
        total = batch_size_of(model_input)
    except ValueError:  # e.g. Qwen-VL pixel_values: count samples the way the split function does
        total = len(split(model_input, 1))
    rows = min(PROBE_ROWS, total // 2)
    if rows == 0:
        return total
    small, large = split(model_input, rows)[0], split(model_input, 2 * rows)[0]
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if budget is None:
        devices = tensors(small)
        budget = default_budget(devices[0].device if devices else None)
    small_bytes = saved_activation_bytes(inner, small, model_call, tensors)
    per_sample = max(0, saved_activation_bytes(inner, large, model_call, tensors) - small_bytes) / rows
    fixed = max(0.0, small_bytes - per_sample * rows)
    chunk = total if per_sample == 0 else max(1, min(total, int((budget - fixed) // per_sample)))
    logger.debug(
        "GradCache auto chunk for %s: %.0f activation bytes/sample + %.0f fixed (probes of %d and %d), "
        "budget %d bytes -> chunk %d of %d",
        what,
        per_sample,
        fixed,
        rows,
        2 * rows,
        budget,
        chunk,
        total,
    )
    return chunk
