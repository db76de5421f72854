"""Backward phase: recompute each S tile, form dS, accumulate dq, dk and the scale gradient.

With raw = q @ k.T, S = scale * raw, the global row (and column) log-sum-exps from the forward and the
upstream gradients g_row [Bq] (and g_col [Bk]):

    dS    = g_row[:, None] * exp(S - row_lse[:, None])  [+ g_col[None, :] * exp(S - col_lse[None, :])]
    dq   += scale * dS @ k            dk += scale * dS.T @ q
    dscale_row = sum(row part of dS * raw),   dscale_col = sum(column part of dS * raw)

One kernel, one program per BLOCK_M rows of q, walking k in BLOCK_N blocks. Per block: S is recomputed
(1 GEMM, over D in BLOCK_D chunks), dS is formed in registers, and for each feature chunk the program
adds dS @ k[:, chunk] into its own rows of dq (a plain read-add-write: no other program touches those
rows) and dS.T @ q[:, chunk] into dk with atomic adds (every row block adds into every k block; in the
accumulation dtype, so the summation order, not the precision, varies from run to run). The symmetric
loss adds the column term to the same dS, so it costs no extra GEMM.

GEMM count per call: 3 (S, dq, dk), for the one-directional and the symmetric loss alike. With the
forward (1 GEMM one direction, 2 symmetric): 4 in all for one direction, 5 for the symmetric loss
(Inf-CL: 5 and 10). The scale gradient: each program writes its two partial sums (row, column) into a
[programs, 2] buffer that torch sums. Extra memory: that buffer, O(Bq / BLOCK_M).

On a GPU dS is cast to the inputs' dtype before the two products (tensor-core operands, as torch does in
that dtype); under the interpreter the same rounding happens before the upcast (see tiles.py).
"""

import torch
import triton
import triton.language as tl

from .tiles import (
    MIN_DOT,
    TileConfig,
    autotuning,
    block_d,
    launch_options,
    load_tile,
    pick_config,
    score_tile,
    tile_dot,
)


@triton.jit
def _lse_backward_kernel(
    q_ptr, k_ptr, scale_ptr, row_lse_ptr, g_row_ptr, col_lse_ptr, g_col_ptr, dq_ptr, dk_ptr, dscale_ptr,
    n_q, n_k, D,
    stride_q0, stride_q1, stride_k0, stride_k1, stride_dq0, stride_dq1, stride_dk0, stride_dk1,
    HAS_COL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= MIN_DOT and BLOCK_N >= MIN_DOT and BLOCK_D >= MIN_DOT)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    scale = tl.load(scale_ptr)
    row_lse = tl.load(row_lse_ptr + rows, mask=row_ok, other=0.0)
    g_row = tl.load(g_row_ptr + rows, mask=row_ok, other=0.0)
    dscale_row = tl.zeros([BLOCK_M], dtype=ACC)
    dscale_col = tl.zeros([BLOCK_N], dtype=ACC)
    for n0 in range(0, n_k, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < n_k
        tile_ok = row_ok[:, None] & col_ok[None, :]
        raw = score_tile(
            q_ptr, k_ptr, rows, cols, n_q, n_k, D, stride_q0, stride_q1, stride_k0, stride_k1,
            BLOCK_M, BLOCK_N, BLOCK_D, ACC, UPCAST, PRECISION,
        )
        s = raw * scale
        # Zero outside the block explicitly: a padded entry must not add to any sum, whatever it holds.
        ds = tl.where(tile_ok, g_row[:, None] * tl.exp(s - row_lse[:, None]), 0.0)
        dscale_row += tl.sum(ds * raw, axis=1)
        if HAS_COL:
            col_lse = tl.load(col_lse_ptr + cols, mask=col_ok, other=0.0)
            g_col = tl.load(g_col_ptr + cols, mask=col_ok, other=0.0)
            ds_col = tl.where(tile_ok, g_col[None, :] * tl.exp(s - col_lse[None, :]), 0.0)
            dscale_col += tl.sum(ds_col * raw, axis=0)
            ds = ds + ds_col
        ds_op = ds.to(q_ptr.dtype.element_ty)  # the products' operand dtype (tensor cores on a GPU)
        for d0 in range(0, D, BLOCK_D):
            feats = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
            feat_ok = feats[None, :] < D
            k_tile = load_tile(k_ptr, cols, feats, n_k, D, stride_k0, stride_k1)  # [BLOCK_N, BLOCK_D]
            q_tile = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1)  # [BLOCK_M, BLOCK_D]
            dq_part = tile_dot(ds_op, k_tile, tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC), UPCAST, PRECISION)
            dq_ptrs = dq_ptr + rows[:, None] * stride_dq0 + feats[None, :] * stride_dq1
            dq_mask = row_ok[:, None] & feat_ok
            tl.store(dq_ptrs, tl.load(dq_ptrs, mask=dq_mask, other=0.0) + scale * dq_part, mask=dq_mask)
            dk_part = tile_dot(tl.trans(ds_op), q_tile, tl.zeros([BLOCK_N, BLOCK_D], dtype=ACC), UPCAST, PRECISION)
            dk_ptrs = dk_ptr + cols[:, None] * stride_dk0 + feats[None, :] * stride_dk1
            tl.atomic_add(dk_ptrs, scale * dk_part, mask=col_ok[:, None] & feat_ok, sem="relaxed")
    tl.store(dscale_ptr + 2 * pid, tl.sum(dscale_row, axis=0))
    tl.store(dscale_ptr + 2 * pid + 1, tl.sum(dscale_col, axis=0))


