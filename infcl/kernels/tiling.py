"""The softmax kernels' tiling, read in one place: which forward / dq / dk config and which feature chunking
a call takes on an architecture family, for an operand class, at a D, with or without mask options.

One function per kernel (:func:`forward_config`, :func:`dq_config`, :func:`dk_config`) answers "which tile does
dq take on sm_90 in bf16 at D = 512?" (``dq_config(90, "mma", ragged=False)``); every branch says why, Triton
version workarounds included; :func:`tiling_for` puts the three together with the feature chunking
(:func:`chunking`). Not tuned on a GPU: each config is the one that compiles without spills and within
shared memory on its family (tests/test_triton_api_compile.py; ``python -m bench.static`` reports the
figures).

The arguments: ``arch``, a family of :data:`configs.ARCH_FAMILIES`; ``operand_class``, :func:`configs.operand_class_of`
("mma": bf16/fp16 tensor cores, "tf32", "ieee": fp32 FMA, "fp64"); ``ragged``, D wider than one feature
chunk and not a whole number of them (:func:`configs.ragged_d`: the last chunk's masked loads need
registers); ``masks``, None for the plain loss, "ids" (ids without a guide) or "guide" (a guide, with or
without ids).

On tensor cores every plain config is built on the family's S tile (:func:`configs.score_tile`), so the three
kernels compute S with the same MMA instruction and layout (tests/test_static_report.py checks it in the
compiled code). ``block_out`` (dq / dk): the slice of the gradient a program holds in registers, BLOCK_M
(BLOCK_N) rows x block_out fp32 columns: 64 x 256 over 8 warps is 64 registers a thread, the most that
leaves room for the S and dS tiles without spilling.
"""

from dataclasses import replace
from typing import Optional

import torch

from .configs import (
    FEATURE_CHUNKS,
    TENSOR_CORE_CLASSES,
    TRITON_VERSION,
    TileConfig,
    Tiling,
    operand_class_of,
    ragged_d,
    score_tile,
)

# Triton 3.2 aborts compiling a 64-row wgmma tile split over two warp groups (an LLVM assertion): there the
# sm_90 / sm_100 tensor-core tiles keep one warp group per 64 rows (configs.score_tile).
_OLD_WGMMA = TRITON_VERSION < (3, 3)

# FMA products (fp32 "ieee", fp64) hold their operand fragments in registers: maxnreg 255 everywhere, so
# ptxas does not spill to fit more blocks per SM. Each entry is a sum in K order whatever the tile, so their
# tiles need not match between kernels.
_FMA = 255
# With mask options, tensor cores take 64-row tiles (as the backward's: the same MMA instruction) of 16
# columns, maxnreg 255 (ptxas otherwise caps the masked kernels at 128 registers on sm_86 and spills).
_MASKED_ROWS, _MASKED_COLS = 64, 16


def forward_config(arch: int, operand_class: str, ragged: bool = False, masks: Optional[str] = None) -> TileConfig:
    """The forward kernel's config."""
    if masks is not None:
        # Each tile also holds the positives, the exclusions, the guide scores and their GEMM's pipeline, and
        # the symmetric loss merges six column partials instead of two: one stage (a second spills on sm_90
        # at ragged D).
        if operand_class == "ieee":  # the plain 32 x 32 tiles halved in columns
            return TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=2, max_registers=_FMA)
        if operand_class == "fp64":  # twice the registers an entry
            return TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, max_registers=_FMA)
        if _OLD_WGMMA and arch in (90, 100) and operand_class == "mma":  # 128 rows on the same 8 warps
            return TileConfig(block_m=128, block_n=16, num_warps=8, num_stages=1, max_registers=255)
        return TileConfig(block_m=_MASKED_ROWS, block_n=_MASKED_COLS, num_warps=8, num_stages=1, max_registers=255)
    if operand_class not in TENSOR_CORE_CLASSES:
        # 32 x 32 tiles on 4 warps over 16-feature chunks.
        return TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2, max_registers=_FMA)
    tile = score_tile(arch, operand_class, ragged)
    # The plain symmetric forward walks pairs of row blocks (TileConfig.row_tiles); under Triton 3.2 (128-row
    # S tiles on sm_90 / sm_100) a pair spills 80-120 B, and on sm_86 / sm_120 (ptxas caps them at 255
    # registers) a pair spills 20-40 B at ragged D, so one row block at a time there.
    row_tiles = 1 if _OLD_WGMMA or (ragged and arch in (86, 120)) else 2
    if (arch, operand_class) in ((90, "mma"), (80, "mma"), (80, "tf32")):
        # sm_90: 3 stages of q/k chunks (48 KiB of shared memory); sm_80 likewise. Triton 3.2's ragged-D
        # tiles on sm_90 (128 x 32) spill with a third stage.
        stages = 2 if _OLD_WGMMA and ragged and arch == 90 else 3
        return tile.config(num_stages=stages, row_tiles=row_tiles)
    if (arch, operand_class) in ((100, "mma"), (100, "tf32"), (86, "mma"), (120, "mma"), (86, "tf32")):
        # sm_100 (ptxas 13) and the 99 KiB families: maxnreg 255, or ptxas caps registers and spills at
        # ragged D.
        return tile.config(max_registers=255, row_tiles=row_tiles)
    # tf32 on sm_90 / sm_100 / sm_120: fp32 operands in 32-feature chunks; a third stage pushes sm_90's
    # registers into spills.
    return tile.config(row_tiles=row_tiles)


