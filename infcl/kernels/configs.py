"""Host-side launch settings shared by the kernels: tile configs, the feature chunking, dtype options,
the target architecture, and how a block is split into programs.

Chosen on the host and handed to the kernels as constexprs:
- ACC: the accumulation dtype (tl.float64 for float64 inputs, else tl.float32).
- PRECISION: tl.dot's input precision for float32 inputs, "tf32" or "ieee" (default: what torch's own
  float32 matmuls use, :func:`torch_matmul_precision`); always "ieee" for other dtypes and under the
  interpreter. At "tf32" the launchers round q and k to TF32 first (:func:`tf32_operands`).
- UPCAST: True only under TRITON_INTERPRET=1 for bfloat16/float16 inputs (see :func:`tiles.tile_dot`).
- BLOCK_D: the feature chunk of S, a function of D and the :class:`Tiling` only, so the forward and
  both backward kernels sum S over the same chunks (bit-identical S; see :mod:`infcl.kernels.tiles`).
"""

import copy
import functools
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

# The installed Triton's (major, minor): a few configs work around older compilers' bugs.
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
# tl.dot takes float64 operands from Triton 3.3 on; with 3.2 float64 blocks run on the torch tiles.
FLOAT64_DOT = TRITON_VERSION >= (3, 3)
# Full autotuning is opt-in: it benchmarks every config on the first call of each key (seconds).
AUTOTUNE_ENV = "INFCL_AUTOTUNE"
DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")
# tl.dot's smallest operand side (the MMA instruction shapes); tile sizes below it cannot compile.
MIN_DOT = 16


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for the interpreter now (compare :data:`INTERPRETED`)."""
    return _env_flag("TRITON_INTERPRET")


# Read once, at import: @triton.jit builds interpreted kernels only if TRITON_INTERPRET is set *when
# the decorator runs*, i.e. when the kernel modules are imported.
INTERPRETED = interpret_requested()


def autotuning() -> bool:
    """True when INFCL_AUTOTUNE=1 asks for the full search (never under the interpreter: no GPU timer)."""
    return _env_flag(AUTOTUNE_ENV) and not INTERPRETED


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
    therefore build their configs from one ScoreTile (:func:`score_tile`): their S comes from the same
    instruction in the same layout by construction, so its entries are bit-identical (see
    :mod:`infcl.kernels.tiles`); the pipeline depth, the dq / dk slice and maxnreg stay per kernel.
    """

    block_m: int
    block_n: int
    num_warps: int

    def config(self, num_stages: int = 2, block_out: int = 256, max_registers: int = 0, row_tiles: int = 1
               ) -> TileConfig:
        """A kernel's config on this S tile."""
        return TileConfig(self.block_m, self.block_n, self.num_warps, num_stages, block_out, max_registers,
                          row_tiles)


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
# (tiles.score_dot), and Triton caps a tensor at 2**20 entries: 128 x 128 x 64. Both losses' kernels
# use it when no tiling is pinned; tests pin GPU-like tilings explicitly.
_BIG = TileConfig(block_m=128, block_n=128, block_out=1024)
INTERPRETER_TILING = Tiling(forward=_BIG, dq=_BIG, dk=_BIG, resident_d=64, chunk_d=64)


def operand_class(dtype: torch.dtype, precision: Optional[str]) -> str:
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


def ragged_d(dim: Optional[int], klass: str, chunk_d: Optional[int] = None) -> bool:
    """Whether D = ``dim`` is wider than one feature chunk (``chunk_d``, else the one of ``klass``) and not a
    whole number of them: the last chunk's masked loads need registers, so such calls take the RAGGED_D
    configs (:func:`score_tile`)."""
    chunk_d = chunk_d or FEATURE_CHUNKS[klass][1]
    return dim is not None and dim > chunk_d and dim % chunk_d != 0


