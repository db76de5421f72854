"""What ``backend="auto"`` takes for a plain softmax loss on CUDA: the chunked route where a GPU measured it faster
than the fused kernels, the fused kernels everywhere else.

:data:`MEASURED` maps (GPU family, dtype name) to the smallest block rows from which the chunked route's forward +
backward beat the fused kernels' on that family (``python -m bench.gpu_ab`` measures it; a row per family and dtype
goes in by hand with the run's file named beside it). **It is empty: no GPU has run the route yet, so ``auto`` keeps
today's choice (the fused Triton kernels) everywhere.** ``backend="chunked"`` runs the route now.

The budget still decides: where the chunked route would hand the block to the fused kernels anyway (the budget
fits too few rows, :mod:`.plan`), ``auto`` takes the fused kernels directly.
"""

import os
from typing import Dict, Tuple

import torch

# (family, dtype) -> the smallest Bq from which the route was measured faster; family as infcl.kernels.target's
# ARCH_FAMILIES keys (80, 86, 90, 100, 120). Example of an entry: (90, "bfloat16"): 16384.
MEASURED: Dict[Tuple[int, str], int] = {}


def auto_backend(name: str, q: torch.Tensor, k: torch.Tensor, masked: bool) -> str:
    """``name`` (what "auto" resolved to) or "chunked" where :data:`MEASURED` says the route is faster here."""
    if name != "triton" or masked or not MEASURED or os.environ.get("INFCL_BACKEND", "").strip():
        return name
    from ...kernels.target import target_facts
    from . import BACKEND
    from .plan import MIN_CHUNK_ROWS, budget_bytes, entry_bytes, fitting_rows

    threshold = MEASURED.get((target_facts().family, str(q.dtype).replace("torch.", "")))
    if threshold is None or q.shape[0] < threshold:
        return name
    per_entry = entry_bytes(True, True, q.dtype)
    rows = fitting_rows(q.shape[0], k.shape[0], q.shape[1], budget_bytes(BACKEND.budget_mb), per_entry, 64)
    return "chunked" if rows >= MIN_CHUNK_ROWS else name
