"""What is counted in one compiled kernel: its MMA instructions (PTX and SASS), and its tile loop's
instructions, MUFU and shuffles per S entry, read from the SASS (the PTX where cuobjdump cannot disassemble
the cubin); with ptxas' registers and spills, Triton's shared memory, and the occupancy they allow."""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .resources import occupancy


@dataclass(frozen=True)
class Dialect:
    """How to read one listing: its labels, branches, and the instructions counted."""

    label: "re.Pattern"  # a line that defines a label (group 1: its name)
    branch: "re.Pattern"  # a branch instruction (group 1: the target label)
    mufu: "re.Pattern"
    ex2: "re.Pattern"
    shfl: "re.Pattern"
    store: "re.Pattern"  # a store to global memory
    bar: "re.Pattern"  # a CTA barrier
    load: "re.Pattern"  # a load from global memory
    skip: "re.Pattern"  # lines that are not instructions


SASS = Dialect(
    label=re.compile(r"^(LBB\d+):$"),
    branch=re.compile(r"\bBRA\s+(LBB\d+)"),
    mufu=re.compile(r"\bMUFU\."),
    ex2=re.compile(r"\bMUFU\.EX2\b"),
    shfl=re.compile(r"\bSHFL\."),
    store=re.compile(r"\b(STG|RED|ATOM)\."),
    bar=re.compile(r"\bBAR\.(SYNC|RED|ARV)"),
    load=re.compile(r"\b(LDG|LDGSTS)\b"),
    skip=re.compile(r"^(Function:|\s*$)"),
)
PTX = Dialect(
    label=re.compile(r"^(\$L__\w+):"),
    branch=re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);"),
    mufu=re.compile(r"\b(ex2|lg2|rcp|rsqrt|sqrt|sin|cos|tanh)\.approx"),
    ex2=re.compile(r"\bex2\.approx"),
    shfl=re.compile(r"\bshfl\.sync"),
    store=re.compile(r"\b(st|red|atom)\.global"),
    bar=re.compile(r"\b(bar|barrier)\.sync"),
    load=re.compile(r"\b(ld\.global|cp\.async)"),
    skip=re.compile(r"^\s*($|//|\.|\{|\}|\)|\(|@?\$L__|[A-Za-z_.]+:$)"),
)
# MMA instructions and their shapes, in PTX and in SASS.
PTX_MMA_KIND = re.compile(r"\b(wgmma\.mma_async\S*|tcgen05\.mma\S*|mma\.sync\S*)")
SASS_MMA = re.compile(r"\b(HGMMA\.\w+|UTC\w*MMA\S*|HMMA\.\w+|DMMA\.\w+)")


def _instructions(listing: str, dialect: Dialect) -> Tuple[List[str], Dict[str, int]]:
    """(instruction lines, label -> index of the next instruction)."""
    instrs, labels = [], {}
    for line in listing.splitlines():
        match = dialect.label.match(line.strip())
        if match:
            labels[match.group(1)] = len(instrs)
        elif not dialect.skip.match(line):
            instrs.append(line.strip())
    return instrs, labels


def tile_loop_counts(listing: str, dialect: Dialect, n_chunks: int, peeled: bool = True) -> Optional[Dict[str, float]]:
    """Warp instructions, MUFU and shuffles one pass of the tile loop issues (inner feature-chunk loops
    counted ``n_chunks - 1`` times, or ``n_chunks`` if they store to global memory or if the source does not
    peel the first chunk, ``peeled=False``), and the loop's static size; None when no loop holds an
    exponential."""
    instrs, labels = _instructions(listing, dialect)
    loops = []  # (start, end inclusive) of every backward branch
    for i, line in enumerate(instrs):
        match = dialect.branch.search(line)
        if match and match.group(1) in labels and labels[match.group(1)] <= i:
            loops.append((labels[match.group(1)], i))

    def inner(loop):
        return [o for o in loops if o != loop and loop[0] <= o[0] and o[1] <= loop[1]]

    def direct(loop):
        covered = {i for o in inner(loop) for i in range(o[0], o[1] + 1)}
        return [i for i in range(loop[0], loop[1] + 1) if i not in covered]

    def count(lines, pattern):
        return sum(1 for i in lines if pattern.search(instrs[i]))

    scored = [(count(direct(loop), dialect.ex2), -(loop[1] - loop[0]), loop) for loop in loops]
    scored = [s for s in scored if s[0] > 0]
    if not scored:
        return None
    tile = max(scored)[2]
    # Each index weighted by how many times it runs per tile: 1, times the trips of the innermost
    # nested loop around it (nested loops in the tile loop are feature-chunk loops, one level deep).
    weight = {i: 1.0 for i in range(tile[0], tile[1] + 1)}
    for loop in inner(tile):
        body = range(loop[0], loop[1] + 1)
        trips = n_chunks if count(body, dialect.store) or not peeled else n_chunks - 1
        for i in body:
            weight[i] = max(trips, 0)

    def weighted(pattern=None):
        return sum(w for i, w in weight.items() if pattern is None or pattern.search(instrs[i]))

    return {
        "static": tile[1] - tile[0] + 1,
        "instr": weighted(),
        "mufu": weighted(dialect.mufu),
        "ex2": weighted(dialect.ex2),
        "shfl": weighted(dialect.shfl),
        "bar": weighted(dialect.bar),
        "loads": weighted(dialect.load),
    }