# The S tile of the plain softmax kernels per (architecture family, tensor-core class), for whole-chunk D
# (SCORE_TILES) and, where it differs, ragged D (RAGGED_D_SCORE_TILES). The forward, dq and dk configs are all
# built on it (softmax_forward.DEFAULT_CONFIGS, softmax_backward.DQ_CONFIGS / DK_CONFIGS and their RAGGED_D_
# tables). Chosen to compile without spills in all three kernels (tests/test_triton_api_compile.py; bench.static
# reports the figures), not timed on a GPU:
SCORE_TILES = {
    # sm_90: 64 x 64 on two warp groups, S on wgmma m64n32k16 (each group 32 columns), in every kernel, and
    # the dk product (M = 64) on wgmma too. 128 x 64 (m64n64 per group) spills the dq kernel 12-20 B at
    # every pipeline depth with bf16 or fp16 (D = 256 / 512, 128-wide slices; ptxas 13).
    **{(90, klass): ScoreTile(64, 64, 8) for klass in TENSOR_CORE_CLASSES},
    # sm_100: tcgen05 M = 64; ptxas 13 spills the 128 x 64 forward and dk.
    **{(100, klass): ScoreTile(64, 32, 8) for klass in TENSOR_CORE_CLASSES},
    # mma.sync families: 64 x 32 on 8 warps, the most the backward's 256-column slices fit beside.
    **{(arch, klass): ScoreTile(64, 32, 8) for arch in (80, 86, 120) for klass in TENSOR_CORE_CLASSES},
}
RAGGED_D_SCORE_TILES = {
    # sm_90 bf16/fp16: at ragged D the 64 x 64 dq and dk spill 64-104 B with 256-wide slices (D = 1000); 64 x 32
    # fits (128-wide slices would fit 64 x 64 at twice the S recomputations).
    (90, "mma"): ScoreTile(64, 32, 8),
}
if TRITON_VERSION < (3, 3):
    # Triton 3.2 aborts compiling a 64-row wgmma tile split over two warp groups (an LLVM assertion in the dq
    # kernel), so on sm_90 / sm_100 every S tile there keeps one warp group per 64 rows: 128 x 64 at whole-chunk
    # D, 128 x 32 at ragged D (its kernels need more registers than 3.9's; softmax_backward narrows the slices).
    SCORE_TILES.update({(arch, klass): ScoreTile(128, 64, 8) for arch in (90, 100) for klass in TENSOR_CORE_CLASSES})
    RAGGED_D_SCORE_TILES.update(
        {(arch, klass): ScoreTile(128, 32, 8) for arch in (90, 100) for klass in TENSOR_CORE_CLASSES}
    )


def score_tile(arch: int, klass: str, ragged: bool = False) -> ScoreTile:
    """The S tile of the plain softmax kernels for family ``arch`` and tensor-core class ``klass``, at a
    ragged D (:func:`ragged_d`) or not."""
    if ragged:
        return RAGGED_D_SCORE_TILES.get((arch, klass), SCORE_TILES[arch, klass])
    return SCORE_TILES[arch, klass]


def torch_matmul_precision() -> str:
    """"tf32" where torch's own float32 CUDA matmuls run in TF32, else "ieee". ``allow_tf32`` first (torch.compile
    traces it; on torch 2.9+ it reflects ``fp32_precision`` too), and where reading it raises (torch 2.9+ after
    TF32 was set through ``torch.backends.cuda.matmul.fp32_precision`` or ``torch.backends.fp32_precision``),
    ``fp32_precision``, which then says "tf32"."""
    matmul = torch.backends.cuda.matmul
    try:
        return "tf32" if matmul.allow_tf32 else "ieee"
    except RuntimeError:  # mixed legacy and new TF32 settings
        return "tf32" if matmul.fp32_precision == "tf32" else "ieee"


# TF32 keeps float32's top 19 bits (sign, 8 exponent bits, 10 mantissa bits): the low 13 go.
_TF32_DROPPED = 13


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to TF32, to nearest with ties away from zero (PTX ``cvt.rna.tf32.f32``), as
    float32 values whose low 13 bits are 0; NaN stays NaN, a value past TF32's largest rounds to inf. On the
    bits: add half of the dropped part's unit, then clear the dropped bits (sign-magnitude, so the carry
    rounds the magnitude; a mantissa carry steps the exponent, which is the correct rounding)."""
    rounded = x.view(torch.int32) + (1 << (_TF32_DROPPED - 1))
    rounded.bitwise_and_(-(1 << _TF32_DROPPED))
    return torch.where(torch.isnan(x), x, rounded.view(torch.float32))


def tf32_operands(precision: str, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``tensors`` as the products' operands at tl.dot ``precision``: at "tf32", float32 tensors rounded to
    TF32 (:func:`round_to_tf32`; O(B * D) copies), else unchanged. The tensor cores read only an operand's
    top 19 bits, i.e. truncate it: every product of two positive operands comes out low by ~2**-11 of
    itself, so a confident row's positive logit and with it the loss carry a bias (8.7e-3 of the loss on
    an H100, against torch's 6.8e-5: cuBLAS rounds). Rounded once here, the operands are exact in TF32
    and the products unbiased; dS is rounded the same way in the kernels (:func:`tiles.dot_operand`)."""
    if precision != "tf32":
        return tensors
    return tuple(round_to_tf32(t) if t.dtype == torch.float32 else t for t in tensors)


