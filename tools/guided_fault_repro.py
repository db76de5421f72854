"""The guided Triton fault of the H200 run (README, "On a GPU"). Needs a CUDA GPU.

One case: ``python tools/guided_fault_repro.py kernel 1000 bfloat16`` faulted in the masked forward kernel
(under compute-sanitizer: "Out-of-range shared or local address", a hardware exception, so its PC, at
``tiles.load_tile``'s unmasked load, is imprecise: the instruction after it is the guide GEMM's first
wgmma); ``... kernel 1000 float32`` ran; ``torchscores`` in place of ``kernel`` takes the guide thresholds
from the torch tiles (it still faulted); a fourth argument casts the guide to the features' dtype.

The bisection, for the next GPU session (about a minute; each case in its own process, since a fault
kills the CUDA context; one line per case to stdout and to ``$OUT/guided_bisect.txt`` as it finishes)::

    python tools/guided_fault_repro.py bisect

What the compiled code says (sm_90, Triton 3.9, compile-only; tools/guided_compile_report.py): the forward
kernel of this case compiles to the same PTX at 31a79d0 and on main (same constexprs: 64 x 16 tile, 8 warps,
1 stage, ONE_CHUNK, BLOCK_G 32, EVEN_G), every shared-memory access and wgmma descriptor of it lies inside
its 26624-byte allocation, so the cases below separate what the kernel's code does from what runs around it.
"""

import os
import subprocess
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

# (label, scores, B, dtype, D, D', symmetric, tiling): tiling "default", "chunk32" (32-feature chunks: D = 64
# is two chunks, no resident q tile), "warps4" (the masked tile on 4 warps: one warp group per 64 rows).
CASES = [
    ("the fault", "kernel", 1000, "bfloat16", 64, 384, False, "default"),
    ("torch thresholds", "torchscores", 1000, "bfloat16", 64, 384, False, "default"),
    ("fp32 features", "kernel", 1000, "float32", 64, 384, False, "default"),
    ("D = 512", "kernel", 1000, "bfloat16", 512, 384, False, "default"),
    ("D = 128", "kernel", 1000, "bfloat16", 128, 384, False, "default"),
    ("D' = 100 (ragged guide chunks)", "kernel", 1000, "bfloat16", 64, 100, False, "default"),
    ("D' = 64", "kernel", 1000, "bfloat16", 64, 64, False, "default"),
    ("B = 4096 (every block even)", "kernel", 4096, "bfloat16", 64, 384, False, "default"),
    ("symmetric", "kernel", 1000, "bfloat16", 64, 384, True, "default"),
    ("no resident q (chunk 32)", "kernel", 1000, "bfloat16", 64, 384, False, "chunk32"),
    ("4 warps", "kernel", 1000, "bfloat16", 64, 384, False, "warps4"),
]


def _pin(tiling: str, dtype: torch.dtype, dim: int):
    """The Tiling a case pins (None: the device's defaults)."""
    from infcl.kernels.target import target_family
    from infcl.kernels.tiling import tiling_for

    if tiling == "default":
        return None
    base = tiling_for(target_family(), dtype, "ieee", dim, masked=True, guide=True)
    if tiling == "chunk32":
        base = replace(base, resident_d=32, chunk_d=32)
    else:
        base = replace(
            base,
            forward=replace(base.forward, num_warps=4),
            dq=replace(base.dq, num_warps=4),
            dk=replace(base.dk, num_warps=4),
        )
    return base


def run(
    scores: str,
    b: int,
    dtype_name: str,
    dim: int = 64,
    guide_dim: int = 384,
    symmetric: bool = False,
    tiling: str = "default",
    guide_cast: bool = False,
) -> float:
    from infcl import cal_inf_loss
    from infcl.backends import triton as triton_backend
    from infcl.backends.torch_tiles import TORCH_TILES

    class TorchScores(triton_backend.TritonBackend):
        """The Triton kernels with the guide's label scores from the torch tiles."""

        def guide_label_scores(self, *args):
            return TORCH_TILES.guide_label_scores(*args)

    dtype = getattr(torch, dtype_name)
    chosen = TorchScores if scores == "torchscores" else triton_backend.TritonBackend
    backend = chosen(tiling=_pin(tiling, dtype, dim))
    gen = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(b, dim, generator=gen), dim=1)
    k = F.normalize(q + 0.3 * torch.randn(b, dim, generator=gen), dim=1)
    gq = F.normalize(torch.randn(b, guide_dim, generator=gen), dim=1)
    gk = F.normalize(gq + torch.randn(b, guide_dim, generator=gen), dim=1)
    q, k = q.to(dtype).cuda().requires_grad_(), k.to(dtype).cuda().requires_grad_()
    gq, gk = ((g.to(dtype) if guide_cast else g).cuda() for g in (gq, gk))
    out = cal_inf_loss(q, k, None, 10.0, symmetric=symmetric, reduction="none", backend=backend, guide=(gq, gk))
    torch.cuda.synchronize()
    out.sum().backward()
    torch.cuda.synchronize()
    return float(out.sum())


def bisect() -> None:
    path = os.path.join(os.environ.get("OUT", "."), "guided_bisect.txt")
    with open(path, "w") as log:
        for label, *case in CASES:
            cmd = [sys.executable, __file__, "case", *map(str, case)]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                tail = (done.stdout + done.stderr).strip().splitlines()
                verdict = "OK" if done.returncode == 0 else "FAIL " + (tail[-1] if tail else "")
            except subprocess.TimeoutExpired:
                verdict = "TIMEOUT"
            line = f"{label:34} {' '.join(map(str, case)):44} {verdict[:160]}"
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()


if __name__ == "__main__":
    if sys.argv[1] == "bisect":
        bisect()
    elif sys.argv[1] == "case":
        scores, b, dtype_name, dim, guide_dim, symmetric, tiling = sys.argv[2:9]
        print("OK", run(scores, int(b), dtype_name, int(dim), int(guide_dim), symmetric == "True", tiling))
    else:
        print("OK", sys.argv[1:], run(sys.argv[1], int(sys.argv[2]), sys.argv[3], guide_cast=len(sys.argv) > 4))