def mma_kinds(ptx: str, sass: Optional[str]) -> Dict[str, str]:
    """{"mma_ptx": "wgmma.m64n64k16:12 ...", "mma_sass": "HGMMA.64x64x16:12 ...", "mma_sync": count in the PTX,
    "wgmma": count of wgmma/tcgen05 in the PTX}."""

    def tally(names):
        out: Dict[str, int] = {}
        for name in names:
            out[name] = out.get(name, 0) + 1
        return " ".join(f"{k}:{v}" for k, v in sorted(out.items()))

    ptx_names = []
    for match in PTX_MMA_KIND.finditer(ptx):
        parts = match.group(1).split(".")
        shape = next((p for p in parts if re.fullmatch(r"m\d+n\d+k\d+", p)), "")
        head = "wgmma" if parts[0] == "wgmma" else ".".join(parts[:2])
        ptx_names.append(f"{head}.{shape}" if shape else head)
    sass_names = [m.group(1).rstrip(";,") for m in SASS_MMA.finditer(sass)] if sass else []
    return {
        "mma_ptx": tally(ptx_names),
        "mma_sass": tally(sass_names) if sass is not None else "n/a",
        "mma_sync": sum(1 for n in ptx_names if n.startswith("mma.sync")),
        "async_mma": sum(1 for n in ptx_names if n.startswith(("wgmma", "tcgen05"))),
    }


def compiled_figures(arch: int, kernel, usage: Dict, n_chunks: int, entries: int, peeled: bool = True) -> Dict:
    """What is read from one compiled kernel: its MMAs, registers, spills, shared memory (``usage``: ptxas' and
    Triton's figures), occupancy and its tile loop's counts per S entry (``entries``: the S entries one pass of
    the tile loop covers)."""
    ptx = kernel.asm["ptx"]
    try:
        sass = kernel.asm["sass"]
    except Exception:  # a cuobjdump that does not know the target: count the PTX
        sass = None
    loop = tile_loop_counts(sass, SASS, n_chunks, peeled) if sass else tile_loop_counts(ptx, PTX, n_chunks, peeled)
    warps = kernel.metadata.num_warps
    per_entry = 32 * warps / entries
    ctas, limiter = occupancy(usage["regs"], warps, usage["smem"], arch)
    return {
        "warps": warps,
        "stages": kernel.metadata.num_stages,
        **mma_kinds(ptx, sass),
        "listing": "sass" if sass else "ptx",
        "loop_static": loop["static"] if loop else None,
        "instr_per_tile": loop["instr"] if loop else None,
        "instr_per_entry": loop["instr"] * per_entry if loop else None,
        "mufu_per_entry": loop["mufu"] * per_entry if loop else None,
        "ex2_per_entry": loop["ex2"] * per_entry if loop else None,
        "shfl_per_entry": loop["shfl"] * per_entry if loop else None,
        # barriers and global loads per pass of the tile loop (per warp: a barrier stops every warp of the CTA)
        "bar_per_tile": loop["bar"] if loop else None,
        "loads_per_tile": loop["loads"] if loop else None,
        "regs": usage["regs"],
        "spill_bytes": usage["spill_bytes"],
        "smem": usage["smem"],
        "smem_limit": usage["smem_limit"],
        "ctas_per_sm": ctas,
        "cta_limiter": limiter,
    }
