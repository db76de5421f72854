"""What every block operation of the chunked route shares: its options (the budget, a cap on C, which passes),
the block's plan (:mod:`.plan`), and the backend that takes the blocks it hands off (:func:`fused`).

The route imports no resolver: the resolver imports it (``backend="chunked"``), and a call's options reach it as
the object the call names (``backend=ChunkedBackend(budget_mb=512)``) or the default one, bound to the call's
environment once (:meth:`ChunkedOptions.for_call`)."""

from typing import Optional

import torch

from ...contract import Block
from .plan import budget_bytes, call_budget_mb, plan_block


def _triton_reason(device: torch.device) -> Optional[str]:
    from ..triton.available import unavailable_reason

    return unavailable_reason(device)


def _triton_runs(device: torch.device) -> bool:
    """Whether the Triton kernels launch (compiled) on ``device``: CUDA, or the compile gate's stand-in target."""
    from ...kernels.env import INTERPRETED

    if INTERPRETED and device.type == "cpu":
        return False  # the interpreter: the torch passes, unless passes="triton"
    return _triton_reason(device) is None


def fused(device: torch.device):
    """The backend that takes the blocks the route hands off: the Triton kernels where they run (CUDA, or the
    compile gate's stand-in), else the torch tiles."""
    if device.type in ("cuda", "cpu") and _triton_runs(device):
        from ..triton import BACKEND as TRITON

        return TRITON
    from ..torch_tiles import BACKEND as TORCH_TILES

    return TORCH_TILES


class ChunkedOptions:
    """``budget_mb``: the most MiB the route holds at once per block, everything counted (:mod:`.plan`; None:
    INFCL_CHUNK_BUDGET_MB, else 1024, read once per call by :meth:`for_call`).
    ``chunk_rows``: an upper bound on C, which also skips the small-block hand-offs (tests, benchmarks).
    ``passes``: "triton" or "torch" (None: Triton where its kernels launch compiled, i.e. on CUDA; torch on
    CPU tensors, interpreter or not)."""

    def __init__(
        self, budget_mb: Optional[float] = None, chunk_rows: Optional[int] = None, passes: Optional[str] = None
    ):
        if budget_mb is not None:
            budget_mb = call_budget_mb(budget_mb)  # validates
        positive_int = isinstance(chunk_rows, int) and not isinstance(chunk_rows, bool) and chunk_rows >= 1
        if chunk_rows is not None and not positive_int:
            raise ValueError(f"chunk_rows must be None or a positive int, got {chunk_rows!r}")
        if passes not in (None, "triton", "torch"):
            raise ValueError(f"passes must be None, 'triton' or 'torch', got {passes!r}")
        self.budget_mb = budget_mb
        self.chunk_rows = chunk_rows
        self.passes = passes

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(budget_mb={self.budget_mb}, chunk_rows={self.chunk_rows}, passes={self.passes!r})"
        )

    def for_call(self):
        """This object with its budget fixed for one call: its own ``budget_mb``, else the environment's, read
        here once (the call's blocks share it), else the default."""
        if self.budget_mb is not None:
            return self
        return type(self)(call_budget_mb(None), self.chunk_rows, self.passes)

    def plan(self, block: Block):
        """The block's :class:`ChunkPlan`, or the :class:`HandOff` saying why the fused kernels run it."""
        triton_runs = self.passes != "torch" and _triton_runs(block.q.device)
        budget = budget_bytes(call_budget_mb(self.budget_mb) if self.budget_mb is None else self.budget_mb)
        return plan_block(block, budget, self.chunk_rows, self.passes, triton_runs)
