"""Every infcl internal the static report reaches into, in one place (the rest of bench.static reads only the
public API and the compiled artefacts): where S's MMA op comes from in the source (:func:`score_lines`), the
tiling functions ``--tile`` replaces (:func:`tile_overrides`), and the positives' branch the no-positive
pass folds away (:func:`without_positives`)."""

import contextlib
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Dict, Tuple


def score_lines() -> Tuple[str, range]:
    """(file name, line range) of :func:`infcl.kernels.score_tiles.score_dot`: where S's MMA op comes from."""
    import inspect

    from infcl.kernels import score_tiles as tiles

    source, start = inspect.getsourcelines(tiles.score_dot.fn)
    return Path(inspect.getsourcefile(tiles.score_dot.fn)).name, range(start, start + len(source))


# Kernels whose default config ``--tile`` can replace ("siglip": both sigmoid kernels share one tiling).
TILE_KERNELS = ("forward", "dq", "dk", "siglip")


def parse_tile(spec: str) -> Tuple[str, Tuple[int, ...]]:
    """``KERNEL=MxN[:warps[:stages[:block_out]]]`` -> (kernel, TileConfig fields), e.g. ``dk=64x64:8:3:256``."""
    kernel, _, config = spec.partition("=")
    match = re.fullmatch(r"(\d+)x(\d+)((?::\d+){0,3})", config)
    if kernel not in TILE_KERNELS or not match:
        raise ValueError(
            f"--tile must be KERNEL=MxN[:warps[:stages[:block_out]]] with KERNEL in {TILE_KERNELS}, got {spec!r}"
        )
    rest = [int(x) for x in match.group(3).split(":")[1:]]
    return kernel, (int(match.group(1)), int(match.group(2)), *rest)


@contextlib.contextmanager
def tile_overrides(arch: int, dtype: str, precision: str, tiles: Dict[str, Tuple[int, ...]]):
    """The plain-loss configs of ``arch`` and the dtype's operand class, at whole-chunk and ragged D alike,
    replaced by ``tiles`` (parse_tile's values; unnamed fields keep the default's): the functions of
    :mod:`infcl.kernels.tiling` wrapped for that (arch, class), restored on exit (workers run several jobs). A
    candidate for one kernel alone gives it another S tile than the others'."""
    import torch

    from infcl.kernels import sigmoid, tiling
    from infcl.kernels.configs import TileConfig, operand_class_of

    operand_class = operand_class_of(getattr(torch, dtype), precision)
    functions = {"forward": "forward_config", "dq": "dq_config", "dk": "dk_config"}
    saved = {name: getattr(tiling, function) for name, function in functions.items()}
    saved_siglip = sigmoid.DEFAULT_TILINGS[operand_class]
    names = [f.name for f in fields(TileConfig)]

    def config(default, values):
        return replace(default, **dict(zip(names, values)))

    def overridden(default_of, values):
        def config_of(arch_, operand_class_, ragged=False, masks=None):
            default = default_of(arch_, operand_class_, ragged, masks)
            if (arch_, operand_class_) != (arch, operand_class) or masks is not None:
                return default
            return config(default, values)

        return config_of

    try:
        for name, values in tiles.items():
            if name == "siglip":
                cfg = config(saved_siglip.forward, values)
                sigmoid.DEFAULT_TILINGS[operand_class] = replace(saved_siglip, forward=cfg, dq=cfg, dk=cfg)
            else:
                setattr(tiling, functions[name], overridden(saved[name], values))
        yield
    finally:
        for name, function in functions.items():
            setattr(tiling, function, saved[name])
        sigmoid.DEFAULT_TILINGS[operand_class] = saved_siglip


@contextlib.contextmanager
def without_positives():
    """The softmax kernels and the chunked SigLIP pass compiled for a tile that holds no positive, as all but one
    or two column blocks per row block do with the positives on the diagonal: ``holds_positive`` (tile_stats.py)
    replaced, in the kernels' modules, by a constant False, so the uniform branch around the positives' work folds
    away. (The real kernels' listing holds that branch's body, and the counts take it as run on every tile.)
    Only in a process of its own: Triton keys and checks a compiled kernel by the globals it used."""
    import triton

    from infcl.kernels import chunked_sigmoid, chunked_softmax, softmax_forward
    from infcl.kernels import softmax_backward_tiles as backward_tiles
    from infcl.kernels import softmax_forward_tiles as forward_tiles

    @triton.jit
    def never(lo, hi, c0, BLOCK_N, BRANCH):
        return False

    modules = (softmax_forward, forward_tiles, backward_tiles, chunked_softmax, chunked_sigmoid)
    saved = [module.holds_positive for module in modules]
    for module in modules:
        module.holds_positive = never
    try:
        yield
    finally:
        for module, fn in zip(modules, saved):
            module.holds_positive = fn
