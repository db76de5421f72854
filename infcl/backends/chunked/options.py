"""What every block operation of the chunked route shares: its options (the workspace budget, a cap on C, which
passes), the block's plan (:mod:`.plan`), and the backend that takes the blocks it hands off (:func:`fused`)."""

from typing import Optional

import torch

from ...contract import Block
from ..resolve import backend_object, unavailable_reason
from .plan import budget_bytes, plan_block


def _triton_runs(device: torch.device) -> bool:
    """Whether the Triton kernels launch (compiled) on ``device``: CUDA, or the compile gate's stand-in target."""
    from ...kernels.env import INTERPRETED

    if INTERPRETED and device.type == "cpu":
        return False  # the interpreter: the torch passes, unless passes="triton"
    return unavailable_reason("triton", device) is None


def fused(device: torch.device):
    """The backend that takes the blocks the route hands off: the Triton kernels where they run, else the torch
    tiles."""
    if device.type == "cuda" and unavailable_reason("triton", device) is None:
        return backend_object("triton")
    if device.type == "cpu" and _triton_runs(device):
        return backend_object("triton")  # the compile gate
    return backend_object("torch")


class ChunkedOptions:
    """``budget_mb``: the workspace budget per block in MiB (None: INFCL_CHUNK_BUDGET_MB, else 1024).
    ``chunk_rows``: an upper bound on C, which also skips the small-block hand-offs (tests, benchmarks).
    ``passes``: "triton" or "torch" (None: Triton where its kernels launch compiled, i.e. on CUDA; torch on
    CPU tensors, interpreter or not)."""

    def __init__(
        self, budget_mb: Optional[float] = None, chunk_rows: Optional[int] = None, passes: Optional[str] = None
    ):
        if budget_mb is not None:
            budget_bytes(budget_mb)  # validates
        positive_int = isinstance(chunk_rows, int) and not isinstance(chunk_rows, bool) and chunk_rows >= 1
        if chunk_rows is not None and not positive_int:
            raise ValueError(f"chunk_rows must be None or a positive int, got {chunk_rows!r}")
        if passes not in (None, "triton", "torch"):
            raise ValueError(f"passes must be None, 'triton' or 'torch', got {passes!r}")
        self.budget_mb = budget_mb
        self.chunk_rows = chunk_rows
        self.passes = passes

    def plan(self, block: Block):
        """The block's :class:`ChunkPlan`, or the :class:`HandOff` saying why the fused kernels run it."""
        triton_runs = self.passes != "torch" and _triton_runs(block.q.device)
        return plan_block(block, budget_bytes(self.budget_mb), self.chunk_rows, self.passes, triton_runs)
