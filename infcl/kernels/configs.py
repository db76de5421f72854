"""The kernels' tile configs (:class:`TileConfig`, :class:`ScoreTile`, :class:`Tiling`), the operand classes and
their feature chunking, and whether the installed Triton's tl.dot takes float64. Beside it, one concern each:
:mod:`.tiling` (which tile each kernel takes on each GPU),
:mod:`.kernel_args` (dtype options, mask arguments, shape flags), :mod:`.target` (the GPU),
:mod:`.autotune` and :mod:`.split_plan`; :mod:`.env` holds the environment flags.

Chosen on the host and handed to the kernels as constexprs:
- ACC: the accumulation dtype (tl.float64 for float64 inputs, else tl.float32).
- PRECISION: tl.dot's input precision for float32 inputs, "tf32" or "ieee" (default: what torch's own
  float32 matmuls use, :func:`torch_matmul_precision`); always "ieee" for other dtypes and under the
  interpreter. At "tf32" the launchers round q and k to TF32 first (:func:`tf32_operands`).
- UPCAST: True only under TRITON_INTERPRET=1 for bfloat16/float16 inputs (see :func:`score_tiles.tile_dot`).
- BLOCK_D: the feature chunk of S, a function of D and the :class:`Tiling` only, so the forward and
  both backward kernels sum S over the same chunks (bit-identical S; see :mod:`infcl.kernels.score_tiles`).
"""

from dataclasses import dataclass, fields, replace
from typing import List, Optional

import torch
import triton

from ..versions import release
from .env import INTERPRETED, env_flag

# tl.dot takes float64 operands from Triton 3.5 on; with 3.4 (the floor, infcl/versions.py) float64 blocks run on
# the torch tiles (infcl/backends/triton/options.py, the one rule).
FLOAT64_DOT = release(triton.__version__) >= (3, 5)

# Full autotuning is opt-in: it benchmarks every config on the first call of each key (seconds).
AUTOTUNE_ENV = "INFCL_AUTOTUNE"
DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")
# tl.dot's smallest operand side (the MMA instruction shapes); tile sizes below it cannot compile.
MIN_DOT = 16


def autotuning() -> bool:
    """True when INFCL_AUTOTUNE=1 asks for the full search (never under the interpreter: no GPU timer)."""
    return env_flag(AUTOTUNE_ENV) and not INTERPRETED


def _power_of_two(name: str, value: int, least: int = MIN_DOT) -> None:
    if value < least or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value}")