def dq_config(arch: int, operand_class: str, ragged: bool = False, masks: Optional[str] = None) -> TileConfig:
    """The dq kernel's config (the dk kernel's: :func:`dk_config`)."""
    if masks is not None:
        return _masked_backward(arch, operand_class, ragged, masks, dk=False)
    return _plain_dq(arch, operand_class, ragged)


def _plain_dq(arch: int, operand_class: str, ragged: bool) -> TileConfig:
    """The plain dq config, which the plain dk config starts from."""
    if operand_class == "ieee":  # 32-row blocks on 4 warps over 16-feature chunks (as in the forward)
        return TileConfig(block_m=32, block_n=32, num_warps=4, num_stages=2, block_out=128, max_registers=_FMA)
    if operand_class == "fp64":  # 16 owned columns and 64-wide slices for twice the bytes per entry
        return TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=2, block_out=64, max_registers=_FMA)
    tile = score_tile(arch, operand_class, ragged)
    if _OLD_WGMMA and arch in (90, 100):
        # Triton 3.2's 128-row tiles need more registers than 3.9's for the same work: the slices narrow
        # to 64 (128 spills dk 16-112 B at D = 512 and 784-1224 B at ragged D).
        return tile.config(block_out=64)
    if operand_class == "mma":
        if arch in (90, 100):
            # 3 stages of the S chunks fit the registers and shared memory (sm_90 at ragged D: on its
            # 64 x 32 ragged S tile).
            return tile.config(num_stages=3)
        # sm_80 and the 99 KiB families: ptxas 12's allocator needs the third stage's registers back; at
        # ragged D sm_80 (ptxas 12) spills 104 B at 256 columns and sm_86 / sm_120 (ptxas 13) 8 B at maxnreg
        # 255: 128-wide slices fit.
        return tile.config(max_registers=255, block_out=128 if ragged else 256)
    # tf32: a 256-wide slice spills at ragged D on sm_90; 128 does not. sm_86 / sm_100 / sm_120 (ptxas 13) cap the
    # tf32 tiles below their need unless told 255: dq spilled 8 B on sm_120 at D = 1, dk 24 B with labels on sm_86
    # at D = 256-768, on sm_120 at D = 40 and 8 B on sm_100's 64 x 64 at D = 256-768 (dk takes dq's). sm_80:
    # 128-wide slices at ragged D (as bf16's), and maxnreg 255: ptxas 12 capped dk at 80 registers (12 B spilled,
    # D = 64) and dq at 128 (16 B, D = 96 / 128) with labels and Bk > Bq.
    if arch == 90:
        return tile.config(block_out=128)
    if arch in (86, 100, 120):
        return tile.config(block_out=128, max_registers=255)
    return tile.config(block_out=128 if ragged else 256, max_registers=255)


def dk_config(arch: int, operand_class: str, ragged: bool = False, masks: Optional[str] = None) -> TileConfig:
    """The dk kernel's config: the dq kernel's with the roles of q and k swapped (its accumulator has BLOCK_N
    rows), and the differences below."""
    if masks is not None:
        return _masked_backward(arch, operand_class, ragged, masks, dk=True)
    dq = _plain_dq(arch, operand_class, ragged)
    if operand_class not in TENSOR_CORE_CLASSES:
        return dq
    if _OLD_WGMMA and arch in (90, 100):
        return replace(dq, num_stages=1) if ragged else dq  # Triton 3.2 at ragged D: one stage
    if operand_class == "mma" and arch in (86, 120):
        # sm_86 / sm_120 (ptxas 13): fp16's dS normalization spills 32 owned rows at 256 columns (8 B at
        # D = 512).
        return replace(dq, block_out=128)
    if (arch, operand_class) == (100, "mma"):
        # sm_100's fp16 dk (the dS normalization beside the positives' branch): ptxas 13 caps it at 128
        # registers and spills 8-12 B unless told 255.
        return replace(dq, max_registers=255)
    if (arch, operand_class) == (80, "tf32") and ragged:
        return replace(dq, block_out=256)  # dk fits sm_80's 256-wide tf32 slices at ragged D; dq does not
    return dq


