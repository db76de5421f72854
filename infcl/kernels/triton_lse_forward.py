"""Forward phase: the row log-sum-exps of S = scale * q @ k.T, fused, without writing S.

Each program owns BLOCK_M rows of q and walks k in BLOCK_N blocks. For each block it builds the S tile
(looping over D in BLOCK_D chunks, see :func:`infcl.kernels.tiles.score_tile`) and folds it into a
running max ``m`` and a running sum ``l = sum_j exp(S[i, j] - m)`` (the online log-sum-exp: when the
max grows, ``l`` is rescaled by ``exp(m_old - m_new)``). Only ``lse = m + log(l)`` is written: [Bq].
Extra memory: the output vector and one scalar; the S tile lives in registers.

GEMM count: 1 GEMM-equivalent (2*Bq*Bk*D flops) per call. The symmetric loss's column log-sum-exps are
a second call with q and k swapped (:class:`infcl.backends.triton_backend.TritonBackend`), so the
forward costs 1 GEMM for one direction and 2 for the symmetric loss. A single pass would need per-row-
block partial column LSEs, an O(Bk * Bq / BLOCK_M) buffer, which we do not allow.

Inputs: q [Bq, D], k [Bk, D] of one dtype among float32/bfloat16/float16/float64, any strides; the
result is float32 (float64 for float64 inputs). NaN in a row gives NaN in that row's LSE.
"""

import torch
import triton
import triton.language as tl

from .tiles import MIN_DOT, TileConfig, autotuning, block_d, launch_options, pick_config, score_tile


@triton.jit
def _lse_forward_kernel(
    q_ptr, k_ptr, scale_ptr, lse_ptr,
    n_q, n_k, D,
    stride_q0, stride_q1, stride_k0, stride_k1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= MIN_DOT and BLOCK_N >= MIN_DOT and BLOCK_D >= MIN_DOT)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    scale = tl.load(scale_ptr)  # a tensor, not a launch argument: Python floats would be cast to fp32
    run_max = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
    run_sum = tl.zeros([BLOCK_M], dtype=ACC)
    for n0 in range(0, n_k, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        raw = score_tile(
            q_ptr, k_ptr, rows, cols, n_q, n_k, D, stride_q0, stride_q1, stride_k0, stride_k1,
            BLOCK_M, BLOCK_N, BLOCK_D, ACC, UPCAST, PRECISION,
        )
        # Columns past Bk contribute exp(-inf) = 0; every block has at least one real column, so the
        # new max is finite for finite inputs.
        s = tl.where(cols[None, :] < n_k, raw * scale, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(s, axis=1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), axis=1)
        run_max = new_max
    tl.store(lse_ptr + rows, run_max + tl.log(run_sum), mask=rows < n_q)


# The config used unless INFCL_AUTOTUNE=1. Not tuned on a GPU yet (none was available): the fused-
# attention tutorial's forward shape, halved in M so a 64-wide feature chunk of q stays in registers.
DEFAULT_CONFIG = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
# The search space under INFCL_AUTOTUNE=1, keyed by D (and, implicitly, the input dtypes).
AUTOTUNE_CONFIGS = [
    TileConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
    for bm in (64, 128)
    for bn in (32, 64, 128)
    for w in (4, 8)
    for s in (2, 3)
]
_lse_forward_autotuned = triton.autotune(configs=[c.as_triton() for c in AUTOTUNE_CONFIGS], key=["D"])(
    _lse_forward_kernel
)


def lse_forward(q: torch.Tensor, k: torch.Tensor, scale: float, precision=None, config: TileConfig = None):
    """Row log-sum-exps of scale * q @ k.T: [Bq] in the accumulation dtype.

    ``precision`` picks tl.dot's input precision for float32 inputs ("ieee", "tf32"; None follows
    torch.backends.cuda.matmul.allow_tf32). ``config`` overrides :data:`DEFAULT_CONFIG` (under the
    interpreter: :data:`infcl.kernels.tiles.INTERPRETER_CONFIG`); with INFCL_AUTOTUNE=1 on a GPU and no
    ``config`` the kernel is autotuned.
    """
    opts = launch_options(q.dtype, precision)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_q, dim = q.shape
    n_k = k.shape[0]
    lse = torch.empty(n_q, dtype=acc, device=q.device)
    scale_t = torch.full((1,), scale, dtype=acc, device=q.device)
    args = (q, k, scale_t, lse, n_q, n_k, dim, q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    if config is None and autotuning():
        grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]),)  # noqa: E731
        _lse_forward_autotuned[grid](*args, BLOCK_D=block_d(dim), **opts)
        return lse
    cfg = pick_config(config, DEFAULT_CONFIG)
    _lse_forward_kernel[(triton.cdiv(n_q, cfg.block_m),)](
        *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d(dim, cfg.max_block_d),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts,
    )
    return lse