@dataclass(frozen=True)
class TileConfig:
    """One kernel's block sizes and launch parameters.

    ``block_out`` (backward kernels only): the widest slice of dq (dk) columns a program accumulates in
    registers; a wider D runs ceil(D / block_out) slices, each recomputing S. ``max_registers``: passed
    as Triton's ``maxnreg`` (0: unset). Where set to 255 it stops ptxas from spilling a few bytes to fit
    more blocks on an SM. ``row_tiles`` (the forward only; 1 or 2): row blocks the plain symmetric forward
    walks at once, each its own S tile, their column stats reduced and merged into the partials once.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    block_out: int = 256
    max_registers: int = 0
    row_tiles: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_out"):
            _power_of_two(f"TileConfig.{name}", getattr(self, name))
        if self.row_tiles not in (1, 2):
            raise ValueError(f"TileConfig.row_tiles must be 1 or 2, got {self.row_tiles}")

    def launch_options(self) -> dict:
        """num_warps, num_stages (and maxnreg) for a kernel launch."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return {**opts, "maxnreg": self.max_registers} if self.max_registers else opts

    def as_triton(self) -> triton.Config:
        return triton.Config({"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}, **self.launch_options())

    @property
    def score_tile(self) -> "ScoreTile":
        """The shape of the S tile this config builds (what sets S's MMA instruction and layout)."""
        return ScoreTile(self.block_m, self.block_n, self.num_warps)


@dataclass(frozen=True)
class ScoreTile:
    """The S tile of the softmax kernels: BLOCK_M q rows x BLOCK_N k rows on ``num_warps`` warps.

    Triton picks the MMA instruction and the layout of ``tl.dot`` from these three (and the operand dtype):
    on sm_90, wgmma m64nNk16 with N = BLOCK_N, or BLOCK_N / 2 when 64 rows are split over two warp groups;
    tcgen05 with M = BLOCK_M on sm_100; mma.sync elsewhere. On tensor cores the forward, dq and dk kernels
    therefore build their configs from one ScoreTile (:func:`infcl.kernels.tiling.score_tile`): their S comes
    from the same instruction in the same layout by construction, so its entries are bit-identical (see
    :mod:`infcl.kernels.score_tiles`); the pipeline depth, the dq / dk slice and maxnreg stay per kernel.
    """

    block_m: int
    block_n: int
    num_warps: int

    def config(
        self, num_stages: int = 2, block_out: int = 256, max_registers: int = 0, row_tiles: int = 1
    ) -> TileConfig:
        """A kernel's config on this S tile."""
        return TileConfig(self.block_m, self.block_n, self.num_warps, num_stages, block_out, max_registers, row_tiles)


@dataclass(frozen=True)
class Tiling:
    """Everything that shapes one call's tiles: the three kernels' configs, the feature chunking (shared,
    for bit-identical S), and how many programs share a block (None: planned from the device)."""

    forward: TileConfig
    dq: TileConfig
    dk: TileConfig
    # D (rounded up to a power of two) up to this is one feature chunk: q (k) is loaded once per
    # program and held in registers; a larger D is summed in chunks of ``chunk_d``.
    resident_d: int = 128
    chunk_d: int = 64
    groups: Optional[int] = None  # symmetric forward: row groups, each with its own column partials
    splits: Optional[int] = None  # forward: k splits per row block, merged with lse_merge
    backward_splits: Optional[int] = None  # backward: k (q) splits per dq (dk) block, summed

    def __post_init__(self):
        _power_of_two("Tiling.resident_d", self.resident_d)
        _power_of_two("Tiling.chunk_d", self.chunk_d)
        for name in ("groups", "splits", "backward_splits"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"Tiling.{name} must be None or >= 1, got {value}")

    def block_d(self, dim: int) -> int:
        """The feature chunk of S for D = ``dim`` (the same in all three kernels)."""
        whole = max(triton.next_power_of_2(dim), MIN_DOT)
        return whole if whole <= self.resident_d else self.chunk_d

    def block_out(self, config: TileConfig, dim: int) -> int:
        """Columns of dq (dk) one backward program accumulates: the whole D in one slice where it fits,
        and exactly the resident chunk when D is one chunk (so the k tile of S is reused for dq)."""
        whole = max(triton.next_power_of_2(dim), MIN_DOT)
        return whole if whole <= self.resident_d else min(whole, config.block_out)

    # The custom ops take the tiling as a list of ints (their schema has no dataclasses).
    def to_ints(self) -> List[int]:
        out = []
        for config in (self.forward, self.dq, self.dk):
            out += [getattr(config, f.name) for f in fields(TileConfig)]
        out += [self.resident_d, self.chunk_d]
        return out + [-1 if v is None else v for v in (self.groups, self.splits, self.backward_splits)]

    @classmethod
    def from_ints(cls, values: List[int]) -> "Tiling":
        n = len(fields(TileConfig))
        configs = [TileConfig(*values[i * n : (i + 1) * n]) for i in range(3)]
        rest = list(values[3 * n :])
        groups, splits, bsplits = (None if v < 0 else v for v in rest[2:5])
        return cls(*configs, resident_d=rest[0], chunk_d=rest[1], groups=groups, splits=splits, backward_splits=bsplits)

    def with_splits(self, groups=None, splits=None, backward_splits=None) -> "Tiling":
        return replace(self, groups=groups, splits=splits, backward_splits=backward_splits)


# Under the interpreter a kernel costs ~1 ms of Python per tile operation whatever the tile's size,
# while the flops are numpy's: few big tiles run fastest (B=1000, D=1000 takes minutes with a GPU's
# 64-wide tiles, seconds with these). The interpreter's S product materializes [BLOCK_M, BLOCK_N, chunk]
# (score_tiles.score_dot), and Triton caps a tensor at 2**20 entries: 128 x 128 x 64. Both losses' kernels
# use it when no tiling is pinned; tests pin GPU-like tilings explicitly.
_BIG = TileConfig(block_m=128, block_n=128, block_out=1024)
INTERPRETER_TILING = Tiling(forward=_BIG, dq=_BIG, dk=_BIG, resident_d=64, chunk_d=64)


def operand_class_of(dtype: torch.dtype, precision: Optional[str]) -> str:
    """What the products run on, which sets the tile sizes: "mma" (bf16/fp16 tensor cores), "tf32"
    (fp32 tensor cores: twice the bytes per operand), "ieee" (fp32 FMA: operands live in registers)
    or "fp64"."""
    if dtype == torch.float64:
        return "fp64"
    if dtype == torch.float32:
        return "ieee" if precision == "ieee" or INTERPRETED else "tf32"
    return "mma"


# The feature chunking per operand class, (resident_d, chunk_d) of :class:`Tiling`: 128 bf16/fp16
# columns are the fused-attention head size; tf32 operands take twice the bytes; FMA products (fp32
# "ieee" and fp64) hold their operand fragments in registers, fully unrolled over the chunk: 16.
FEATURE_CHUNKS = {"mma": (128, 64), "tf32": (64, 32), "ieee": (16, 16), "fp64": (16, 16)}
# The operand classes whose products run on tensor cores, where S's bits depend on the MMA instruction.
TENSOR_CORE_CLASSES = ("mma", "tf32")


def ragged_d(dim: Optional[int], operand_class: str, chunk_d: Optional[int] = None) -> bool:
    """Whether D = ``dim`` is wider than one feature chunk (``chunk_d``, else the one of ``operand_class``) and not a
    whole number of them: the last chunk's masked loads need registers, so such calls take the RAGGED_D
    configs (:mod:`infcl.kernels.tiling`)."""
    chunk_d = chunk_d or FEATURE_CHUNKS[operand_class][1]
    return dim is not None and dim > chunk_d and dim % chunk_d != 0
