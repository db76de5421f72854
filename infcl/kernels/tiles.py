"""What both Triton kernel phases share: strided tile loads, the S tile, the tile product, launch options.

The S tile is ``raw = q[rows] @ k[cols].T`` (unscaled), built by looping over the feature dimension
in BLOCK_D chunks, so every D works: a chunk past D is masked to zero and adds nothing. All offsets are
int64 (rows * stride can exceed 2**31 for large batches) and every load is masked.

Launch options, chosen on the host and handed to the kernels as constexprs:
- ACC: the accumulation dtype (tl.float64 for float64 inputs, else tl.float32).
- PRECISION: tl.dot's input precision for float32 inputs, "tf32" or "ieee" (default from
  ``torch.backends.cuda.matmul.allow_tf32``); always "ieee" for other dtypes and under the interpreter.
- UPCAST: True only under TRITON_INTERPRET=1 for bfloat16/float16 inputs. Triton 3.9's interpreter
  runs tl.dot with numpy on the raw storage, and bfloat16 is stored as uint16, so a bf16 product comes
  out as an integer product (off by ~1e10). Upcasting both operands to float32 first is exact and
  equals what the GPU's tensor cores compute (exact products, float32 sums), so the interpreter tests
  the GPU's numerics; on a GPU the native low-precision tl.dot is kept.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# tl.dot needs every side of both operands to be at least 16 (the MMA instruction shapes).
MIN_DOT = 16
# Widest feature chunk on a GPU: a q chunk, a k chunk and the fp32 S tile must fit in registers;
# larger D loops over chunks.
MAX_BLOCK_D = 64
# Full autotuning is opt-in: it benchmarks every config on the first call of each key (seconds).
AUTOTUNE_ENV = "INFCL_AUTOTUNE"
DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")


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


@dataclass(frozen=True)
class TileConfig:
    """Block sizes and launch parameters of one kernel. BLOCK_D follows D up to ``max_block_d``
    (see :func:`block_d`)."""

    block_m: int
    block_n: int
    max_block_d: int = MAX_BLOCK_D
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n", "max_block_d"):
            value = getattr(self, name)
            if value < MIN_DOT or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= {MIN_DOT}, got {value}")

    def as_triton(self) -> triton.Config:
        return triton.Config(
            {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}, num_warps=self.num_warps, num_stages=self.num_stages
        )


# Under the interpreter a kernel costs ~1 ms of Python per tile operation whatever the tile's size,
# while the flops are numpy's: few big tiles run fastest (B=1000, D=1000 takes minutes with the GPU's
# 64-wide tiles, about a second with these). Tests check the GPU tiling explicitly.
INTERPRETER_CONFIG = TileConfig(block_m=256, block_n=256, max_block_d=1024)


def block_d(dim: int, max_block_d: int = MAX_BLOCK_D) -> int:
    """Feature chunk: D rounded up to a power of two, at least MIN_DOT, at most ``max_block_d``."""
    return min(max(triton.next_power_of_2(dim), MIN_DOT), max_block_d)


def pick_config(config, default: TileConfig) -> TileConfig:
    """The caller's config, else the interpreter's big tiles under TRITON_INTERPRET=1, else ``default``."""
    if config is not None:
        return config
    return INTERPRETER_CONFIG if INTERPRETED else default


def launch_options(dtype: torch.dtype, precision=None) -> dict:
    """The dtype-dependent constexprs (ACC, UPCAST, PRECISION) for inputs of ``dtype``."""
    if precision is not None and precision not in DOT_PRECISIONS:
        raise ValueError(f"precision must be None or one of {DOT_PRECISIONS}, got {precision!r}")
    if dtype == torch.float32 and not INTERPRETED:
        if precision is None:
            precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        precision = "ieee"
    return {
        "ACC": tl.float64 if dtype == torch.float64 else tl.float32,
        "UPCAST": INTERPRETED and dtype in (torch.bfloat16, torch.float16),
        "PRECISION": precision,
    }


@triton.jit
def load_tile(ptr, rows, cols, n_rows, n_cols, stride_r, stride_c):
    """The [len(rows), len(cols)] tile ptr[rows, cols] of an (n_rows x n_cols) strided matrix, 0 outside."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)


@triton.jit
def tile_dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b; under the interpreter low-precision operands are upcast first (see module doc)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def score_tile(
    q_ptr, k_ptr, rows, cols, n_q, n_k, D, stride_q0, stride_q1, stride_k0, stride_k1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """raw[BLOCK_M, BLOCK_N] = q[rows] @ k[cols].T in ACC, summed over D in BLOCK_D chunks (1 GEMM)."""
    raw = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        feats = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        q_tile = load_tile(q_ptr, rows, feats, n_q, D, stride_q0, stride_q1)  # [BLOCK_M, BLOCK_D]
        k_tile_t = load_tile(k_ptr, feats, cols, D, n_k, stride_k1, stride_k0)  # [BLOCK_D, BLOCK_N]
        raw = tile_dot(q_tile, k_tile_t, raw, UPCAST, PRECISION)
    return raw
