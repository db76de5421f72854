"""``backend="chunked"``: the exact chunked route on cuBLAS (issues 45, 53; docs/chunked.md).

The block contract (:mod:`infcl.contract`) walked in chunks of C query rows: cuBLAS writes each chunk's
float32 scores into the workspace, one Triton pass reads them for the stats (forward) or writes dS in the operand
dtype (backward), and cuBLAS accumulates dq and dk from dS. The softmax loss in 4 GEMM-equivalents per block
against the fused kernels' 5-7; the sigmoid loss in 3 where it is reduced (its loss and gradient in one pass).
Everything a block holds at once is bounded by the budget (``ChunkedBackend(budget_mb=...)`` from the call, else
``INFCL_CHUNK_BUDGET_MB`` read once per call, else 1 GiB). The ring, labels, Bk > Bq, the symmetric loss,
``return_stats``, the bias and the scale gradient run unchanged through the contract.

- :mod:`.backend`: :class:`ChunkedBackend`, put together from :mod:`.softmax` and :mod:`.sigmoid` (the host loops)
  on :mod:`.options` (the budget, C, the passes; the hand-offs' backend; the call's options).
- :mod:`.plan`: the budget as the peak (:class:`.plan.Footprint`), C, and when the fused kernels run instead.
- :mod:`.workspace`: the buffers of a block and phase; :mod:`.products`: the three products (cuBLAS with float32
  output, accumulating in the GEMM; float32 copies on CPU); :mod:`.probes`: which float32-output products run.
- :mod:`.torch_passes`: the passes' math in torch (CPU tensors); the Triton passes:
  :mod:`infcl.kernels.chunked_softmax`, :mod:`infcl.kernels.chunked_sigmoid`.
- :mod:`.auto`: whether ``backend="auto"`` takes the route (the resolver's measured table,
  :data:`infcl.backends.resolve.CHUNKED_FROM`: sm_90, bfloat16, from 16384 rows, as an H100 measured it).

Runs on CUDA tensors (with Triton for the passes), and on CPU tensors with float32 products and torch passes.
The distillation loss and the ranks have no chunked route: the resolver refuses ``backend="chunked"`` for them.
This package imports no resolver (the resolver imports it).
"""

from typing import Optional

import torch

from .auto import measured_faster
from .backend import BACKEND, ChunkedBackend


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the chunked route can run on ``device``, else why not: CPU always (torch passes), CUDA where the
    Triton kernels run (its passes, and the fused kernels it hands blocks to)."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        from ..triton.available import unavailable_reason as triton_reason

        why = triton_reason(device)
        return None if why is None else f"backend 'chunked' needs the Triton kernels on CUDA: {why}"
    return f"backend 'chunked' runs on CUDA tensors (and CPU tensors, for tests), not on {device.type}"


__all__ = ["BACKEND", "ChunkedBackend", "measured_faster", "unavailable_reason"]