def launch_options(dtype: torch.dtype, precision: Optional[str] = None) -> dict:
    """The dtype-dependent constexprs (ACC, UPCAST, PRECISION) for inputs of ``dtype``."""
    if precision is not None and precision not in DOT_PRECISIONS:
        raise ValueError(f"precision must be None or one of {DOT_PRECISIONS}, got {precision!r}")
    if dtype == torch.float32 and not INTERPRETED:
        if precision is None:
            precision = torch_matmul_precision()
    else:
        precision = "ieee"
    return {
        "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
        "UPCAST": INTERPRETED and dtype in (torch.bfloat16, torch.float16),
        "PRECISION": precision,
    }


def branch_positives(dtype: torch.dtype, precision: Optional[str] = None) -> bool:
    """BRANCH_POSITIVES, a softmax kernel constexpr: whether the positives' work (the positive logit, dS's
    expm1) sits on a uniform branch taken only by the tiles that may hold a positive (tiles.holds_positive).
    On tensor cores from Triton 3.3; not for the FMA classes (ieee, fp64), at their register limit, nor under
    Triton 3.2, where the branch spills (12-668 B in dk); always under the interpreter, which tests it."""
    tensor_cores = operand_class(dtype, precision) in TENSOR_CORE_CLASSES
    return INTERPRETED or (tensor_cores and TRITON_VERSION >= (3, 3))


# ---- the mask options (infcl.masks) ----------------------------------------------------------------

# POSITIVES, the kernels' positives kind: one per row (``pos``; multi_positive None), or every column
# with the row's id, "mean" or "sum" (see tiles.ONE_POSITIVE).
POSITIVES = {None: 0, "mean": 1, "sum": 2}


def guide_precision(dtype: torch.dtype, precision: Optional[str], guide_float64: bool) -> str:
    """tl.dot's input precision for the guide scores G = guide_q @ guide_k.T (float32 guides, float32
    sums), next to features of ``dtype`` at ``precision``: "tf32" where the features' products run on
    tensor cores (bfloat16 / float16, or float32 at tf32), "ieee" (FMA) where they do not (float32
    "ieee", float64, the interpreter), float64 guides in float64.

    tf32 keeps 10 mantissa bits: a guide that was bfloat16 or float16 features (as a guide model's
    usually are) is multiplied exactly, its scores those of float32 products; a float32 guide's features
    are rounded to 10 bits, which moves a score by ~1e-3 of |G| and can flip only exclusions that close
    to their threshold. An FMA guide GEMM would cost ~16 times a bfloat16 one and the registers of the
    features' own tiles.
    """
    if guide_float64 or INTERPRETED or dtype == torch.float64:
        return "ieee"
    if dtype == torch.float32:
        return launch_options(dtype, precision)["PRECISION"]
    return "tf32"