# The config used unless INFCL_AUTOTUNE=1. Not tuned on a GPU yet (none was available): square 64
# tiles keep the fp32 S and dS tiles plus one feature chunk of q, k, dq and dk within 4 warps' registers.
DEFAULT_CONFIG = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
# The search space under INFCL_AUTOTUNE=1, keyed by D, the symmetric flag and the input dtypes.
AUTOTUNE_CONFIGS = [
    TileConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
    for bm in (32, 64, 128)
    for bn in (32, 64, 128)
    for w in (4, 8)
    for s in (1, 2)
]
# dq and dk are accumulated in place: every benchmarked config must start from the caller's values.
_lse_backward_autotuned = triton.autotune(
    configs=[c.as_triton() for c in AUTOTUNE_CONFIGS], key=["D", "HAS_COL"], restore_value=["dq_ptr", "dk_ptr"]
)(_lse_backward_kernel)


def lse_backward(
    q, k, scale, row_lse, g_row, col_lse, g_col, dq, dk, precision=None, config: TileConfig = None
):
    """Accumulate dq [Bq, D] and dk [Bk, D] in place; return (dscale_row, dscale_col) as 0-d tensors.

    q [Bq, D], k [Bk, D] inputs (any strides); row_lse, g_row [Bq] and, for the symmetric loss, col_lse,
    g_col [Bk] (else None) in the accumulation dtype, as are dq and dk (any strides). ``precision`` and
    ``config`` as in :func:`infcl.kernels.triton_lse_forward.lse_forward`.
    """
    opts = launch_options(q.dtype, precision)
    acc = dq.dtype
    n_q, dim = q.shape
    n_k = k.shape[0]
    has_col = col_lse is not None
    # The upstream gradient of a mean is an expanded (stride 0) vector: O(B) copies make them plain.
    row_lse, g_row = row_lse.contiguous(), g_row.contiguous()
    col_lse, g_col = (col_lse.contiguous(), g_col.contiguous()) if has_col else (row_lse, g_row)
    scale_t = torch.full((1,), scale, dtype=acc, device=q.device)
    # One (row, column) partial per program; sized for the smallest BLOCK_M any config uses, unused
    # entries stay zero.
    dscale = torch.zeros(triton.cdiv(n_q, MIN_DOT), 2, dtype=acc, device=q.device)
    args = (
        q, k, scale_t, row_lse, g_row, col_lse, g_col, dq, dk, dscale, n_q, n_k, dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1),
    )
    if config is None and autotuning():
        grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]),)  # noqa: E731
        _lse_backward_autotuned[grid](*args, HAS_COL=has_col, BLOCK_D=block_d(dim), **opts)
    else:
        cfg = pick_config(config, DEFAULT_CONFIG)
        _lse_backward_kernel[(triton.cdiv(n_q, cfg.block_m),)](
            *args, HAS_COL=has_col, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d(dim, cfg.max_block_d),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts,
        )
    sums = dscale.sum(dim=0)
    return sums[0], sums[1]
