"""The softmax kernels' tiling for one call: which forward / dq / dk configs and which feature chunking a
given (architecture family, operand class, D, mask options) takes, read in one place.

:func:`tiling_for` is the one entry point (:func:`infcl.kernels.ops.default_tiling` calls it with the active
target's family). The configs themselves sit beside their kernels, each with the reason it was chosen
(:data:`softmax_forward.DEFAULT_CONFIGS`, :data:`softmax_backward.DQ_CONFIGS`, ...); the branches below say
which table a case reads:

- plain loss: the operand class's feature chunking (:data:`configs.FEATURE_CHUNKS`) and the default configs,
  or at a ragged D (:func:`configs.ragged_d`: the last chunk's masked loads need registers) the ragged-D
  configs where the family has them;
- mask options (ids, a guide): one feature chunk as the most a program holds in registers (the operand
  class's chunk, or the family's :data:`softmax_forward.MASKED_CHUNK_D`), the masked forward, and the dq / dk
  configs of the guided kernels (a guide) or of the ids-only kernels, narrower dq / dk slices at a ragged D
  with a guide.

On tensor cores every config of one call is built on one S tile (:func:`configs.score_tile`), so the three
kernels compute S with the same MMA instruction and layout (tests/test_static_report.py checks the tables
and the compiled code).
"""

from typing import Optional

import torch

from . import softmax_backward, softmax_forward
from .configs import FEATURE_CHUNKS, Tiling, operand_class, ragged_d


def plain_tiling(arch: int, klass: str, dim: Optional[int] = None) -> Tiling:
    """The plain loss's tiling for family ``arch`` and operand class ``klass`` (:func:`configs.operand_class`)
    at feature width ``dim`` (None: not known, the whole-chunk configs)."""
    resident_d, chunk_d = FEATURE_CHUNKS[klass]
    key = (arch, klass)
    forward = softmax_forward.DEFAULT_CONFIGS[key]
    dq, dk = softmax_backward.DQ_CONFIGS[key], softmax_backward.DK_CONFIGS[key]
    if ragged_d(dim, klass):
        forward = softmax_forward.RAGGED_D_CONFIGS.get(key, forward)
        dq = softmax_backward.RAGGED_D_DQ_CONFIGS.get(key, dq)
        dk = softmax_backward.RAGGED_D_DK_CONFIGS.get(key, dk)
    return Tiling(forward=forward, dq=dq, dk=dk, resident_d=resident_d, chunk_d=chunk_d)


def masked_tiling(arch: int, klass: str, dim: Optional[int] = None, guide: bool = False) -> Tiling:
    """The tiling of a call with mask options (ids and / or a ``guide``): one feature chunk held at most."""
    key = (arch, klass)
    chunk_d = softmax_forward.MASKED_CHUNK_D.get(key, FEATURE_CHUNKS[klass][1])
    if guide:
        dq, dk = softmax_backward.MASKED_DQ_CONFIGS[key], softmax_backward.MASKED_DK_CONFIGS[key]
        if ragged_d(dim, klass, chunk_d):
            dq = softmax_backward.MASKED_RAGGED_D_CONFIGS.get(key, dq)
            dk = softmax_backward.MASKED_RAGGED_D_CONFIGS.get(key, dk)
    else:
        dq, dk = softmax_backward.IDS_DQ_CONFIGS[key], softmax_backward.IDS_DK_CONFIGS[key]
    return Tiling(forward=softmax_forward.MASKED_CONFIGS[key], dq=dq, dk=dk, resident_d=chunk_d, chunk_d=chunk_d)


def tiling_for(arch: int, dtype: torch.dtype, precision: str, dim: Optional[int] = None, masked: bool = False,
               guide: bool = False) -> Tiling:
    """The default tiling of the softmax kernels for architecture family ``arch`` (a key of
    :data:`configs.ARCH_FAMILIES`), inputs of ``dtype`` at tl.dot ``precision``, feature width ``dim`` (when
    known) and, ``masked``, mask options (``guide`` among them)."""
    klass = operand_class(dtype, precision)
    if masked:
        return masked_tiling(arch, klass, dim, guide)
    return plain_tiling(arch, klass, dim)