@dataclass(frozen=True)
class MaskInputs:
    """One block's mask inputs for the softmax kernels (the :class:`infcl.backends.base.Block` fields of the
    same names), None where unused: ids [Bq] / [Bk] int64, guide features [Bq, D'] / [Bk, D'] in the guide's
    accumulation dtype (float32, or float64) and the thresholds [Bq] / [Bk] in that dtype."""

    q_ids: Optional[torch.Tensor] = None
    k_ids: Optional[torch.Tensor] = None
    guide_q: Optional[torch.Tensor] = None
    guide_k: Optional[torch.Tensor] = None
    row_threshold: Optional[torch.Tensor] = None
    col_threshold: Optional[torch.Tensor] = None  # symmetric only
    multi_positive: Optional[str] = None

    @property
    def masked(self) -> bool:
        return self.q_ids is not None or self.guide_q is not None

    def kernel_args(self, dtype: torch.dtype, precision: Optional[str]) -> dict:
        """The kernels' mask arguments by keyword for features of ``dtype`` at ``precision``: the pointers
        (None where absent), the guide width and strides, and the constexprs HAS_IDS, HAS_GUIDE, POSITIVES
        and the guide GEMM's BLOCK_G, EVEN_G, GUIDE_ACC and GUIDE_PRECISION. With no masks every flag is
        False and nothing is read.

        The guide GEMM (:func:`guide_precision`) runs on the tensor cores wherever the features' products
        do, and its feature chunk is its operand class's (:data:`FEATURE_CHUNKS`): a function of D' and
        the dtypes alone, so the forward and both backward kernels sum each guide score over the same
        chunks and find the same exclusions.
        """
        gq, gk = self.guide_q, self.guide_k
        has_guide = gq is not None
        dim = gq.shape[1] if has_guide else 0
        guide_float64 = has_guide and gq.dtype == torch.float64
        guide_acc = tl.float64 if guide_float64 else tl.float32
        precision = guide_precision(dtype, precision, guide_float64)
        klass = operand_class(torch.float64 if guide_float64 else torch.float32, precision)
        block_g = min(max(triton.next_power_of_2(max(dim, 1)), MIN_DOT), FEATURE_CHUNKS[klass][1])
        return dict(
            q_ids_ptr=self.q_ids, k_ids_ptr=self.k_ids, gq_ptr=gq, gk_ptr=gk, row_thr_ptr=self.row_threshold,
            col_thr_ptr=self.col_threshold, DG=dim,
            stride_gq0=gq.stride(0) if has_guide else 0, stride_gq1=gq.stride(1) if has_guide else 0,
            stride_gk0=gk.stride(0) if has_guide else 0, stride_gk1=gk.stride(1) if has_guide else 0,
            HAS_IDS=self.q_ids is not None, HAS_GUIDE=has_guide, POSITIVES=POSITIVES[self.multi_positive],
            BLOCK_G=block_g, EVEN_G=dim % block_g == 0, GUIDE_ACC=guide_acc, GUIDE_PRECISION=precision,
        )


NO_MASKS = MaskInputs()


# Every kernel launch passes these compiler options. FMA contraction stays on (it speeds up the
# elementwise math); the one product that must not be contracted, S = raw * scale, is an explicit
# mul.rn (tiles.scale_scores). Saying so explicitly also keeps Triton 3.9 from warning about its default.
# (maxnreg is per config: TileConfig.max_registers.)
COMPILE_OPTIONS = {"enable_fp_fusion": True}


# The largest block side any config uses is 2**MAX_BLOCK_LOG2 (the autotune key's divisibility range).
MAX_BLOCK_LOG2 = 8


def _twos(n: int) -> int:
    """How many times 2 divides n, capped at MAX_BLOCK_LOG2 (n % 2**j == 0 for every block 2**j up to it)."""
    return min((n & -n).bit_length() - 1, MAX_BLOCK_LOG2) if n else MAX_BLOCK_LOG2


def autotune_bucket(n_q: int, n_k: int) -> int:
    """Autotuning key: the target's architecture family (one process may drive GPUs of several), the
    power-of-two buckets of Bq and Bk (a new bucket re-tunes, a new size does not), and their
    divisibility by the block sides (which sets each config's EVEN_M / EVEN_N)."""
    buckets = 64 * max(n_q - 1, 1).bit_length() + max(n_k - 1, 1).bit_length()
    span = MAX_BLOCK_LOG2 + 1
    return ((target_family() * 4096 + buckets) * span + _twos(n_q)) * span + _twos(n_k)


# ---- the target ---------------------------------------------------------------------------------

# The architecture families with their own default configs, each named by its first member, and the
# compute capabilities they cover. Every family's configs are compiled by tests/test_triton_api_compile.py;
# a GPU outside them (sm_75, a ROCm GPU) has no compiled configs, so "auto" runs it on the torch tiles.
ARCH_FAMILIES = {
    80: ((8, 0),),  # A100: 163 KiB of shared memory per block
    86: ((8, 6), (8, 7), (8, 9)),  # consumer Ampere / Ada: 99 KiB, fewer registers per SM than sm_80
    90: ((9, 0),),  # H100 / H200: wgmma, 227 KiB
    100: ((10, 0), (10, 3)),  # B200 / B300: tcgen05, 227 KiB
    120: ((12, 0), (12, 1)),  # RTX 50xx / DGX Spark: mma.sync like sm_89, 99 KiB
}
_FAMILY_OF = {capability: family for family, caps in ARCH_FAMILIES.items() for capability in caps}


def arch_key(capability: Tuple[int, int]) -> Optional[int]:
    """The default-config family (a key of :data:`ARCH_FAMILIES`) of a CUDA compute capability, or None
    for an architecture infcl has no compiled configs for."""
    return _FAMILY_OF.get(tuple(capability))


