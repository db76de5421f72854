"""The S tile's MMA, read from the TTGIR: the layouts of the MMA ops that build S in one compiled kernel, and a
short name for each one's instruction. The forward's, dq's and dk's S must come from one layout (the
bit-identical S the backward relies on)."""

import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# The MMA ops of Triton's GPU dialect.
TTGIR_DOT = re.compile(r"\b(tt\.dot|ttng\.(?:warp_group_dot|tc_gen5_mma))\b")
TTGIR_ALIAS = re.compile(r"^(#[\w.]+) = (.*)$", re.M)
TTGIR_LOC = re.compile(r"loc\((#loc\d*)\)\s*$")
# What of an operand's type is not the MMA's layout: buffers' mutability and their multi-buffered allocation
# shape (pipeline stages), and tcgen05's completion barrier.
TTGIR_NOT_LAYOUT = re.compile(r", mutable|, \d+(?:x\d+)+(?=>)")
TTGIR_BARRIER = re.compile(r",\s*!ttg\.memdesc<1xi64[^>]*>")


def _source_location(loc: str, locs: Dict[str, str]) -> Optional[Tuple[str, int]]:
    """(file name, line) of the innermost call site of TTGIR location ``loc`` (an alias such as ``#loc12``)."""
    for _ in range(64):  # location chains are short; a cycle would be malformed IR
        text = locs.get(loc)
        if text is None:
            return None
        match = re.match(r'loc\("([^"]+)":(\d+):\d+\)', text)
        if match:
            return Path(match.group(1)).name, int(match.group(2))
        # callsite(callee at caller) and named locations "name"(#locN): follow the first location inside
        inner = re.search(r"(#loc\d*)", text[4:])
        if inner is None:
            return None
        loc = inner.group(1)
    return None


def _expand_aliases(text: str, aliases: Dict[str, str]) -> str:
    """``text`` with every attribute alias (``#mma``, ``#shared1``, ``#tmem``; not locations) replaced by its
    definition, recursively (an operand layout names its parent MMA layout)."""
    for _ in range(8):
        expanded = re.sub(r"#(?!loc)[\w.]+\b", lambda m: aliases.get(m.group(0), m.group(0)), text)
        if expanded == text:
            break
        text = expanded
    return text


def score_mma_layouts(ttgir: str, score_lines: Tuple[str, range]) -> List[str]:
    """The layouts of the MMA ops that build S, one string per distinct layout: the op and its operand and
    result types with every layout alias expanded (the MMA version, warps per CTA and instruction shape, or
    the tensor-memory block; the operands' shared-memory or register layouts). S's ops are those whose source
    location is ``score_lines`` (file name, lines): :func:`infcl.kernels.score_tiles.score_dot`'s tl.dot, which
    every kernel's S comes from, first chunk and later ones alike; the products (``tile_dot``) are left out."""
    aliases = {name: value for name, value in TTGIR_ALIAS.findall(ttgir) if not name.startswith("#loc")}
    locs = {name: value for name, value in TTGIR_ALIAS.findall(ttgir) if name.startswith("#loc")}
    layouts = []
    for line in ttgir.splitlines():
        op, loc = TTGIR_DOT.search(line), TTGIR_LOC.search(line)
        if not op or not loc:
            continue
        where = _source_location(loc.group(1), locs)
        if where is None or where[0] != score_lines[0] or where[1] not in score_lines[1]:
            continue
        types = line[: loc.start()].rsplit(" : ", 1)[-1]
        types = TTGIR_NOT_LAYOUT.sub("", TTGIR_BARRIER.sub("", types))
        layout = f"{op.group(1).split('.')[-1]} {_expand_aliases(types, aliases)}".strip()
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def mma_instruction(layout: str) -> str:
    """A short name for the MMA instruction of a :func:`score_mma_layouts` layout: ``wgmma m64n64k16 8x1``
    (warps per CTA along M x N), ``mma.sync m16n8 1x8``, ``tcgen05 m64n32``."""
    tmem = re.search(r"blockM = (\d+), blockN = (\d+)", layout)
    if tmem:
        return f"tcgen05 m{tmem.group(1)}n{tmem.group(2)}"
    mma = re.search(r"versionMajor = (\d+).*?warpsPerCTA = \[(\d+), (\d+)\].*?instrShape = \[([\d, ]+)\]", layout)
    if not mma:
        return "?"
    version, warps = int(mma.group(1)), f"{mma.group(2)}x{mma.group(3)}"
    shape = [int(x) for x in mma.group(4).split(",")]
    if version == 3:  # instrShape [16, N, K] per warp: a warpgroup's wgmma is m64nNkK
        return f"wgmma m64n{shape[1]}k{shape[2]} {warps}"
    return f"mma.sync m{shape[0]}n{shape[1]} {warps}"
