"""The opt-in autotuner (INFCL_AUTOTUNE=1): its key (:func:`autotune_bucket`), its search space per
(architecture family, operand class, ragged D) (:func:`autotune_space`, :func:`neighbours`) and the lazily built
``triton.autotune`` wrapper (:func:`lazy_autotune`)."""

import copy
import functools
from dataclasses import replace
from typing import Dict, List, Tuple

import triton

from .configs import TileConfig, operand_class_of, ragged_d
from .kernel_args import even_blocks
from .target import target_family

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


def _as_triton(tile: TileConfig) -> triton.Config:
    # EVEN_M / EVEN_N depend on the block sizes, so they travel with the config: False (masked, right
    # for any size) in the declared space, set per call by the prune step (:func:`autotune_space`).
    return triton.Config(
        {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "EVEN_M": False, "EVEN_N": False}, **tile.launch_options()
    )


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
        operand_class = operand_class_of(q.dtype, args.get("PRECISION"))
        key = (target_family(), operand_class, ragged_d(args["D"], operand_class))
        out = []
        for config, owner in zip(configs, owners):
            if owner == key and any(config is c for c in candidates):
                config = copy.copy(config)
                config.kwargs = {
                    **config.kwargs,
                    **even_blocks(args["n_q"], args["n_k"], config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]),
                }
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
