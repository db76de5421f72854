"""On a GPU: per-kernel times of the symmetric bf16 loss at D = 512 with sm_90's default feature chunks (128
since the chunking change, ``tiling.chunking``) against the earlier 64, in one process, so the static model's
claim (forward 28.8 -> 27.9 ms, dq 83.2 -> 80.2, dk 81.1 -> 78.3 at B = 65536 on an H100) meets a measurement.

    python tools/chunk_ab.py      # B = 32768 and 65536; a few seconds per run beside Triton's compiles

Prints one line per (chunk, B): the call's wall time by CUDA events and each kernel's by torch.profiler
(tools/gpu_check_kern.py's ``profile``), and writes them as JSON to $OUT/chunk_ab.json when OUT is set.
"""

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpu_check_kern beside this file

from gpu_check_kern import profile  # noqa: E402

from infcl.backends import triton as triton_backend  # noqa: E402
from infcl.kernels.tiling import target_tiling  # noqa: E402

DIM = 512
BATCHES = (32768, 65536)


def main():
    if not torch.cuda.is_available():
        raise SystemExit("tools/chunk_ab.py times kernels on a GPU; none is visible")
    default = target_tiling("softmax", torch.bfloat16, "ieee", DIM)
    results = []
    for chunk_d in sorted({default.chunk_d, 64}, reverse=True):
        backend = triton_backend.TritonBackend(tiling=dataclasses.replace(default, chunk_d=chunk_d))
        for batch in BATCHES:
            out = profile(batch, DIM, backend)
            results.append({"chunk_d": chunk_d, "default": chunk_d == default.chunk_d, **out})
            print(f"chunk {chunk_d}{' (default)' if chunk_d == default.chunk_d else ''}: {out}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "chunk_ab.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
