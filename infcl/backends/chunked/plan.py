"""How the chunked route runs one block, or why it hands the block to the fused kernels.

**The budget is the peak.** The budget bounds everything the route holds at once, in its larger phase (the
backward; the sigmoid loss's forward, which takes its gradient at once, holds the same):
``rows * Bk * entry + rows * D * row_bytes + Bk * D * column_bytes + fixed`` (:class:`Footprint`), where
- ``entry``: a chunk's float32 scores S (4 bytes an entry, written by the product itself: ``torch.mm(...,
  out_dtype=torch.float32, out=view)``) and its dS (the operand's bytes on a GPU); on CPU the torch passes'
  float32 dS and two float32 scratch buffers (16 in all; 8 with the Triton passes);
- ``row_bytes``, ``column_bytes``: the products' float32 results, where they cannot accumulate into dq and dk
  in the GEMM (float16's row-scaled dS, or a torch without ``addmm(..., out_dtype=)`` on the GPU:
  :func:`.products.accumulates_in_gemm`), and float16's rescaled q_c;
- ``fixed``: the float32 dq [Bq, D] and dk [Bk, D] the gradients accumulate in (held by the ring loop, counted
  here), O(Bq + Bk) vectors (stats, upstream gradients, partials), and on CPU the float32 copies of bf16 / fp16
  q and k and the torch passes' rounding of :data:`ROUND_ROWS` rows at a time.
The forward of the softmax loss holds only S (it plans with the backward's footprint: both phases need the same
chunks, so that S is the same bits). The budget is ``ChunkedBackend(budget_mb=...)``, else the environment
variable ``INFCL_CHUNK_BUDGET_MB`` (read once per call, :meth:`.options.ChunkedOptions.for_call`), else
:data:`DEFAULT_BUDGET_MB`; C is the most rows that fit, at most :data:`MAX_ROWS`, rounded down to a multiple of
:data:`ROW_ALIGN` on a GPU. Nothing here allocates Bq x Bk: the workspace is bounded by the budget and by
MAX_ROWS x Bk, whatever Bq.

**A batch of a million.** At B = 1,048,576 and D = 512 in bf16 the float32 dq and dk alone are 4 GiB, over the
default budget: such a call states its budget, e.g. :data:`MILLION_BUDGET_MB` (16 GiB: C = 1984 where the GEMMs
accumulate in place, 1664 otherwise; with the inputs and their bf16 gradients about 20 GiB of an 80 GB H100).

**Hand-offs.** The route runs the plain softmax and sigmoid losses in float32/bfloat16/float16. It hands a
block to the fused kernels (:mod:`infcl.backends.triton` on CUDA, the torch tiles elsewhere) when
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
from .probes import accumulates_in_gemm

ENV_BUDGET = "INFCL_CHUNK_BUDGET_MB"
# 1 GiB: the target for extra memory at B = 65536. Bf16 at D = 512 (the float32 dq and dk take 256 MiB of
# it) it gives C = 1984 rows at Bk = 65536 where the GEMMs accumulate in place (1664 otherwise), 4736 (4352) at
# 32768 and 8192 (the cap) at 16384.
DEFAULT_BUDGET_MB = 1024.0
# B = 1,048,576 at D = 512, bf16: 16 GiB gives C = 1984 (in-place GEMMs; 1664 otherwise). The default cannot hold
# even the float32 dq and dk (4 GiB), so such a call names its budget.
MILLION_BUDGET_MB = 16384.0
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
# Rows the CPU torch passes round to the operand dtype at a time: the rounding's temporary stays
# ROUND_ROWS * Bk operand entries (counted in the budget).
ROUND_ROWS = 64
# float32 vectors per row and per column the route holds besides its buffers (stats, upstream gradients, the
# passes' partials: at most 16 of them), counted in the budget.
VECTOR_BYTES = 16 * 4


def call_budget_mb(budget_mb: Optional[float]) -> float:
    """The budget of one call in MiB: ``budget_mb``, else INFCL_CHUNK_BUDGET_MB, else the default; validated (the
    error names where the value came from). Read once per call (:meth:`.options.ChunkedOptions.for_call`)."""
    source = "budget_mb"
    if budget_mb is None:
        env = os.environ.get(ENV_BUDGET, "").strip()
        source, budget_mb = (f"environment variable {ENV_BUDGET}", env) if env else ("default", DEFAULT_BUDGET_MB)
    if isinstance(budget_mb, bool):
        raise ValueError(f"{source} must be a number of MiB, got {budget_mb!r}")
    try:
        value = float(budget_mb)
    except (TypeError, ValueError):
        raise ValueError(f"{source} must be a number of MiB, got {budget_mb!r}") from None
    if not value > 0:
        raise ValueError(f"{source} must be a positive number of MiB, got {budget_mb!r}")
    return value


def budget_bytes(budget_mb: float) -> int:
    return int(budget_mb * 2**20)


@dataclass(frozen=True)
class Footprint:
    """The bytes the route holds at once for one block (its backward; see the module docstring):
    ``rows * n_k * entry + rows * row + fixed``."""

    n_k: int
    entry: int  # per S entry: S, dS (and on CPU the torch passes' scratch)
    row: int  # per chunk row beyond its entries: the dq product's float32 result, float16's rescaled q_c
    fixed: int  # dq and dk in float32, the dk product's result, CPU copies of q and k, the O(B) vectors

    def bytes(self, rows: int) -> int:
        return rows * self.n_k * self.entry + rows * self.row + self.fixed

    def fitting_rows(self, n_q: int, budget: int, align: int) -> int:
        """The most rows (<= n_q, a multiple of ``align`` unless all n_q) that fit ``budget``; 0 if none."""
        rows = max(budget - self.fixed, 0) // (self.n_k * self.entry + self.row)
        if rows >= n_q:
            return n_q
        return rows - rows % align


def footprint(
    n_q: int, n_k: int, dim: int, operand: torch.dtype, cublas: bool, triton_passes: bool, in_gemm: bool
) -> Footprint:
    """The route's :class:`Footprint` for a block of ``n_q`` x ``n_k`` rows of width ``dim`` (see the module
    docstring). ``in_gemm``: dq and dk accumulate inside the GEMMs (no float32 product results)."""
    element = torch.empty((), dtype=operand).element_size()
    if cublas:
        entry = 4 + element
    else:
        entry = 8 if triton_passes else 16
    row = 0 if in_gemm else dim * 4
    if operand == torch.float16:
        row += dim * (4 + element + 4)  # q_c * gamma / gamma_max: float32, rounded, and on CPU float32 again
    fixed = (n_q + n_k) * dim * 4 + (0 if in_gemm else n_k * dim * 4) + (n_q + n_k) * VECTOR_BYTES
    if not cublas and operand != torch.float32:
        fixed += (n_q + n_k) * dim * 4  # the CPU products' float32 copies of q and k
        if not triton_passes:
            fixed += ROUND_ROWS * n_k * element  # the torch passes' rounding, a few rows at a time
    return Footprint(n_k, entry, row, fixed)


@dataclass(frozen=True)
class ChunkPlan:
    """How one block runs: C rows a chunk, and where its products and passes run."""

    rows: int  # C
    cublas: bool  # products on cuBLAS with float32 output (CUDA); else float32 products of float32 copies
    triton_passes: bool  # the passes as Triton kernels (CUDA, the compile gate, or asked); else in torch
    operand: torch.dtype  # the features' dtype: dS is rounded to it for the dq / dk products
    row_scaled: bool  # float16: each dS row is divided by its largest upstream gradient (see products.py)
    in_gemm: bool  # dq and dk accumulate inside the GEMMs (beta = 1); else a float32 product and an add
    footprint: Footprint  # what the block holds at once (footprint.bytes(rows) <= the budget)

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


def gemm_accumulates(cublas: bool, operand: torch.dtype, device: torch.device) -> bool:
    """Whether dq and dk accumulate inside the GEMMs: float32 products of float32 operands always (``addmm_``),
    bf16 on cuBLAS where ``addmm(..., out_dtype=, out=acc)`` runs; float16 never (its dS rows are rescaled)."""
    if operand == torch.float16:
        return False
    if not cublas or operand == torch.float32:
        return True
    return accumulates_in_gemm(device)


def plan_block(
    block: Block,
    budget: int,
    chunk_rows: Optional[int],
    passes: Optional[str],
    triton_runs: bool,
    cuda: Optional[bool] = None,
    in_gemm: Optional[bool] = None,
) -> Union[ChunkPlan, HandOff]:
    """The block's :class:`ChunkPlan`, or the :class:`HandOff` saying why the fused kernels run it.

    ``triton_runs``: the Triton kernels launch on this device uncompiled by the interpreter (a GPU, or the
    compile gate's stand-in), so the passes run as Triton kernels unless ``passes`` says "torch". ``cuda``: whether
    the products run on cuBLAS (default: whether the features are CUDA tensors); ``in_gemm``: whether they
    accumulate inside the GEMM (default: :func:`gemm_accumulates`). The plan reads shapes and dtypes only, never
    the features' values (a plan for a million rows runs on expanded stand-ins)."""
    q, k = block.q, block.k
    if block.masked:
        return HandOff("the mask options (ids, multi_positive, guide) run on the fused kernels")
    if q.dtype == torch.float64:
        return HandOff("float64 runs on the fused kernels")
    cuda = q.device.type == "cuda" if cuda is None else cuda
    triton_passes = passes == "triton" or (passes is None and triton_runs)
    in_gemm = gemm_accumulates(cuda, q.dtype, q.device) if in_gemm is None else in_gemm
    (n_q, dim), n_k = q.shape, k.shape[0]
    need = footprint(n_q, n_k, dim, q.dtype, cuda, triton_passes, in_gemm)
    rows = min(need.fitting_rows(n_q, budget, ROW_ALIGN if cuda else 1), MAX_ROWS["cuda" if cuda else "cpu"])
    if chunk_rows is not None:
        rows = min(rows, chunk_rows)
    elif cuda and (rows < min(MIN_CHUNK_ROWS, n_q) or n_q < MIN_BLOCK_ROWS):
        rows = 0
    if rows < 1:
        return HandOff(
            f"a block of {n_q} x {n_k} rows (D = {dim}) takes the fused kernels: the chunk budget of "
            f"{budget / 2**20:.0f} MiB (ChunkedBackend(budget_mb=) or {ENV_BUDGET}) fits {max(rows, 0)} rows beside "
            f"its fixed {need.fixed / 2**20:.0f} MiB (the float32 dq and dk), or the block is small"
        )
    return ChunkPlan(rows, cuda, triton_passes, q.dtype, q.dtype == torch.float16, in_gemm, need)
