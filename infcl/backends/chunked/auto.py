"""Whether ``backend="auto"`` takes the chunked route for a plain softmax loss on CUDA: where a GPU measured it
faster than the fused kernels, and the budget fits it.

The table itself is the resolver's, beside ``AUTO`` (:data:`infcl.backends.resolve.CHUNKED_FROM`: (GPU family,
dtype name) -> the smallest Bq from which the route's forward + backward beat the fused kernels', per call kind):
sm_90 in bfloat16 from 16384 rows for both losses (an H100, 2026-12-06); elsewhere ``auto`` keeps the fused kernels.
``backend="chunked"`` runs the route now.

The budget still decides: where the chunked route would hand the block to the fused kernels anyway (the budget
fits too few rows, :mod:`.plan`), ``auto`` takes the fused kernels directly.
"""

from typing import Dict, Optional, Tuple

import torch

from .plan import MIN_CHUNK_ROWS, ROW_ALIGN, budget_bytes, footprint, gemm_accumulates


def measured_faster(
    q: torch.Tensor,
    k: torch.Tensor,
    table: Dict[Tuple[int, str], int],
    budget_mb: float,
    family: Optional[int] = None,
) -> bool:
    """Whether ``table`` says the route is faster for ``q`` [Bq, D] against ``k`` [Bk, D] on GPU ``family`` (None:
    the active target's, :func:`infcl.kernels.target.target_family`) and the budget (``budget_mb`` MiB, the call's:
    :func:`.plan.call_budget_mb`) fits at least :data:`.plan.MIN_CHUNK_ROWS` rows of it."""
    if family is None:
        from ...kernels.target import target_family

        family = target_family()
    threshold = table.get((family, str(q.dtype).replace("torch.", "")))
    if threshold is None or q.shape[0] < threshold:
        return False
    (n_q, dim), n_k = q.shape, k.shape[0]
    need = footprint(n_q, n_k, dim, q.dtype, True, True, gemm_accumulates(True, q.dtype, q.device))
    rows = need.fitting_rows(n_q, budget_bytes(budget_mb), ROW_ALIGN)
    return rows >= MIN_CHUNK_ROWS
