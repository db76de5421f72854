"""The top-k search as a Triton kernel (``topk_scores(backend="triton")``; definitions and tie rule:
:mod:`infcl.contract`; the torch tiles' version: :mod:`infcl.backends.torch_tiles.topk`; the backend object:
:mod:`infcl.backends.triton.topk`).

A program owns BLOCK_M rows of the block and walks its column tiles (its S tile from
:func:`infcl.kernels.tiling.topk_tiling`, summed over BLOCK_D feature chunks by
:func:`infcl.kernels.score_tiles.score_chunks`). Its rows' lists (the n best so far, any order) are loaded into
registers as a [BLOCK_M, BLOCK_TOP] list, continued tile by tile and stored back: no atomics, every output
written by the one program that owns it.

Per tile, the entries that beat a row's worst kept one (a lower key, or an equal key and a higher global
index) are its candidates; while any row has one, each such row puts its best candidate (highest key,
then lowest index) in place of its worst, and the candidates are taken again against the new worst. A row
takes at most min(n, BLOCK_N) per tile, and after the first tiles of a long walk hardly any: a tile costs
its product and a comparison. The order is strict, so the lists hold the exact n best whatever the
tiles; :class:`infcl.backends.triton.topk.TritonTopK` sorts them best first.

Registers: the list is BLOCK_TOP = next_power_of_2(n) wide (at most :func:`max_top`: beyond it the torch
tiles run the search) beside the S tile; compiled (tests/test_triton_api_compile.py), not yet run or tuned
on a GPU.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..contract import NO_INDEX
from ..op_fakes import in_place_fake
from .kernel_args import launch_args
from .registration import register_op, wrap
from .score_tiles import Dot, Matrix, Tile, load_vector, score_chunks

# The widest list a program holds in registers beside its S tile (two [BLOCK_M, MAX_TOP] tensors, a key and
# an int64 index); a larger n runs on the torch tiles. ptxas (compile gate, D = 384): 128 spills on sm_90 in
# every dtype; 64 fits at 196-254 registers except float64 on sm_90 (16 B spilled), whose keys are twice as
# wide: float64 takes 32.
MAX_TOP = 64
MAX_TOP_FLOAT64 = 32


def max_top(dtype: torch.dtype) -> int:
    """The largest n the kernel takes for inputs of ``dtype``."""
    return MAX_TOP_FLOAT64 if dtype == torch.float64 else MAX_TOP


# infcl.contract.NO_INDEX where the kernel sees it (a module-level value inside @triton.jit must be a constexpr).
EMPTY = tl.constexpr(NO_INDEX)


@triton.jit
def _worst(key, index, slots, BLOCK_TOP: tl.constexpr):
    """(key, index, slot) of each row's worst entry of a list: the lowest key, then the highest index, then
    the lowest slot (empty slots are all (-inf, EMPTY))."""
    w_key = tl.min(key, axis=1)
    at_worst = key == w_key[:, None]
    w_index = tl.max(tl.where(at_worst, index, -1), axis=1)
    w_slot = tl.min(tl.where(at_worst & (index == w_index[:, None]), slots[None, :], BLOCK_TOP), axis=1)
    return w_key, w_index, w_slot


@triton.jit
def _beats(key, index, w_key, w_index):
    """Whether each entry of a tile beats its row's worst kept entry: a higher key, or equal and a lower index."""
    return (key > w_key[:, None]) | ((key == w_key[:, None]) & (index < w_index[:, None]))


