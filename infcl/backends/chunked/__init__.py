"""``backend="chunked"``: the exact chunked route on cuBLAS (issue 45; docs/chunked.md).

The block contract (:mod:`infcl.contract`) walked in chunks of C query rows: cuBLAS writes each chunk's
float32 scores, one Triton pass reads them for the stats (forward) or writes dS in the operand dtype (backward),
and cuBLAS takes dq and dk from dS. 4 GEMM-equivalents per block against the fused kernels' 5-7, with a workspace
of about C * Bk * 6 bytes from a budget (``INFCL_CHUNK_BUDGET_MB``, default 1 GiB). The ring, labels, Bk > Bq,
the symmetric loss, ``return_stats`` and the scale gradient run unchanged through the contract.

- :mod:`.backend`: :class:`ChunkedBackend`, put together from :mod:`.softmax` (the host loop) and :mod:`.sigmoid`
  (handed to the fused kernels) on :mod:`.options` (the budget, C, the passes; the hand-offs' backend).
- :mod:`.plan`: the budget, C, and when the fused kernels run instead.
- :mod:`.products`: the three products (cuBLAS with float32 output; float32 copies on CPU).
- :mod:`.torch_passes`: the passes' math in torch (CPU tensors);
  the Triton passes: :mod:`infcl.kernels.chunked_softmax`.
- :mod:`.auto`: whether ``backend="auto"`` takes the route (the resolver's measured table,
  :data:`infcl.backends.resolve.CHUNKED_FROM`, empty until a GPU measures the route).

Runs on CUDA tensors (with Triton for the passes), and on CPU tensors with float32 products and torch passes.
The distillation loss and the ranks have no chunked route: the resolver refuses ``backend="chunked"`` for them.
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