@dataclass(frozen=True)
class TargetFacts:
    """What Triton's active driver says about the GPU it compiles for and launches on."""

    backend: str  # "cuda" or "hip" (Triton's GPUTarget.backend)
    arch: object  # the compute capability as an int (90 for sm_90), or a gfx name on ROCm
    sms: int  # streaming multiprocessors, for the split plans
    device_type: str  # the torch device type of the tensors it launches on ("cuda")

    @property
    def capability(self) -> Optional[Tuple[int, int]]:
        return divmod(self.arch, 10) if self.backend == "cuda" and isinstance(self.arch, int) else None

    @property
    def family(self) -> Optional[int]:
        return arch_key(self.capability) if self.capability is not None else None


# Under the interpreter: sm_90's configs (unused: the interpreter takes its own tiling) and one "SM".
INTERPRETER_FACTS = TargetFacts("cuda", 90, 1, "cpu")


@functools.lru_cache(maxsize=None)
def _driver_facts(active, device: int) -> TargetFacts:
    target = active.get_current_target()
    sms = active.utils.get_device_properties(device)["multiprocessor_count"]
    # Triton < 3.3's drivers do not name their torch device; those drive CUDA (or ROCm's "cuda") tensors.
    torch_device = getattr(active, "get_active_torch_device", None)
    device_type = torch_device().type if torch_device is not None else "cuda"
    return TargetFacts(target.backend, target.arch, sms, device_type)


def target_facts() -> TargetFacts:
    """The target of Triton's active driver: the device a launch compiles for (its current device).
    Raises whatever the driver raises where there is no GPU."""
    if INTERPRETED:
        return INTERPRETER_FACTS
    from triton.runtime import driver

    active = driver.active
    return _driver_facts(active, active.get_current_device())


def unsupported_reason(facts: TargetFacts) -> Optional[str]:
    """None if infcl has compiled configs for ``facts``' target, else a sentence saying why not."""
    if facts.backend != "cuda":
        return (
            f"infcl's Triton configs are compiled for NVIDIA GPUs only; Triton's target is {facts.backend} "
            f"{facts.arch}"
        )
    if facts.family is None:
        known = ", ".join(f"sm_{a}{b}" for caps in ARCH_FAMILIES.values() for a, b in caps)
        return f"infcl has no compiled Triton configs for sm_{facts.arch} (it has them for {known})"
    return None


def target_family() -> int:
    """The default-config family of the active target; a clear error (never a KeyError mid-launch)
    where there is none."""
    facts = target_facts()
    why = unsupported_reason(facts)
    if why is not None:
        raise RuntimeError(f"backend 'triton': {why}")
    return facts.family


