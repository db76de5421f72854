"""``python -m bench.gpu_ab``: issue 45's bounded A/B of the chunked route (``backend="chunked"``) on the next GPU.

The ``ab`` step of ``python -m bench --preset gpu-first`` runs it (into ``<out>/ab``, within that step's timeout),
so the one bounded GPU command takes it. Bounded by ``--budget-s`` (default 190 s: the first seven steps'
timeouts add up to it, and the open items take what those leave): each step runs in its own process with its own
timeout (a crash, hang or out-of-memory is recorded and the next step runs) and appends every result to
``ab.csv`` as soon as it has it (step, case, metric, value, unit, note), so a run cut off from outside still
leaves its data; ``steps.csv`` says how each step ended and ``logs.txt`` holds their output. Steps, in order:

1. ``env``: torch / Triton / CUDA versions, the device; whether ``torch.mm`` / ``torch.addmm`` with
   ``out_dtype=torch.float32`` run for bf16 operands (allocating, and into ``out=``).
2. ``gemm``: cuBLAS rates of the route's three products (scores q_c @ k.T, dq's dS @ k, dk's dS.T @ q_c, all with
   float32 results) for C in {1024, 2048, 4096, 8192} at Bk = 65536, D = 512, bf16; and the plain bf16 GEMM's.
3. ``passes``: GB/s of the stats and grad passes (infcl/kernels/chunked_softmax.py) against a plain copy.
4. ``speed``: bf16, D = 512, symmetric forward + backward at B = 16k / 32k / 64k: chunked, fused (``"triton"``),
   vanilla where its logits fit, Inf-CL where it imports: median time (CUDA events), first call, peak memory.
5. ``errors``: against float64 (the torch tiles in float64) at B = 4096, D = 512: bf16 / fp16 / fp32 at TF32,
   symmetric and with labels, ids + guide and SigLIP (both handed to the fused kernels): max errors of loss, dq,
   dk, dscale for chunked, fused and vanilla in that dtype; reruns bit-identical.
6. ``bits``: each chunk's scores computed by the forward's call and again after other products (the backward's
   recomputation) compared bit for bit; a whole forward + backward rerun compared bit for bit, B = 16384.
7. ``million``: one batch of B = 1,048,576, D = 512, bf16, symmetric forward + backward with the chunked route
   (INFCL_CHUNK_BUDGET_MB=8192): time and peak memory.
8. ``open-items``: ``python tools/guided_fault_repro.py bisect`` and the Triton rank / distillation / guide-tie
   tests on the GPU (pytest), their output in logs.txt.

``--dry-run`` runs every step's control flow on CPU tensors at toy sizes (the torch passes for the Triton ones,
the torch tiles for the fused kernels; the commands of step 8 listed, not run): tests/test_chunked_bench.py.

The package, by concern: :mod:`.plan` (the run's sizes and settings), :mod:`.rows` (ab.csv), :mod:`.timing`
(CUDA-event timing, the float32-output products, peak memory), one module per measurement (:mod:`.env`,
:mod:`.products`: the products and the passes, :mod:`.speed`: end to end and the million, :mod:`.errors`: the
errors and the bits, :mod:`.open_items`) and :mod:`.cli` (the steps, their processes and timeouts).
"""

from .cli import STEPS, main, run_all, run_step
from .errors import cases, step_bits, step_errors
from .plan import BUDGET_S, DEFAULT_OUT, DRY, GPU, MILLION, Sizes
from .rows import FIELDS, Rows

__all__ = [
    "BUDGET_S",
    "DEFAULT_OUT",
    "DRY",
    "FIELDS",
    "GPU",
    "MILLION",
    "STEPS",
    "Rows",
    "Sizes",
    "cases",
    "main",
    "run_all",
    "run_step",
    "step_bits",
    "step_errors",
]
