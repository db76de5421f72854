"""The traffic model: the operand bytes one tile loads and the flops it runs, from the launch's block sizes
(infcl's kernels) or from the source (Inf-CL's), and what they come to per S entry: the figures the time
model's tensor and L2 terms read. Assumes nothing outlives a tile in L1 or shared memory except an operand
held in registers (D <= resident_d); per-row vectors (stats, positives) are left out."""

import math
from typing import Dict, Tuple


def modelled_bytes_flops(kernel: str, c: Dict, dim: int, elt: int) -> Tuple[float, float]:
    """(operand bytes loaded, flops) per tile of ``kernel`` with block sizes ``c`` (the launch's constexprs)."""
    bm, bn, bd = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_D"]
    one_chunk = dim <= bd
    s_flops = 2.0 * bm * bn * dim
    if kernel in ("forward", "siglip_forward"):
        # symmetric / one-chunk forward: q held in registers only when D is one chunk; a pair of row blocks
        # (ROW_TILES 2) shares each k chunk
        rt = c.get("ROW_TILES", 1)
        return elt * dim * (bn + (0 if one_chunk else rt * bm)), rt * s_flops
    if kernel in ("dq", "dk"):
        width = c.get("BLOCK_OUT", dim)
        owned, other = (bm, bn) if kernel == "dq" else (bn, bm)
        s_bytes = elt * dim * (other + (0 if one_chunk else owned))
        product_bytes = 0 if one_chunk else elt * other * width  # the product's slice of the other side
        return s_bytes + product_bytes, s_flops + 2.0 * bm * bn * min(width, dim)
    if kernel == "siglip_backward":
        s_bytes = elt * dim * (bn + (0 if one_chunk else bm))
        product_bytes = 0 if one_chunk else elt * bn * dim + 2 * 4 * bm * dim  # other tile + fp32 RMW of grad
        return s_bytes + product_bytes, 2 * s_flops
    raise ValueError(f"no traffic model for kernel {kernel!r}")


def inf_cl_bytes_flops(kernel: str, bm: int, bn: int, dim: int, elt: int) -> Tuple[float, float]:
    """(operand bytes loaded, flops) per 64x64 tile of Inf-CL's kernels, from its source (inf_cl/flash.py):
    num_stages = 1 and a loop over heads, so q's and k's head slices are loaded for every tile (nothing
    resident); dq / dk load the other side's slices again for the product and read-modify-write the fp32
    gradient slice of the owned rows in every tile."""
    s_bytes, s_flops = elt * dim * (bm + bn), 2.0 * bm * bn * dim
    if kernel == "inf-cl forward":
        return s_bytes, s_flops
    if kernel in ("inf-cl dq", "inf-cl dk"):
        owned, other = (bm, bn) if kernel == "inf-cl dq" else (bn, bm)
        return s_bytes + elt * dim * other + 2 * 4 * owned * dim, 2 * s_flops
    raise ValueError(f"no traffic model for kernel {kernel!r}")


def per_entry_model(row: Dict, nbytes: float, flops: float, entries: int, slices: int) -> Dict:
    """The modelled figures of one pass of the tile loop (``nbytes`` operand bytes, ``flops``) per S entry,
    and over every D slice: what the time model (:func:`bench.static.time_model.model_kernel`) reads."""
    per_entry = row["instr_per_entry"]
    return {
        "tile_bytes": nbytes,
        "flop_per_byte": flops / nbytes if nbytes else math.inf,
        "slices": slices,
        "instr_per_entry_all_slices": per_entry * slices if per_entry is not None else None,
        "flops_per_entry": flops * slices / entries,
        "l2_bytes_per_entry": nbytes * slices / entries,
    }
