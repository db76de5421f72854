"""The chunked route's block steps for the softmax loss (contract: :mod:`infcl.backends.base`).

One block's forward walks its query rows in chunks of C rows (:mod:`.plan`), in order:

    raw    = q_c @ k.T                  float32 [C, Bk], cuBLAS (:mod:`.products`)
    rows_c = stats pass over raw        (max, r, positive) of each of the chunk's rows, over all Bk columns
    cols  <- lse_merge(cols, the chunk's column stats)     symmetric: in chunk order

Each row's stats are complete after its chunk; only the columns' are merged across chunks, by
:func:`infcl.lse.lse_merge` in chunk order. The backward recomputes ``raw`` by the same call, and per chunk:

    ds     = grad pass over raw         dS * factor in the operand dtype, and the scale gradient's parts
    dq_c  += ds @ k,  dk += ds.T @ q_c   cuBLAS, float32 results added to the float32 dq and dk in chunk order

GEMM-equivalents per block (2 * Bq * Bk * D flops each): forward 1, backward 3 (the scores again, dq, dk), so 4
against the fused kernels' 5 at D <= 256 and 7 at D = 512. HBM beyond the products' own operands: per S entry 4
bytes written and 4 read in the forward, 4 + 4 + 2 (the scores, dS written) and 2 x 2 (dS read by both products)
in the backward. No float atomics anywhere; every sum has a fixed order, so reruns are bit-identical.

Where the route does not fit a block it hands it to the fused kernels (:func:`infcl.backends.chunked.plan.plan_block`
says when), and the SigLIP loss always: a sigmoid pass is not worth it yet (its fused backward is already 4 GEMMs).
"""

from typing import Optional, Tuple

import torch

from ...lse import empty_stats, lse_merge
from ..base import Block, Tensor
from . import torch_passes
from .plan import ChunkPlan, HandOff, budget_bytes, plan_block
from .products import Products


def _triton_runs(device: torch.device) -> bool:
    """Whether the Triton kernels launch (compiled) on ``device``: CUDA, or the compile gate's stand-in target."""
    from ...kernels.env import INTERPRETED
    from .. import unavailable_reason

    if INTERPRETED and device.type == "cpu":
        return False  # the interpreter: the torch passes, unless passes="triton"
    return unavailable_reason("triton", device) is None


def _fused(device: torch.device):
    """The backend that takes the blocks the route hands off: the Triton kernels where they run, else the torch
    tiles."""
    from .. import block_backend, unavailable_reason

    if device.type == "cuda" and unavailable_reason("triton", device) is None:
        return block_backend("triton")
    if device.type == "cpu" and _triton_runs(device):
        return block_backend("triton")  # the compile gate
    return block_backend("torch")


class _Workspace:
    """The route's [C, Bk] buffers for one block, allocated once (flat) and viewed per chunk."""

    def __init__(self, plan: ChunkPlan, n_k: int, device: torch.device):
        self.n_k = n_k
        size = plan.rows * n_k
        self.raw = None if plan.cublas and plan.operand != torch.float32 else torch.empty(size, device=device)
        self.ds = torch.empty(size, dtype=plan.ds_dtype, device=device)
        self.scratch = [] if plan.triton_passes else [torch.empty(size, device=device) for _ in range(2)]

    def view(self, buf: Optional[Tensor], n: int) -> Optional[Tensor]:
        return None if buf is None else buf[: n * self.n_k].view(n, self.n_k)

    def scratch_views(self, n: int):
        return [self.view(b, n) for b in self.scratch]


class ChunkedBackend:
    """``budget_mb``: the workspace budget per block in MiB (None: INFCL_CHUNK_BUDGET_MB, else 1024).
    ``chunk_rows``: an upper bound on C, which also skips the small-block hand-offs (tests, benchmarks).
    ``passes``: "triton" or "torch" (None: Triton where its kernels launch compiled, i.e. on CUDA; torch on
    CPU tensors, interpreter or not)."""

    name = "chunked"

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
        """The block's :class:`ChunkPlan`, or the :class:`HandOff` saying why the fused kernels run it (warned of
        once where it is this torch's lack, not the route's choice)."""
        triton_runs = self.passes != "torch" and _triton_runs(block.q.device)
        plan = plan_block(block, budget_bytes(self.budget_mb), self.chunk_rows, self.passes, triton_runs)
        if isinstance(plan, HandOff) and plan.warn:
            from .. import _warn_once

            _warn_once(plan.reason)
        return plan

    @staticmethod
    def _passes(plan: ChunkPlan):
        if plan.triton_passes:
            from ...kernels import chunked_softmax

            return chunked_softmax
        return torch_passes

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        plan = self.plan(block)
        if isinstance(plan, HandOff):
            return _fused(block.q.device).forward_block(block, symmetric)
        passes, products = self._passes(plan), Products(block, plan)
        (n_q, _), n_k, dev = block.q.shape, block.k.shape[0], block.q.device
        work = _Workspace(plan, n_k, dev)
        rows = torch.empty(3, n_q, device=dev)
        cols = empty_stats(n_k, torch.float32, dev) if symmetric else None
        for c in plan.chunks(n_q):
            n = c.stop - c.start
            raw = products.scores(c, work.view(work.raw, n))
            extra = () if plan.triton_passes else (work.scratch_views(n),)
            part = passes.chunk_stats(raw, block.scale, block.pos[c], symmetric, rows[:, c], *extra)
            if symmetric:
                lse_merge(cols, part)
        return rows, cols

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        plan = self.plan(block)
        if isinstance(plan, HandOff):
            return _fused(block.q.device).backward_block(block, dq, dk)
        passes, products = self._passes(plan), Products(block, plan)
        n_q, n_k, dev = block.q.shape[0], block.k.shape[0], block.q.device
        symmetric = block.symmetric
        work = _Workspace(plan, n_k, dev)
        g_col_max = block.g_col.abs().max() if symmetric and plan.row_scaled else None
        dscale = torch.zeros(2, device=dev)
        for c in plan.chunks(n_q):
            n = c.stop - c.start
            raw = products.scores(c, work.view(work.raw, n))
            ds = work.view(work.ds, n)
            factor, gamma = products.row_factor(block, c, g_col_max)
            extra = () if plan.triton_passes else (work.scratch_views(n),)
            dscale += passes.chunk_grad(
                raw,
                ds,
                block.scale,
                factor,
                block.pos[c],
                block.row_stats[:, c],
                block.g_row[c],
                block.col_stats,
                block.g_col,
                plan.operand,
                *extra,
            )
            products.accumulate(ds, c, block, gamma, dq, dk)
        return dscale

    # --- the sigmoid (SigLIP) loss: handed to the fused kernels (see the module docstring) ---------------

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        return _fused(block.q.device).sigmoid_forward_block(block)

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return _fused(block.q.device).sigmoid_backward_block(block, dq, dk)

    def guide_label_scores(self, guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype) -> Tensor:
        """The guide pass of a masked loss, whose blocks the fused kernels run: their own guide arithmetic, so a
        threshold and the scores compared with it still come from one product."""
        return _fused(guide_q.device).guide_label_scores(guide_q, guide_k, pos, feature_dtype)
