"""infcl's kernels compiled for one GPU target: the public calls ``cal_inf_loss(symmetric=True)`` and
``cal_siglip_loss`` with ``backend="triton"`` run forward and backward compile-only (:mod:`.driver`), so the
kernels, their default configs and their launch grids are exactly what the API launches; one row per
kernel, with what is counted in it (:mod:`.counts`, :mod:`.score_layout`) and modelled of it
(:mod:`.resources`, :mod:`.traffic`)."""

import contextlib
import hashlib
import math
from typing import Dict, List, Optional, Tuple

from .counts import compiled_figures
from .driver import triton_compile
from .infcl_internals import score_lines, tile_overrides, without_positives
from .matrix import BATCHES, DIM, ENTRIES
from .resources import LIMITS, add_launch
from .score_layout import mma_instruction, score_mma_layouts
from .traffic import modelled_bytes_flops, per_entry_model


def report_target(
    arch: int,
    dtype: str,
    precision: str,
    dim: int = DIM,
    batches=BATCHES,
    entries=ENTRIES,
    tiles: Optional[Dict[str, Tuple[int, ...]]] = None,
    no_positive: bool = False,
    sms: Optional[int] = None,
    options: Optional[Dict] = None,
) -> List[Dict]:
    """Compile both losses' calls for ``arch`` at each batch of ``batches`` (with ``tiles`` in place of the
    default configs, and with ``no_positive`` as :func:`without_positives`) on a stand-in GPU of ``sms`` SMs
    (default: the target's flagship); one row per kernel. ``options``: more of cal_inf_loss's options, as
    :class:`triton_compile.Call` fields (``masks``, ``multi_positive``, ``label_smoothing``). Runs in a worker
    process (:func:`triton_compile.init_worker`)."""
    with tile_overrides(arch, dtype, precision, tiles or {}):
        with without_positives() if no_positive else contextlib.nullcontext():
            sms = sms or LIMITS[arch].sms
            return _report_target(arch, dtype, precision, dim, batches, entries, sms, options or {})


def _report_target(arch, dtype, precision, dim, batches, entries, sms, options) -> List[Dict]:
    import torch

    rows: Dict[Tuple[str, str], Dict] = {}
    elt = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for batch in batches:
        for entry in entries:
            softmax = entry == "cal_inf_loss"
            call = triton_compile.Call(
                arch, entry, dtype, precision, dim, batch, batch, symmetric=softmax, **(options if softmax else {})
            )
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
            with triton_compile.compile_only(arch, sms=sms) as (compiled, start):
                q, k, labels = triton_compile._inputs(call)
                triton_compile.call_loss(call, q, k, labels, *triton_compile._params()).backward()
                launches = list(zip(compiled[start:], triton_compile._RECORDER.launches[start:]))
            for (fn, kernel, log), launch in launches:
                name = triton_compile._kernel_name(fn)
                if name == "guide_label_scores":  # a guide's thresholds, one pass per block before the loss
                    continue
                key = (entry, name)
                if key not in rows:
                    # dq / dk: grid axis 1 is the D slices, each recomputing S (the same at every B)
                    slices = launch["grid"][1] if name in ("dq", "dk") else 1
                    rows[key] = _kernel_row(arch, dtype, precision, dim, name, fn, kernel, log, launch, elt, slices)
                add_launch(rows[key], batch, launch, sms)
    return list(rows.values())


def _dtype_label(dtype: str, precision: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": f"fp32-{precision}"}.get(dtype, dtype)


def _config(kernel: str, c: Dict) -> str:
    out = f"{c['BLOCK_M']}x{c['BLOCK_N']} d{c['BLOCK_D']}"
    if c.get("ROW_TILES", 1) > 1:
        out = f"{c['ROW_TILES']}x " + out
    if "BLOCK_OUT" in c and kernel in ("dq", "dk"):
        out += f" out{c['BLOCK_OUT']}"
    return out


def _kernel_row(arch, dtype, precision, dim, name, fn, kernel, log, launch, elt, slices) -> Dict:
    entries = launch["BLOCK_M"] * launch["BLOCK_N"] * launch.get("ROW_TILES", 1)  # one pass of the tile loop
    usage = triton_compile._resources(fn, kernel, log, arch)
    figures = compiled_figures(arch, kernel, usage, math.ceil(dim / launch["BLOCK_D"]), entries)
    nbytes, flops = modelled_bytes_flops(name, launch, dim, elt)
    # The products' M (the MMA's row count): S and dq have BLOCK_M rows, dk's product has BLOCK_N.
    product_m = min(launch["BLOCK_M"], launch["BLOCK_N"]) if name == "dk" else launch["BLOCK_M"]
    layouts = score_mma_layouts(kernel.asm["ttgir"], score_lines())
    row = {
        "target": f"sm_{arch}",
        "dtype": _dtype_label(dtype, precision),
        "D": dim,
        "kernel": name,
        "config": _config(name, launch),
        "min_mma_m": product_m,
        "calls": 1,
        # S's MMA ops: their instruction, how many distinct layouts (1: the first chunk's is the others'), and
        # a digest of the layouts to compare across kernels (the forward's, dq's and dk's S must be one).
        "s_mma": " | ".join(mma_instruction(layout) for layout in layouts) or "-",
        "s_layouts": len(layouts),
        "s_layout": hashlib.sha1("\n".join(layouts).encode()).hexdigest()[:12] if layouts else "-",
        **figures,
    }
    return {**row, **per_entry_model(row, nbytes, flops, entries, slices)}
