"""The A/B's settings: where it writes, its budget, and the shapes of a GPU run and of a dry run."""

from dataclasses import dataclass
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "gpu-ab"
REPO = Path(__file__).resolve().parents[2]
# The steps' wall-clock budget (``--budget-s``): the sum of the first seven steps' timeouts (:data:`.cli.STEPS`);
# the open items take what is left. bench.gpu_first's ``ab`` step passes its own, its timeout less a margin.
BUDGET_S = 190
MILLION = 1_048_576
MILLION_BUDGET_MB = 8192  # C = 960 rows at Bk = 2**20, D = 512 (bf16): 7.6 GiB of workspace on a 141 GB H200


@dataclass(frozen=True)
class Sizes:
    """The shapes of one run: the GPU's, or toy ones for --dry-run."""

    dim: int
    gemm_rows: tuple
    gemm_cols: int
    pass_rows: tuple
    speed: tuple
    check: int
    bits: int
    million: int
    repeats: int


GPU = Sizes(512, (1024, 2048, 4096, 8192), 65536, (2048, 4096), (16384, 32768, 65536), 4096, 16384, MILLION, 3)
DRY = Sizes(32, (16, 32), 256, (16,), (128, 256), 64, 96, 384, 1)


GPU = Sizes(512, (1024, 2048, 4096, 8192), 65536, (2048, 4096), (16384, 32768, 65536), 4096, 16384, MILLION, 3)
DRY = Sizes(32, (16, 32), 256, (16,), (128, 256), 64, 96, 384, 1)