@triton.jit
def _topk_kernel(
    q_ptr,
    k_ptr,
    col_index_ptr,
    pos_ptr,
    q_ids_ptr,
    k_ids_ptr,
    key_ptr,
    index_ptr,
    nan_ptr,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    n_top,
    LARGEST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.arange(0, BLOCK_TOP)
    in_list = (rows[:, None] < n_q) & (slots[None, :] < n_top)
    at = rows[:, None] * n_top + slots[None, :]
    # Slots past n (the list's padding) hold (+inf, -1): never a row's worst, never replaced.
    key = tl.where(in_list, tl.load(key_ptr + at, mask=in_list), float("inf")).to(ACC)
    index = tl.where(in_list, tl.load(index_ptr + at, mask=in_list), -1)
    nan = tl.zeros([BLOCK_M], tl.int64)
    if pos_ptr is not None:
        row_pos = load_vector(pos_ptr, rows, n_q, 1, -1, True)
    if q_ids_ptr is not None:
        row_ids = load_vector(q_ids_ptr, rows, n_q, 1, -1, True)
    w_key, w_index, w_slot = _worst(key, index, slots, BLOCK_TOP)
    for c0 in range(0, n_k, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N).to(tl.int64)
        raw = score_chunks(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            rows,
            cols,
            Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
            Dot(ACC, UPCAST, PRECISION),
        )
        keys = raw if LARGEST else -raw  # the key: exact, the order reversed and ties kept
        eligible = (rows[:, None] < n_q) & (cols[None, :] < n_k)
        if pos_ptr is not None:
            eligible = eligible & (cols[None, :] != row_pos[:, None])
        if q_ids_ptr is not None:
            col_ids = load_vector(k_ids_ptr, cols, n_k, 1, -1, True)
            eligible = eligible & (row_ids[:, None] != col_ids[None, :])
        is_nan = keys != keys
        nan += tl.sum((is_nan & eligible).to(tl.int64), axis=1)
        col_index = load_vector(col_index_ptr, cols, n_k, 1, EMPTY, True)[None, :]
        open_ = eligible & ~is_nan  # candidates not yet taken
        beats = open_ & _beats(keys, col_index, w_key, w_index)
        while tl.max(beats.to(tl.int32)) > 0:
            has = tl.max(beats.to(tl.int32), axis=1) > 0
            b_key = tl.max(tl.where(beats, keys, float("-inf")), axis=1)
            b_index = tl.min(tl.where(beats & (keys == b_key[:, None]), col_index, EMPTY), axis=1)
            put = has[:, None] & (slots[None, :] == w_slot[:, None])
            key = tl.where(put, b_key[:, None], key)
            index = tl.where(put, b_index[:, None], index)
            open_ = open_ & ~(has[:, None] & (col_index == b_index[:, None]))
            w_key, w_index, w_slot = _worst(key, index, slots, BLOCK_TOP)
            beats = open_ & _beats(keys, col_index, w_key, w_index)
    tl.store(key_ptr + at, key, mask=in_list)
    tl.store(index_ptr + at, index, mask=in_list)
    row_ok = rows < n_q
    tl.store(nan_ptr + rows, tl.load(nan_ptr + rows, mask=row_ok) + nan, mask=row_ok)


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _topk_block(
    q: torch.Tensor,
    k: torch.Tensor,
    col_index: torch.Tensor,
    key: torch.Tensor,
    index: torch.Tensor,
    nan: torch.Tensor,
    largest: bool,
    pos: Optional[torch.Tensor],
    q_ids: Optional[torch.Tensor],
    k_ids: Optional[torch.Tensor],
    precision: str,
) -> None:
    args, tiling = launch_args(q, k, precision or None, family="topk")
    n_top = key.shape[1]
    wrap(_topk_kernel)[(triton.cdiv(q.shape[0], tiling.forward.block_m),)](
        col_index_ptr=col_index.contiguous(),
        pos_ptr=_contiguous(pos),
        q_ids_ptr=_contiguous(q_ids),
        k_ids_ptr=_contiguous(k_ids),
        key_ptr=key,
        index_ptr=index,
        nan_ptr=nan,
        n_top=n_top,
        LARGEST=largest,
        BLOCK_TOP=triton.next_power_of_2(n_top),
        **args,
    )


# torch.ops.infcl.triton_topk_block_, registered as the loss kernels' block steps are
# (:func:`.registration.register_op`): the native kernel's topk_block_ (csrc/topk.cpp) plus ``precision`` ("" for
# None), continuing key / index / nan in place; the lists come back unsorted.
topk_block_op = register_op("triton_topk_block_", _topk_block, in_place_fake, mutates=("key", "index", "nan"))
