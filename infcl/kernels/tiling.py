"""Which tile, for which kernel, on which GPU: the one tiling module of every Triton kernel family (softmax,
sigmoid, the retrieval ranks and the distillation loss, the top-k search).

One function per architecture family, as flash-attention's ``hopper/tile_size.h``: :func:`sm90`, :func:`sm100`,
:func:`sm80`, :func:`sm86` (sm_86 / sm_89) and :func:`sm120` each answer, for one :class:`Kernel` on tensor cores,
which :class:`TileConfig` it takes. "Which tile does dq take on sm_90 in bf16 at D = 512?" is
``sm90(Kernel("softmax", "dq", "mma"))``: read :func:`sm90`. The FMA classes (fp32 "ieee", fp64) take the same
configs on every family (:func:`fma`), and the sigmoid and MaxSim kernels one config per operand class on every
family (their tables, :data:`ONE_TABLE`); :func:`config` picks among them. Every branch says why. Not tuned on a
GPU: each config is the one that compiles without spills and within shared memory on its family
(tests/test_triton_api_compile.py; ``python -m bench.static`` reports the figures).

A :class:`Kernel`: ``family`` "softmax" (the forward, dq and dk kernels: ``phase``), "sigmoid" (one config for
its forward and both backward passes), "rank" (the ranks' and the distillation loss's kernels: one S tile for
every kernel, so S is the same bits in each) or "topk" (the top-k search's one kernel: an S tile and the rows'
lists beside it); ``operand_class``, :func:`configs.operand_class_of` ("mma":
bf16/fp16 tensor cores, "tf32", "ieee": fp32 FMA, "fp64"); ``ragged``, D wider than one feature chunk and not a
whole number of them (:func:`configs.ragged_d`: the last chunk's masked loads need registers); ``masks``, None
for the plain softmax loss, "ids" (ids without a guide) or "guide" (a guide, with or without ids).

On tensor cores every plain softmax config of a family is built on its S tile (:func:`score_tile`, the forward
config's), so the three kernels compute S with the same MMA instruction and layout (tests/test_static_report.py
checks it in the compiled code). ``block_out`` (dq / dk): the slice of the gradient a program holds in
registers, BLOCK_M (BLOCK_N) rows x block_out fp32 columns: 64 x 256 over 8 warps is 64 registers a thread, the
most that leaves room for the S and dS tiles without spilling.

The per-call answers: :func:`tiling_for` (softmax: the three configs and the feature chunking, :func:`chunking`),
:func:`sigmoid_tiling`, :func:`rank_tiling`, :func:`topk_tiling`, and :func:`target_tiling` for the active target
(the interpreter's tiles under TRITON_INTERPRET=1). :func:`forward_config`, :func:`dq_config` and
:func:`dk_config` are the softmax kernels' entry points (the autotuner's search spaces start from them). The
chunked route's passes (:mod:`.chunked_softmax`) stream float32 scores without a product: one config on every
family (:data:`CHUNK_STATS_TILE`, :data:`CHUNK_GRAD_TILE`).
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch

from .configs import (
    FEATURE_CHUNKS,
    INTERPRETER_TILING,
    TENSOR_CORE_CLASSES,
    ScoreTile,
    TileConfig,
    Tiling,
    operand_class_of,
    ragged_d,
)
from .env import INTERPRETED
from .target import target_family

# FMA products (fp32 "ieee", fp64) hold their operand fragments in registers: maxnreg 255 everywhere, so
# ptxas does not spill to fit more blocks per SM. Each entry is a sum in K order whatever the tile, so their
# tiles need not match between kernels.
FMA_REGISTERS = 255
# With mask options, tensor cores take 64-row tiles (as the backward's: the same MMA instruction) of 16
# columns, maxnreg 255 (ptxas otherwise caps the masked kernels at 128 registers on sm_86 and spills).
MASKED_ROWS, MASKED_COLS = 64, 16

# The sigmoid kernels' tilings per operand class, the same on every family.
# The backward holds a [BLOCK_M, chunk] gradient tile, the logit tile and an operand chunk in registers:
# bf16/fp16 and tf32 take 64-row tiles on 8 warps over 32-feature chunks (a 64-wide resident chunk spills on
# sm_80/86/120; tf32, twice the bytes per operand, takes 32 columns); the FMA classes hold operand fragments in
# registers, so small tiles over 16-feature chunks with maxnreg 255, as the softmax kernels (ptxas 12
# otherwise caps them at 128 registers on sm_80 and spills).
SIGMOID_TILINGS = {
    # maxnreg 255: ptxas 12 caps the backward at 128 registers on sm_80/86 and spills 12 B at D = 512 on
    # block-multiple batches; uncapped it takes 154, no spill (sm_90 unchanged).
    "mma": Tiling(
        *(TileConfig(block_m=64, block_n=64, num_warps=8, max_registers=255),) * 3, resident_d=32, chunk_d=32
    ),
    # maxnreg 255 too: since the S product is no longer peeled (one S-tile builder), ptxas 12 capped tf32's
    # backward at 80 registers on sm_80/86 and spilled 32 B at D = 512 on block-multiple batches.
    "tf32": Tiling(
        *(TileConfig(block_m=64, block_n=32, num_warps=8, max_registers=255),) * 3, resident_d=32, chunk_d=32
    ),
    "ieee": Tiling(*(TileConfig(block_m=32, block_n=32, max_registers=255),) * 3, resident_d=16, chunk_d=16),
    "fp64": Tiling(*(TileConfig(block_m=32, block_n=16, max_registers=255),) * 3, resident_d=16, chunk_d=16),
}
# The rank and distillation kernels' tilings per operand class: the sigmoid kernels' sizes, which hold the same
# registers (an S tile, an operand chunk, a gradient slice), and 32-wide gradient slices (64 on bf16/fp16).
RANK_TILINGS = {
    "mma": Tiling(*(TileConfig(64, 64, num_warps=8, block_out=64, max_registers=255),) * 3, resident_d=32, chunk_d=32),
    # maxnreg 255: ptxas caps the rank kernels at 128 registers on sm_80 and spills 36 B.
    "tf32": Tiling(*(TileConfig(64, 32, num_warps=8, block_out=32, max_registers=255),) * 3, resident_d=32, chunk_d=32),
    "ieee": Tiling(*(TileConfig(32, 32, block_out=32, max_registers=255),) * 3, resident_d=16, chunk_d=16),
    "fp64": Tiling(*(TileConfig(32, 16, block_out=32, max_registers=255),) * 3, resident_d=16, chunk_d=16),
}
# The fused Matryoshka kernels' tilings per operand class (kernels/matryoshka.py), the same on every family. Their
# backward holds a gradient slice, the running raw product, S, u = S / scale and both directions' dS beside the
# S chunk's operands: on tensor cores the 64 x 32 tile on 8 warps (the ranks' 64 x 64 on sm_90 spilled dk
# 92-108 B in bf16/fp16 at D = 1000) and 128-wide slices (each slice recomputes S, so wider is cheaper while it
# fits: 256 spilled dq and dk 272-792 B in bf16/fp16 on sm_80/90/100; 128 takes 221-255 registers, no spill);
# the FMA classes on 32 x 16 tiles (fp32 "ieee": the ranks' 32 x 32 spilled dk 12 B at 255 registers on sm_100,
# D = 1000) and 64-wide slices (fp32's 128 spilled dq and dk 24-228 B; 64 takes 208-250 registers, fp64 208-217).
_MATRYOSHKA_TENSOR_CORES = TileConfig(64, 32, num_warps=8, block_out=128, max_registers=255)
MATRYOSHKA_TILINGS = {
    "mma": Tiling(*(_MATRYOSHKA_TENSOR_CORES,) * 3, resident_d=32, chunk_d=32),
    "tf32": Tiling(*(_MATRYOSHKA_TENSOR_CORES,) * 3, resident_d=32, chunk_d=32),
    "ieee": Tiling(*(TileConfig(32, 16, block_out=64, max_registers=255),) * 3, resident_d=16, chunk_d=16),
    "fp64": Tiling(*(TileConfig(32, 16, block_out=64, max_registers=255),) * 3, resident_d=16, chunk_d=16),
}
# With the mask options (the masked kernels of kernels/matryoshka.py): the same S tiles and half the slices. The
# backward also holds the tile's positive and exclusion masks and, per prefix, the positives' inputs: at the plain
# slices dq and dk spilled 16-128 B on sm_80 and 36-124 B on sm_100 (bf16, fp16, tf32; fp32 FMA 56 B on sm_80) at
# D = 1000 with ids and a guide.
_MASKED_MATRYOSHKA_TENSOR_CORES = TileConfig(64, 32, num_warps=8, block_out=64, max_registers=255)
MASKED_MATRYOSHKA_TILINGS = {
    "mma": Tiling(*(_MASKED_MATRYOSHKA_TENSOR_CORES,) * 3, resident_d=32, chunk_d=32),
    "tf32": Tiling(*(_MASKED_MATRYOSHKA_TENSOR_CORES,) * 3, resident_d=32, chunk_d=32),
    "ieee": Tiling(*(TileConfig(32, 16, block_out=32, max_registers=255),) * 3, resident_d=16, chunk_d=16),
    "fp64": Tiling(*(TileConfig(32, 16, block_out=32, max_registers=255),) * 3, resident_d=16, chunk_d=16),
}

# The MaxSim kernels' tilings per operand class (one config for the forward, dq and dk kernels: the token products
# are the same bits in each). block_m query-token rows x block_n document tokens; a program holds the rows' resident
# feature chunk, the token product and, in dk, the [block_n, block_out] product of the routing with a q slice.
# bf16/fp16: D up to 128 resident (ColBERT's D = 128: 78-207 registers); beyond, 32-feature chunks and 64-wide slices:
# with 64-feature chunks and 128-wide slices a query longer than 64 tokens at D = 1000 spilled 8-1152 B in dq / dk on
# sm_90 and sm_100 (ptxas 12/13, 255 registers).
MAXSIM_TILINGS = {
    "mma": Tiling(*(TileConfig(64, 64, num_warps=8, block_out=64, max_registers=255),) * 3, resident_d=128, chunk_d=32),
    "tf32": Tiling(*(TileConfig(64, 32, num_warps=8, block_out=64, max_registers=255),) * 3, resident_d=64, chunk_d=32),
    "ieee": Tiling(*(TileConfig(32, 32, block_out=32, max_registers=255),) * 3, resident_d=16, chunk_d=16),
    "fp64": Tiling(*(TileConfig(32, 16, block_out=32, max_registers=255),) * 3, resident_d=16, chunk_d=16),
}
# Under the interpreter: the softmax and sigmoid kernels take few big tiles (configs.INTERPRETER_TILING); the
# rank, distillation and top-k kernels small ones, so that the tests' small shapes cut into several ragged blocks.
_SMALL_INTERPRETER_TILING = Tiling(*(TileConfig(32, 32, block_out=32),) * 3, resident_d=32, chunk_d=32)
INTERPRETER_TILINGS = {
    "softmax": INTERPRETER_TILING,
    "sigmoid": INTERPRETER_TILING,
    "rank": _SMALL_INTERPRETER_TILING,
    "topk": _SMALL_INTERPRETER_TILING,
    "matryoshka": _SMALL_INTERPRETER_TILING,
    "masked_matryoshka": _SMALL_INTERPRETER_TILING,
    # 16 document tokens a chunk: the tests' documents span several chunks, ragged; 32 query-token rows hold
    # several short queries or a chunk of a long one.
    "maxsim": Tiling(*(TileConfig(32, 16, block_out=32),) * 3, resident_d=32, chunk_d=16),
}

# The chunked route's passes (kernels/chunked_softmax.py) read a float32 [C, Bk] score chunk that cuBLAS wrote and
# take no product: memory-bound, so one config on every family and operand dtype. chunk_stats: a 64 x 64 float32
# tile (16 KiB) per load on 8 warps: 105 registers on sm_90, 2 CTAs per SM, 32 KiB of scores in flight per SM with the
# next tile's load; and 64 rows make its column partials 8 bytes per (64 rows x column), 1/32 of the S read at 4 bytes.
# (On 4 warps it issues a sixth fewer instructions per entry but takes 200 registers: 8 warps per SM.)
CHUNK_STATS_TILE = TileConfig(64, 64, num_warps=8)
# chunk_grad holds raw, s, dS and (symmetric) the column term at once: 32 rows on 8 warps keep it within registers
# (102 on sm_90: 2 CTAs per SM, 16 KiB of scores in flight per SM with the next tile's load; its ragged form 186). On
# 4 warps the even form takes 166 (3 CTAs) but the ragged one spills.
CHUNK_GRAD_TILE = TileConfig(32, 64, num_warps=8)
# Column tiles per program of either pass: 16 tiles of 64 columns. At C = 2368, Bk = 65536 the stats grid is 37 x 64
# = 2368 programs, 8.97 waves of 2 CTAs on 132 SMs (32 tiles: 4.48 waves, the last half idle: an 11% tail); the rows'
# partials are then 64 per row, 12 bytes each: 0.3% of the S bytes.
CHUNK_SPLIT_TILES = 16
# The merge of a chunk's partials (chunked_softmax._merge_chunk_kernel): BLOCK rows (columns) a program, their
# partials PARTS at a time as one [PARTS, BLOCK] tile, on 4 warps: 4096 values a load, and 19 + 512 programs at
# C = 2368, Bk = 65536 (the columns' 37 row blocks and the rows' 64 splits in two loads each).
CHUNK_MERGE_BLOCK = 128
CHUNK_MERGE_PARTS = 32
CHUNK_MERGE_WARPS = 4


@dataclass(frozen=True)
class Kernel:
    """One kernel a config is asked for (see the module docstring)."""

    family: str  # "softmax", "sigmoid", "rank" (the ranks' and the distillation loss's kernels), "topk", "maxsim"
    phase: str = "forward"  # softmax: "forward", "dq", "dk"; the other families: one config for every kernel
    operand_class: str = "mma"
    ragged: bool = False
    masks: Optional[str] = None  # softmax: None, "ids", "guide"


def _masked(kernel: Kernel, stages: int = 2, block_out: int = 128) -> TileConfig:
    """A masked softmax kernel's config on tensor cores: 64 x 16 on 8 warps, maxnreg 255. Each tile also holds
    the positives, the exclusions, the guide scores and their GEMM's pipeline, and the symmetric forward merges
    six column partials instead of two: the forward takes one stage (a second spills on sm_90 at ragged D); dq
    and dk ``stages`` and ``block_out`` (smaller slices than the plain kernels')."""
    if kernel.phase == "forward":
        return TileConfig(MASKED_ROWS, MASKED_COLS, num_warps=8, num_stages=1, max_registers=255)
    return TileConfig(MASKED_ROWS, MASKED_COLS, num_warps=8, num_stages=stages, block_out=block_out, max_registers=255)


def sm90(kernel: Kernel) -> TileConfig:
    """Hopper (sm_90): S on wgmma, 227 KiB of shared memory, ptxas 12/13."""
    mma, ragged = kernel.operand_class == "mma", kernel.ragged
    if kernel.family in ("rank", "topk"):
        # bf16/fp16 on the wgmma-friendly 64 x 64. Top-k: the ranks' tile, with the rows' lists (a key and an int64
        # index per slot, kernels.topk.max_top slots) beside it: 196-254 registers at D = 384 (the compile gate).
        return RANK_TILINGS[kernel.operand_class].forward
    if kernel.masks is not None:
        if mma and kernel.masks == "ids":  # no guide scores in the tile: the plain kernels' 256-wide slices fit
            return _masked(kernel, block_out=256)
        if mma:
            # A guide: 256-wide slices as the plain and ids-only kernels, so a guide recomputes S and its scores
            # in as many slices as the plain loss recomputes S (2 + 2 at D = 512, not 4 + 4). At ragged D the
            # masked last chunk spills dq 36-152 B (ids, a guide and "sum") and fp16's dk 88 B ("mean"): 128.
            return _masked(kernel, block_out=128 if ragged else 256)
        return _masked(kernel)
    # 64 x 64 on two warp groups, S on wgmma m64n32k16 (each group 32 columns), in every kernel, and the dk
    # product (M = 64) on wgmma too. 128 x 64 (m64n64 per group) spills the dq kernel 12-20 B at every pipeline
    # depth with bf16 or fp16 (D = 256 / 512, 128-wide slices; ptxas 13). bf16/fp16 at ragged D: the 64 x 64 dq
    # and dk spill 64-104 B with 256-wide slices (D = 1000); 64 x 32 fits (128-wide slices would fit 64 x 64 at
    # twice the S recomputations).
    tile = ScoreTile(64, 32, 8) if ragged and mma else ScoreTile(64, 64, 8)
    if kernel.phase == "forward":
        # bf16/fp16: 3 stages of q/k chunks (48 KiB of shared memory); tf32 (fp32 operands in 32-feature
        # chunks): a third stage pushes the registers into spills. Row blocks in pairs (TileConfig.row_tiles).
        return tile.config(num_stages=3 if mma else 2, row_tiles=2)
    if mma:  # dq and dk: 3 stages of the S chunks fit the registers and shared memory
        return tile.config(num_stages=3)
    return tile.config(block_out=128)  # tf32: a 256-wide slice spills at ragged D; 128 does not


def sm100(kernel: Kernel) -> TileConfig:
    """Blackwell (sm_100): S on tcgen05, ptxas 13."""
    mma, ragged = kernel.operand_class == "mma", kernel.ragged
    if kernel.family in ("rank", "topk"):  # bf16/fp16 take tf32's 64 x 32 (below); top-k as the ranks (see sm90)
        return RANK_TILINGS["tf32"].forward
    if kernel.masks is not None:
        if mma:  # as sm_90's
            return _masked(kernel, block_out=256 if kernel.masks == "ids" or not ragged else 128)
        return _masked(kernel)
    # tcgen05 M = 64, as sm_90's 64 x 64 (S on one tcgen05 tile, and the dk product's M = 64 on tcgen05 too,
    # where 32 rows fell back to mma.sync). At ragged D the 64 x 64 forward and dk spill 36-88 B (D = 1000):
    # 64 x 32 there. ptxas 13 spills the 128 x 64 dq and dk.
    tile = ScoreTile(64, 32, 8) if ragged else ScoreTile(64, 64, 8)
    if kernel.phase == "forward":  # maxnreg 255, or ptxas caps registers and spills at ragged D
        return tile.config(max_registers=255, row_tiles=2)
    if mma:
        # 3 stages of the S chunks; dk (the dS normalization beside the positives' branch): ptxas 13 caps it at
        # 128 registers and spills 8-12 B unless told 255.
        return tile.config(num_stages=3, max_registers=255 if kernel.phase == "dk" else 0)
    return tile.config(block_out=128, max_registers=255)  # tf32: 8 B spilled on 64 x 64 at D = 256-768 otherwise


def sm80(kernel: Kernel) -> TileConfig:
    """Ampere (sm_80): S on mma.sync, 163 KiB of shared memory, ptxas 12."""
    mma, ragged = kernel.operand_class == "mma", kernel.ragged
    if kernel.family in ("rank", "topk"):  # top-k as the ranks (see sm90)
        # bf16/fp16 take tf32's 64 x 32 tiles and 32-wide slices: the distillation backward's 64 x 64 tile,
        # 64-wide slices, spills 32-68 B at 255 registers, 12 B with 32-wide slices (its float32 teacher product
        # runs on FMA units beside S).
        return RANK_TILINGS["tf32"].forward
    if kernel.masks is not None:
        if mma and kernel.masks == "ids":
            # The plain kernels' 256-wide slices, one stage (and maxnreg 255: at D = 40 ptxas 12 caps float16's
            # dk at 128 registers and spills).
            return _masked(kernel, stages=1, block_out=256)
        if mma and kernel.phase == "dq":  # float16's dS normalization spills dq at ragged D: 1 stage, 64 wide
            return _masked(kernel, stages=1, block_out=64)
        return _masked(kernel)
    # The mma.sync families: 64 x 32 on 8 warps, the most the backward's 256-column slices fit beside.
    tile = ScoreTile(64, 32, 8)
    if kernel.phase == "forward":  # 3 stages of q/k chunks
        return tile.config(num_stages=3, row_tiles=2)
    # dq and dk: ptxas 12's allocator needs the third stage's registers back; maxnreg 255 (ptxas 12 capped tf32's
    # dk at 80 registers, 12 B spilled at D = 64, and dq at 128, 16 B at D = 96 / 128, with labels and Bk > Bq).
    # At ragged D, 256 columns spill 104 B: 128-wide slices, but for tf32's dk, which fits 256.
    wide = not ragged or (kernel.phase == "dk" and not mma)
    return tile.config(max_registers=255, block_out=256 if wide else 128)


def sm86(kernel: Kernel) -> TileConfig:
    """sm_86 / sm_89 (99 KiB of shared memory): S on mma.sync, ptxas 13."""
    mma, ragged = kernel.operand_class == "mma", kernel.ragged
    if kernel.family in ("rank", "topk"):  # bf16/fp16 take tf32's 64 x 32 (see sm80); top-k as the ranks (sm90)
        return RANK_TILINGS["tf32"].forward
    if kernel.masks is not None:
        return _masked(kernel, block_out=256 if mma and kernel.masks == "ids" else 128)
    tile = ScoreTile(64, 32, 8)  # as sm80's
    if kernel.phase == "forward":
        # maxnreg 255, or ptxas caps registers and spills at ragged D; there a pair of row blocks spills 20-40 B.
        return tile.config(max_registers=255, row_tiles=1 if ragged else 2)
    # dq and dk at maxnreg 255: tf32 spilled 24 B in dk with labels at D = 256-768 otherwise. bf16/fp16: 8 B
    # spilled at ragged D with 256 columns, and fp16's dS normalization spills dk's 32 owned rows at 256 columns
    # (8 B at D = 512): 128-wide slices there.
    wide = mma and not ragged and kernel.phase == "dq"
    return tile.config(max_registers=255, block_out=256 if wide else 128)


def sm120(kernel: Kernel) -> TileConfig:
    """sm_120 (consumer Blackwell, 99 KiB of shared memory): S on mma.sync, ptxas 13; sm_86's configs (:func:`sm86`)
    but for two."""
    mma, softmax = kernel.operand_class == "mma", kernel.family == "softmax"
    if softmax and mma and kernel.masks == "guide" and kernel.phase == "dk":
        # float16's dk with ids and a guide ("mean", D = 1000) spills 16 B at 255 registers on two stages; one fits.
        return _masked(kernel, stages=1)
    if softmax and not mma and kernel.masks is None and kernel.phase == "forward":
        return replace(sm86(kernel), max_registers=0)  # tf32's forward fits without maxnreg
    return sm86(kernel)


ARCHITECTURES = {90: sm90, 100: sm100, 80: sm80, 86: sm86, 120: sm120}


def fma(kernel: Kernel) -> TileConfig:
    """The FMA classes (fp32 "ieee", fp64) on every family: operands in registers, maxnreg 255."""
    fp64 = kernel.operand_class == "fp64"
    if kernel.family != "softmax":  # the ranks', the distillation loss's and (top-k) their tiles
        return RANK_TILINGS[kernel.operand_class].forward
    if kernel.masks is not None:  # the plain 32 x 32 tiles halved in columns (fp64: twice the registers an entry)
        rows, block_out = (16 if fp64 else 32), (0 if kernel.phase == "forward" else 64)
        return TileConfig(rows, 16, num_warps=4, num_stages=2, max_registers=FMA_REGISTERS, **_slice(block_out))
    if kernel.phase == "forward":  # 32 x 32 tiles on 4 warps over 16-feature chunks
        return TileConfig(32, 32, num_warps=4, num_stages=2, max_registers=FMA_REGISTERS)
    # dq and dk: 32-row blocks over 16-feature chunks, 128-wide slices (fp64: 16 owned columns and 64-wide
    # slices for twice the bytes per entry)
    return TileConfig(
        32, 16 if fp64 else 32, num_warps=4, num_stages=2, block_out=64 if fp64 else 128, max_registers=FMA_REGISTERS
    )


def _slice(block_out: int) -> dict:
    """``block_out`` as a TileConfig keyword, or none (the default) for a forward config."""
    return {"block_out": block_out} if block_out else {}


# The families with one config per operand class on every architecture family: their tables.
ONE_TABLE = {"sigmoid": SIGMOID_TILINGS, "maxsim": MAXSIM_TILINGS}


def config(arch: int, kernel: Kernel) -> TileConfig:
    """The config ``kernel`` takes on architecture family ``arch``: a family of :data:`ONE_TABLE` its table's
    forward config, else the architecture's function (the FMA classes: :func:`fma`)."""
    if kernel.family in ONE_TABLE:
        return ONE_TABLE[kernel.family][kernel.operand_class].forward
    if kernel.operand_class not in TENSOR_CORE_CLASSES:
        return fma(kernel)
    return ARCHITECTURES[arch](kernel)


def score_tile(arch: int, operand_class: str, ragged: bool = False) -> ScoreTile:
    """The S tile of the plain softmax kernels for family ``arch`` and tensor-core class ``operand_class`` at a
    ragged D or not: the forward config's, which the dq and dk configs share."""
    if operand_class not in TENSOR_CORE_CLASSES or arch not in ARCHITECTURES:
        raise KeyError((arch, operand_class))
    return config(arch, Kernel("softmax", "forward", operand_class, ragged)).score_tile


def forward_config(arch: int, operand_class: str, ragged: bool = False, masks: Optional[str] = None) -> TileConfig:
    """The softmax forward kernel's config."""
    return config(arch, Kernel("softmax", "forward", operand_class, ragged, masks))


def dq_config(arch: int, operand_class: str, ragged: bool = False, masks: Optional[str] = None) -> TileConfig:
    """The softmax dq kernel's config."""
    return config(arch, Kernel("softmax", "dq", operand_class, ragged, masks))


def dk_config(arch: int, operand_class: str, ragged: bool = False, masks: Optional[str] = None) -> TileConfig:
    """The softmax dk kernel's config: the dq kernel's with the roles of q and k swapped (its accumulator has
    BLOCK_N rows)."""
    return config(arch, Kernel("softmax", "dk", operand_class, ragged, masks))


def chunking(arch: int, operand_class: str, masked: bool = False, dim: Optional[int] = None) -> tuple:
    """(resident_d, chunk_d) of the softmax kernels' :class:`configs.Tiling` at D = ``dim`` (when known): the
    operand class's (:data:`configs.FEATURE_CHUNKS`), wider on sm_90 / sm_100 where D is whole wide chunks, and
    with mask options one feature chunk as the most a program holds in registers (the guide's tiles sit beside
    it)."""
    resident_d, chunk_d = FEATURE_CHUNKS[operand_class]
    if not masked:
        if arch in (90, 100) and operand_class == "mma" and _whole_chunks(dim, resident_d):
            # bf16/fp16 at D a multiple of 128 (beyond one chunk): S over 128-feature chunks, half the chunk loop's
            # trips, at one forward CTA per SM instead of two; at a ragged D the masked last 128-chunk spills, so
            # 64 there. The figures: docs/kernels.md, "Toward the GEMM bound". Either way D is ragged for both
            # chunks or for neither (configs.ragged_d), so the configs match.
            return resident_d, resident_d
        return resident_d, chunk_d
    if operand_class == "mma" and arch == 120:
        # sm_120 (ptxas 13): the symmetric forward with a guide spills 24-80 B at D = 1000 even at maxnreg 255
        # on 64-feature chunks; on 32-feature chunks it fits.
        chunk_d = 32
    return chunk_d, chunk_d


def _whole_chunks(dim: Optional[int], chunk_d: int) -> bool:
    """Whether D = ``dim`` is more than one chunk of ``chunk_d`` features and a whole number of them."""
    return dim is not None and dim > chunk_d and dim % chunk_d == 0


def tiling_for(
    arch: int, dtype: torch.dtype, precision: str, dim: Optional[int] = None, masked: bool = False, guide: bool = False
) -> Tiling:
    """The default tiling of the softmax kernels for architecture family ``arch``, inputs of ``dtype`` at tl.dot
    ``precision``, feature width ``dim`` (when known) and, ``masked``, mask options (``guide`` among them)."""
    operand_class = operand_class_of(dtype, precision)
    resident_d, chunk_d = chunking(arch, operand_class, masked, dim)
    masks = ("guide" if guide else "ids") if masked else None
    # Ids alone never take the ragged-D slices (their 256-wide slices fit there too).
    ragged = ragged_d(dim, operand_class, chunk_d if masked else None) and masks != "ids"
    return Tiling(
        forward=forward_config(arch, operand_class, ragged, masks),
        dq=dq_config(arch, operand_class, ragged, masks),
        dk=dk_config(arch, operand_class, ragged, masks),
        resident_d=resident_d,
        chunk_d=chunk_d,
    )


def plain_tiling(arch: int, operand_class: str, dim: Optional[int] = None) -> Tiling:
    """:func:`tiling_for` of the plain loss for ``operand_class``."""
    resident_d, chunk_d = chunking(arch, operand_class, dim=dim)
    ragged = ragged_d(dim, operand_class)
    return Tiling(
        forward=forward_config(arch, operand_class, ragged),
        dq=dq_config(arch, operand_class, ragged),
        dk=dk_config(arch, operand_class, ragged),
        resident_d=resident_d,
        chunk_d=chunk_d,
    )


def _one_config(family: str, tilings: dict, arch: int, dtype: torch.dtype, precision: str) -> Tiling:
    """A family with one config for every kernel: its table's chunking, and the config of :func:`config`."""
    operand_class = operand_class_of(dtype, precision)
    cfg = config(arch, Kernel(family, operand_class=operand_class))
    return replace(tilings[operand_class], forward=cfg, dq=cfg, dk=cfg)


def sigmoid_tiling(arch: int, dtype: torch.dtype, precision: str) -> Tiling:
    """The sigmoid kernels' tiling on family ``arch`` for inputs of ``dtype`` at tl.dot ``precision``."""
    return _one_config("sigmoid", SIGMOID_TILINGS, arch, dtype, precision)


def rank_tiling(arch: int, dtype: torch.dtype, precision: str) -> Tiling:
    """The rank and distillation kernels' tiling on family ``arch`` for inputs of ``dtype`` at ``precision``."""
    return _one_config("rank", RANK_TILINGS, arch, dtype, precision)


def matryoshka_tiling(arch: int, dtype: torch.dtype, precision: str) -> Tiling:
    """The fused Matryoshka kernels' tiling for inputs of ``dtype`` at ``precision``: one per operand class on
    every family ``arch`` (:data:`MATRYOSHKA_TILINGS`)."""
    return MATRYOSHKA_TILINGS[operand_class_of(dtype, precision)]


def masked_matryoshka_tiling(arch: int, dtype: torch.dtype, precision: str) -> Tiling:
    """The masked fused Matryoshka kernels' tiling (:data:`MASKED_MATRYOSHKA_TILINGS`), as
    :func:`matryoshka_tiling`."""
    return MASKED_MATRYOSHKA_TILINGS[operand_class_of(dtype, precision)]


def maxsim_tiling(arch: int, dtype: torch.dtype, precision: str) -> Tiling:
    """The MaxSim kernels' tiling on family ``arch`` for inputs of ``dtype`` at ``precision``."""
    return _one_config("maxsim", MAXSIM_TILINGS, arch, dtype, precision)


def topk_tiling(arch: int, dtype: torch.dtype, precision: str) -> Tiling:
    """The top-k kernel's tiling on family ``arch`` for inputs of ``dtype`` at ``precision``."""
    return _one_config("topk", RANK_TILINGS, arch, dtype, precision)


def target_tiling(
    family: str,
    dtype: torch.dtype,
    precision: str,
    dim: Optional[int] = None,
    masked: bool = False,
    guide: bool = False,
) -> Tiling:
    """The tiling of kernel ``family`` ("softmax", "sigmoid", "rank", "topk", "matryoshka", "masked_matryoshka")
    on the active target's architecture family, the interpreter's under TRITON_INTERPRET=1 (``dim``, ``masked``,
    ``guide``: the softmax kernels')."""
    if INTERPRETED:
        return INTERPRETER_TILINGS[family]
    arch = target_family()
    if family == "softmax":
        return tiling_for(arch, dtype, precision, dim, masked, guide)
    tilings = {
        "sigmoid": sigmoid_tiling,
        "rank": rank_tiling,
        "topk": topk_tiling,
        "matryoshka": matryoshka_tiling,
        "masked_matryoshka": masked_matryoshka_tiling,
        "maxsim": maxsim_tiling,
    }
    return tilings[family](arch, dtype, precision)
