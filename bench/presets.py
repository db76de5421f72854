"""The embedded sweeps: "default" (no arguments, ~1-2 min on 2 cores), "issue" (the full CPU run) and
"gpu" (vanilla vs Inf-CL vs the Triton kernels on one GPU, with errors against float64); and "gpu-first",
not a sweep: the bounded first run on a fresh GPU (bench.gpu_first), which ``python -m bench`` hands its
other options to."""

from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

from .methods import MASK_METHODS, METHODS
from .worker import MODES

ALL_METHODS = tuple(name for name in METHODS if name not in MASK_METHODS)
TILED_METHODS = tuple(name for name, m in METHODS.items() if m.tiled)


@dataclass(frozen=True)
class Sweep:
    """Every (D, B, method, mode) combination of these lists, in one dtype and loss direction."""

    batch_sizes: Tuple[int, ...]
    dims: Tuple[int, ...]
    dtype: str = "float32"
    modes: Tuple[str, ...] = MODES
    methods: Tuple[str, ...] = ALL_METHODS
    symmetric: bool = True
    memory_only: bool = False  # one run per configuration, peak memory only, no GEMM rate
    repeats: Optional[int] = None  # None: the CLI's --repeats
    accuracy: bool = False  # also the error against a float64 truth (bench.accuracy)


ISSUE_BATCHES = (2048, 4096, 8192, 16384)
# The GPU run: vanilla (until its logits no longer fit), Inf-CL and the Triton kernels, 8k .. 256k.
GPU_BATCHES = (8192, 16384, 32768, 65536, 131072, 262144)
GPU_METHODS = ("vanilla", "inf-cl", "triton")
# The GPU run's sweep at D = 512 in bf16; the others are it at D = 1024, and in float32, up to 32k.
GPU_SWEEP = Sweep(
    batch_sizes=GPU_BATCHES,
    dims=(512,),
    dtype="bfloat16",
    modes=("forward+backward",),
    methods=GPU_METHODS,
    accuracy=True,
)

PRESETS: Dict[str, Tuple[Sweep, ...]] = {
    "default": (Sweep(batch_sizes=(1024, 2048, 4096), dims=(256,), repeats=3),),
    "issue": (
        Sweep(batch_sizes=ISSUE_BATCHES, dims=(512,), repeats=3),
        Sweep(batch_sizes=ISSUE_BATCHES, dims=(512,), dtype="bfloat16", modes=("forward+backward",), repeats=3),
        # The memory claim: vanilla would need ~80 GB here, so it is listed as skipped by its estimate.
        Sweep(batch_sizes=(65536,), dims=(256,), modes=("forward+backward",), memory_only=True),
    ),
    "gpu": (
        GPU_SWEEP,
        replace(GPU_SWEEP, batch_sizes=GPU_BATCHES[:3], dims=(1024,)),
        replace(GPU_SWEEP, batch_sizes=GPU_BATCHES[:3], dtype="float32"),
    ),
}


GPU_FIRST = "gpu-first"
MATRYOSHKA = "matryoshka"  # issue 56's fused-Matryoshka table: python -m bench.matryoshka
# Not a sweep either: the late-interaction (MaxSim) loss stage against sentence-transformers' (bench.maxsim).
LATE_INTERACTION = "late-interaction"


def custom_sweep(base: Sweep, **overrides) -> Sweep:
    """``base`` with the CLI's explicit options (those not None) replacing its fields."""
    return replace(base, **{key: value for key, value in overrides.items() if value is not None})
