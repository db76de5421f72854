"""How the chunked route runs one block, or why it hands the block to the fused kernels.

**The memory budget.** The route's workspace per block is ``C * Bk * entry_bytes + (C + Bk) * D * 4`` bytes:
the float32 scores of a chunk (4 bytes an entry), its dS (the operand's 2 bytes on a GPU), and the float32
results of the two backward products (C x D for dq, Bk x D for dk). ``entry_bytes`` is 6 for bf16/fp16 on a GPU
(8 for float32); the CPU route holds its dS in float32 and its torch passes two more float32 buffers (16). The
budget is ``ChunkedBackend(budget_mb=...)``, else the environment variable ``INFCL_CHUNK_BUDGET_MB``, else
:data:`DEFAULT_BUDGET_MB`; C is the most rows that fit, at most :data:`MAX_ROWS`, rounded down to a multiple of
:data:`ROW_ALIGN` on a GPU. Nothing here allocates Bq x Bk: the workspace is bounded by the budget and by
MAX_ROWS x Bk, whatever Bq.

**Hand-offs.** The route runs the plain softmax loss in float32/bfloat16/float16. It hands a block to the fused
kernels (:mod:`infcl.backends.triton` on CUDA, the torch tiles elsewhere) when
- the block has mask options (ids, ``multi_positive``, a guide): not worth a chunked pass yet;
- the features are float64 (no cuBLAS out_dtype case, and no speed to win);
- the budget fits no row, or (on a GPU) fewer than :data:`MIN_CHUNK_ROWS` rows, or the block has fewer than
  :data:`MIN_BLOCK_ROWS` rows (GPU): below that the fused kernels' launch count and time are the smaller.
An explicit ``chunk_rows`` skips the two size thresholds (tests, the A/B) but never the budget.
"""

import os
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional, Union

import torch

from ...contract import Block

ENV_BUDGET = "INFCL_CHUNK_BUDGET_MB"
# 1 GiB: the target for extra memory at B = 65536. Bf16 at D = 512 it gives C = 2368 rows at
# Bk = 65536, 5056 at 32768 and 8192 (the cap) at 16384.
DEFAULT_BUDGET_MB = 1024.0
# cuBLAS rates hold for M a multiple of 64 (its tiles' row counts); chunk starts stay 128-byte aligned for D >= 32.
ROW_ALIGN = 64
# Below 256 rows the products are too thin for cuBLAS's full rate and the launches per row too many (GPU).
MIN_CHUNK_ROWS = 256
# The most rows a chunk takes: 8192 on a GPU (the largest C the A/B measures; beyond it the products' rate is flat
# and the workspace only grows); 128 on CPU (tests: 16 bytes an entry, so 16 MiB at Bk = 8192, near the torch tiles').
MAX_ROWS = {"cuda": 8192, "cpu": 128}
# Blocks of fewer rows run the fused kernels on a GPU (issue 45's smallest target is B = 16384; below a few
# thousand rows the fused kernels' one launch per phase beats the route's five per chunk).
MIN_BLOCK_ROWS = 4096


def budget_bytes(budget_mb: Optional[float]) -> int:
    """The workspace budget in bytes: ``budget_mb``, else INFCL_CHUNK_BUDGET_MB, else the default."""
    source = "budget_mb"
    if budget_mb is None:
        env = os.environ.get(ENV_BUDGET, "").strip()
        source, budget_mb = (f"environment variable {ENV_BUDGET}", env) if env else ("default", DEFAULT_BUDGET_MB)
    try:
        value = float(budget_mb)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a number of MiB, got {budget_mb!r}") from None
    if not value > 0:
        raise ValueError(f"{source} must be a positive number of MiB, got {budget_mb!r}")
    return int(value * 2**20)


@dataclass(frozen=True)
class ChunkPlan:
    """How one block runs: C rows a chunk, and where its products and passes run."""

    rows: int  # C
    cublas: bool  # products on cuBLAS with float32 output (CUDA); else float32 products of float32 copies
    triton_passes: bool  # the passes as Triton kernels (CUDA, the compile gate, or asked); else in torch
    operand: torch.dtype  # the features' dtype: dS is rounded to it for the dq / dk products
    row_scaled: bool  # float16: each dS row is divided by its largest upstream gradient (see softmax.py)

    @property
    def ds_dtype(self) -> torch.dtype:
        """dS's storage: the operand on cuBLAS; float32 (holding the operand's values) for the CPU products."""
        return self.operand if self.cublas else torch.float32

    def chunks(self, n: int) -> Iterator[slice]:
        """The row slices of a block of ``n`` rows, in order (the last may be shorter)."""
        return (slice(i, min(i + self.rows, n)) for i in range(0, n, self.rows))


class HandOff(NamedTuple):
    """Why a block runs on the fused kernels."""

    reason: str


def entry_bytes(cublas: bool, triton_passes: bool, operand: torch.dtype) -> int:
    """Workspace bytes per entry of a chunk's scores (see the module docstring)."""
    ds = torch.empty((), dtype=operand).element_size() if cublas else 4
    return 4 + ds + (0 if triton_passes else 8)


def workspace_bytes(rows: int, n_k: int, dim: int, per_entry: int) -> int:
    return rows * n_k * per_entry + (rows + n_k) * dim * 4


def fitting_rows(n_q: int, n_k: int, dim: int, budget: int, per_entry: int, align: int) -> int:
    """The most rows (<= n_q, a multiple of ``align`` unless all n_q) whose workspace fits ``budget``; 0 if none."""
    free = budget - n_k * dim * 4
    rows = max(free, 0) // (n_k * per_entry + dim * 4)
    if rows >= n_q:
        return n_q
    return rows - rows % align


def plan_block(
    block: Block,
    budget: int,
    chunk_rows: Optional[int],
    passes: Optional[str],
    triton_runs: bool,
    cuda: Optional[bool] = None,
) -> Union[ChunkPlan, HandOff]:
    """The block's :class:`ChunkPlan`, or the :class:`HandOff` saying why the fused kernels run it.

    ``triton_runs``: the Triton kernels launch on this device uncompiled by the interpreter (a GPU, or the
    compile gate's stand-in), so the passes run as Triton kernels unless ``passes`` says "torch". ``cuda``: whether
    the products run on cuBLAS (default: whether the features are CUDA tensors)."""
    q, k = block.q, block.k
    if block.masked:
        return HandOff("the mask options (ids, multi_positive, guide) run on the fused kernels")
    if q.dtype == torch.float64:
        return HandOff("float64 runs on the fused kernels")
    cuda = q.device.type == "cuda" if cuda is None else cuda
    triton_passes = passes == "triton" or (passes is None and triton_runs)
    per_entry = entry_bytes(cuda, triton_passes, q.dtype)
    (n_q, dim), n_k = q.shape, k.shape[0]
    rows = min(
        fitting_rows(n_q, n_k, dim, budget, per_entry, ROW_ALIGN if cuda else 1), MAX_ROWS["cuda" if cuda else "cpu"]
    )
    if chunk_rows is not None:
        rows = min(rows, chunk_rows)
    elif cuda and (rows < min(MIN_CHUNK_ROWS, n_q) or n_q < MIN_BLOCK_ROWS):
        rows = 0
    if rows < 1:
        return HandOff(
            f"a block of {n_q} x {n_k} rows (D = {dim}) takes the fused kernels: the chunk budget of "
            f"{budget / 2**20:.0f} MiB ({ENV_BUDGET}) fits {max(rows, 0)} rows, or the block is small"
        )
    return ChunkPlan(rows, cuda, triton_passes, q.dtype, q.dtype == torch.float16)