def _as_triton(tile: TileConfig) -> triton.Config:
    # EVEN_M / EVEN_N depend on the block sizes, so they travel with the config: False (masked, right
    # for any size) in the declared space, set per call by the prune step (:func:`autotune_space`).
    return triton.Config({"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "EVEN_M": False, "EVEN_N": False},
                         **tile.launch_options())


def autotune_space(by_key: Dict[Tuple[int, str, bool], List[TileConfig]]):
    """(triton.Configs, early_config_prune) for one autotuned kernel whose search space depends on the
    architecture family, the operand class and whether D is ragged (:func:`ragged_d`: the S tile may differ):
    the union of every list, pruned at tuning time to the call's own (family, class, ragged) list, each with
    the call's EVEN_M / EVEN_N (the tuning key, :func:`autotune_bucket`, holds the sizes' divisibility, and D,
    so a cached choice fits every call of its key)."""
    configs, owners = [], []
    for key, tiles in by_key.items():
        for tile in tiles:
            configs.append(_as_triton(tile))
            owners.append(key)

    def prune(candidates, named_args, **kwargs):
        args = {**named_args, **kwargs}  # keyword launches: the arguments arrive as kwargs
        q = args["q_ptr"]
        klass = operand_class(q.dtype, args.get("PRECISION"))
        key = (target_family(), klass, ragged_d(args["D"], klass))
        out = []
        for config, owner in zip(configs, owners):
            if owner == key and any(config is c for c in candidates):
                config = copy.copy(config)
                config.kwargs = {**config.kwargs, **even_blocks(args["n_q"], args["n_k"], config.kwargs["BLOCK_M"],
                                                               config.kwargs["BLOCK_N"])}
                out.append(config)
        return out

    return configs, prune


def lazy_autotune(kernel, by_key: Dict[Tuple[int, str, bool], List[TileConfig]], key: List[str], **buffers):
    """A function returning the @triton.jit ``kernel`` autotuned over :func:`autotune_space` (``buffers``:
    restore_value / reset_to_zero), built on its first call: Triton < 3.4's autotune decorator asks the
    active GPU driver for a benchmarker when it is applied, which fails on a machine without a GPU."""

    @functools.lru_cache(maxsize=None)
    def build():
        configs, prune = autotune_space(by_key)
        prune_by = {"early_config_prune": prune}
        return triton.autotune(configs=configs, key=key, prune_configs_by=prune_by, **buffers)(kernel)

    return build


def neighbours(default: TileConfig) -> List[TileConfig]:
    """An autotune list around a default config: itself and one more pipeline stage. The S tile (BLOCK_M,
    BLOCK_N, num_warps) is never varied: the forward and the backward are tuned apart, and a different tile
    in one of them could change S's MMA instruction and so its bits (:class:`ScoreTile`)."""
    return [default, replace(default, num_stages=default.num_stages + 1)]


# ---- splitting a block into programs ------------------------------------------------------------

# Programs to aim for per SM: two resident programs hide each other's loads and tails.
PROGRAMS_PER_SM = 2
# Bounds on the per-split buffers, so extra memory stays linear in B: the forward's row partials
# are [3, splits, Bq] and the symmetric column partials [2, groups, Bk]; the backward's partial dq
# (dk) is [backward_splits, Bq (Bk), D], so it splits only a few ways.
MAX_SPLITS = 16
MAX_GROUPS = 32
MAX_BACKWARD_SPLITS = 4


@dataclass(frozen=True)
class ForwardPlan:
    groups: int  # grid axis 0: row groups (one row block each, unless symmetric)
    splits: int  # grid axis 1: contiguous shares of the k blocks


def plan_forward(n_q: int, n_k: int, tiling: Tiling, symmetric: bool, sms: int, row_tiles: int = 1) -> ForwardPlan:
    """How many programs share the forward: every unit of ``row_tiles`` row blocks its own program (one
    direction) or at most MAX_GROUPS row groups (symmetric: each group keeps its own column partials),
    times as many k splits as fit PROGRAMS_PER_SM programs per SM in one wave: rounded down, since rounding
    up adds a second wave of a few programs (32 groups on 132 SMs: 9 splits are 288 programs, 1.09 waves,
    the second nearly empty; 8 are 256, 0.97). Independent of the autotuned block sizes: a program whose
    share is empty writes the empty stats."""
    cfg = tiling.forward
    n_rb, n_cb = triton.cdiv(triton.cdiv(n_q, cfg.block_m), row_tiles), triton.cdiv(n_k, cfg.block_n)
    groups = tiling.groups or (min(n_rb, MAX_GROUPS) if symmetric else n_rb)
    splits = tiling.splits or min(max(PROGRAMS_PER_SM * sms // groups, 1), n_cb, MAX_SPLITS)
    return ForwardPlan(groups, splits)


def plan_backward_splits(n_owned: int, n_other: int, slices: int, tiling: Tiling, sms: int) -> int:
    """k (q) splits of the dq (dk) kernel: more than 1 only when the owned blocks times the D slices
    leave SMs idle."""
    if tiling.backward_splits is not None:
        return tiling.backward_splits
    programs = n_owned * slices
    return min(max(math.ceil(PROGRAMS_PER_SM * sms / programs), 1), n_other, MAX_BACKWARD_SPLITS)


# Shape flags every kernel takes as constexprs, computed by the launcher (a triton.heuristics wrapper
# is not a kernel torch.library.wrap_triton accepts): where a block cannot be ragged its loads and
# stores go unmasked.


def even_blocks(n_q: int, n_k: int, block_m: int, block_n: int) -> dict:
    """EVEN_M / EVEN_N: whether Bq (Bk) is a whole number of row (column) blocks."""
    return {"EVEN_M": n_q % block_m == 0, "EVEN_N": n_k % block_n == 0}


def feature_chunks(dim: int, block_d: int) -> dict:
    """ONE_CHUNK: D fits one feature chunk (held in registers); EVEN_D: D is a whole number of chunks."""
    return {"ONE_CHUNK": dim <= block_d, "EVEN_D": dim % block_d == 0}