def _masked_backward(arch: int, operand_class: str, ragged: bool, masks: str, dk: bool) -> TileConfig:
    """dq (dk) with mask options: smaller tiles and slices than the plain kernels', as the forward's."""
    if operand_class == "ieee":
        return TileConfig(block_m=32, block_n=16, num_warps=4, num_stages=2, block_out=64, max_registers=_FMA)
    if operand_class == "fp64":
        return TileConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, block_out=64, max_registers=_FMA)
    if _OLD_WGMMA and arch in (90, 100) and operand_class == "mma":
        # As the masked forward under Triton 3.2: 128 rows on 8 warps, one stage and 64-wide slices, ids or a
        # guide, ragged D or not (wider ones spill 300-3000 B).
        return TileConfig(block_m=128, block_n=16, num_warps=8, num_stages=1, block_out=64, max_registers=255)
    stages, block_out = 2, 128
    if operand_class == "mma" and masks == "ids":
        # Ids without a guide (no guide scores in the tile) fit the plain kernels' 256-wide slices, so ids cost
        # the backward no S recomputation beyond the plain loss's (sm_80: one stage, and maxnreg 255: at D = 40
        # ptxas 12 caps float16's dk at 128 registers and spills).
        stages, block_out = (1 if arch == 80 else 2), 256
    elif operand_class == "mma" and arch in (90, 100):
        # sm_90 / sm_100 with a guide: 256-wide slices, as the plain and ids-only kernels, so a guide recomputes
        # S and its scores in as many slices as the plain loss recomputes S (2 + 2 at D = 512, not 4 + 4). At
        # ragged D the masked last chunk spills dq 36-152 B (ids, a guide and "sum") and fp16's dk 88 B
        # ("mean") there, so both keep 128-wide slices.
        block_out = 128 if ragged else 256
    elif operand_class == "mma" and arch == 80 and not dk:
        # sm_80 (ptxas 12): float16's dS normalization spills the dq kernel at ragged D; one stage, 64-wide
        # slices fit.
        stages, block_out = 1, 64
    elif operand_class == "mma" and arch == 120 and dk:
        # sm_120 (ptxas 13): float16's dk with ids and a guide ("mean", D = 1000) spills 16 B at 255 registers
        # with two stages; one fits.
        stages = 1
    return TileConfig(
        block_m=_MASKED_ROWS,
        block_n=_MASKED_COLS,
        num_warps=8,
        num_stages=stages,
        block_out=block_out,
        max_registers=255,
    )


def chunking(arch: int, operand_class: str, masked: bool = False, dim: Optional[int] = None) -> tuple:
    """(resident_d, chunk_d) of :class:`configs.Tiling` at D = ``dim`` (when known): the operand class's
    (:data:`configs.FEATURE_CHUNKS`), wider on sm_90 where D is whole wide chunks, and with mask options one
    feature chunk as the most a program holds in registers (the guide's tiles sit beside it)."""
    resident_d, chunk_d = FEATURE_CHUNKS[operand_class]
    if not masked:
        if arch in (90, 100) and operand_class == "mma" and not _OLD_WGMMA and _whole_chunks(dim, resident_d):
            # sm_90 bf16/fp16 at D a multiple of 128 (beyond one chunk): S over 128-feature chunks, half the chunk
            # loop's trips, at one forward CTA per SM instead of two; at a ragged D the masked last 128-chunk
            # spills, so 64 there. The figures: docs/kernels.md, "Toward the GEMM bound". Either way D is ragged
            # for both chunks or for neither (configs.ragged_d), so the configs match.
            return resident_d, resident_d
        return resident_d, chunk_d
    if operand_class == "mma" and (arch == 120 or (_OLD_WGMMA and arch in (90, 100))):
        # sm_120 (ptxas 13): the symmetric forward with a guide spills 24-80 B at D = 1000 even at maxnreg 255
        # on 64-feature chunks; on 32-feature chunks it fits (so do Triton 3.2's 128-row masked tiles).
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
