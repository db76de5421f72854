"""``python -m bench.static``: a static performance report of the Triton kernels, compiled for GPU targets
on a machine without a GPU.

For each target (sm_90, sm_80, sm_100 where the wheel's ptxas knows it) and operand type, the public calls
``cal_inf_loss(symmetric=True)`` and ``cal_siglip_loss`` with ``backend="triton"`` run forward and
backward compile-only (``tests/helpers/triton_compile.py``: a stand-in driver names the target, every launch
compiles instead of running), at D = 512 and B = 16384 and 65536, so the kernels, their default configs and
their launch grids are exactly what the API launches. One row per (target, dtype, kernel): softmax
``forward``, ``dq``, ``dk``; ``siglip_forward``, ``siglip_backward``.

What is read from the compiled artefacts (counted, not run):

- ``mma``: the MMA instructions in the PTX (``wgmma`` / ``tcgen05`` / ``mma.sync``, with their shapes) and
  in the SASS (``HGMMA`` / ``UTC*MMA`` / ``HMMA``), each with its static count in the kernel.
- ``regs``, ``spill``: ptxas -v (the wheel's ptxas, Triton's flags); ``smem``: Triton's metadata.
- ``instr/entry``, ``mufu/entry``, ``shfl/entry``: instructions per S entry, counted in the SASS (the PTX
  where cuobjdump cannot disassemble the cubin). The tile loop is the loop (a backward branch) holding the
  most MUFU.EX2 outside its own inner loops; a loop nested in it runs over feature chunks, counted
  ``cdiv(D, BLOCK_D) - 1`` times (the first chunk is peeled) or ``cdiv(D, BLOCK_D)`` times if it stores to
  global memory (the sigmoid backward's per-chunk gradient). Per entry = warp instructions per tile x 32
  lanes x warps / (BLOCK_M x BLOCK_N x ROW_TILES, the row blocks one pass walks): lane instructions per S
  entry, per D slice of dq / dk (``slices``: each slice recomputes S, so an S entry costs
  ``instr_per_entry_all_slices`` in all). Approximate: the
  software pipeliner's prologue and epilogue and the branches not taken are counted as in the listing. The
  ``*_no_pos`` columns ("no pos." in the table) count the softmax kernels compiled for a tile that holds no
  positive (:func:`without_positives`), the path all but one or two column blocks per row block take.

What is modelled (not read from the code):

- ``CTAs/SM``: from registers (65536 per SM, allocated per warp in units of 256), shared memory (per SM,
  plus 1 KiB reserved per CTA), warps (64 per SM) and 32 CTAs per SM: the smallest of the four, named.
- ``waves``: the launch grid the launcher planned (on a stand-in device with the target's SM count) over
  SMs x CTAs/SM, for B = 16384 and 65536.
- ``flop/byte``: the tile loop's flops (S, and the dq/dk product) over the operand bytes it loads per
  tile, assuming nothing outlives a tile in L1 or shared memory except an operand held in registers
  (D <= resident_d). Per-row vectors (stats, positives) are left out; the sigmoid backward's per-chunk
  fp32 read-modify-write of the gradient is in.

The time model (:func:`model_kernel`, printed after the table and written to ``<name>-model.csv``): per
launch at B = 32768 and 65536 (``--model-batches``), four terms from the figures above — tensor (flops per
S entry at the GEMM rate ``--tflops``, half that for tf32), issue (lane instructions per entry at
``--issue-per-clk`` per SM per clock), MUFU (at ``--mufu-per-clk``), L2 (modelled bytes per entry at
``--l2-tbs``) — times the last wave's tail; ``bound`` is the largest term (everything overlapped),
``serial`` the sum (nothing overlapped; issue and MUFU one term), the estimate: on the H100 it lands within
-6..+10% of the measured kernels, the bound 36-54% under (docs/benchmarks.md, "The time model"). Each
target's assumptions are a :class:`Device` (H100 SXM for sm_90; A100 and B200 scaled from it, unmeasured),
every field an option; ``--measured`` compares with per-kernel times, ``--from-csv`` reruns the model on a
stored report without compiling. Inf-CL's kernels are compiled and modelled the same way when ``inf_cl``
is installed (``--no-inf-cl``: not).

``--dims`` and ``--tile KERNEL=MxN[:warps[:stages[:block_out]]]`` (repeatable) report other feature dims
and candidate configs, e.g. ``--targets 90 --dims 512,1000 --tile dq=64x64 --tile dk=64x64 --name try``.

Writes a table (stdout), bench/results/static.csv, static-model.csv and static.png (``--no-plot``: no plot). Figures are
reported, not asserted; the structural checks (no mma.sync where every product's M >= 64 on sm_90, no
spills, shared memory within the limit) are tests/test_static_report.py.
"""

import argparse
import concurrent.futures
import contextlib
import csv
import hashlib
import math
import multiprocessing
import re
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

TESTS = Path(__file__).resolve().parent.parent / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
from helpers import triton_compile  # noqa: E402  (the compile-only driver, shared with the API compile check)

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
TARGETS = (90, 80, 100)
DIM = 512
BATCHES = (16384, 32768, 65536)
# (dtype, precision): bf16 always; fp32 with tf32 products on request (--tf32).
BF16, TF32 = ("bfloat16", "ieee"), ("float32", "tf32")
ENTRIES = ("cal_inf_loss", "cal_siglip_loss")
WORKERS = 2


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resources of one target (the CUDA occupancy calculator's figures for the flagship part)."""

    sms: int  # SMs of the flagship part: A100 108, H100 SXM 132, B200 148
    smem: int  # shared memory per SM usable by CTAs, bytes
    regs: int = 65536
    warps: int = 64
    ctas: int = 32
    reg_unit: int = 256  # registers are allocated per warp in units of this many
    smem_reserved: int = 1024  # per CTA, taken by the system from sm_80 on


LIMITS = {80: SMLimits(108, 164 * 1024), 90: SMLimits(132, 228 * 1024), 100: SMLimits(148, 228 * 1024)}


def occupancy(regs: int, warps: int, smem: int, arch: int) -> Tuple[int, str]:
    """(CTAs per SM, the resource that limits it) for a kernel of ``regs`` registers per thread, ``warps``
    warps and ``smem`` bytes of shared memory."""
    lim = LIMITS[arch]
    regs_per_warp = math.ceil(regs * 32 / lim.reg_unit) * lim.reg_unit
    by = {
        "regs": (lim.regs // regs_per_warp) // warps,
        "smem": lim.smem // (smem + lim.smem_reserved),
        "warps": lim.warps // warps,
        "ctas": lim.ctas,
    }
    limiter = min(by, key=by.get)
    return by[limiter], limiter


# ---- reading the compiled code ----------------------------------------------------------------------


@dataclass(frozen=True)
class Dialect:
    """How to read one listing: its labels, branches, and the instructions counted."""

    label: "re.Pattern"  # a line that defines a label (group 1: its name)
    branch: "re.Pattern"  # a branch instruction (group 1: the target label)
    mufu: "re.Pattern"
    ex2: "re.Pattern"
    shfl: "re.Pattern"
    store: "re.Pattern"  # a store to global memory
    skip: "re.Pattern"  # lines that are not instructions


SASS = Dialect(
    label=re.compile(r"^(LBB\d+):$"),
    branch=re.compile(r"\bBRA\s+(LBB\d+)"),
    mufu=re.compile(r"\bMUFU\."),
    ex2=re.compile(r"\bMUFU\.EX2\b"),
    shfl=re.compile(r"\bSHFL\."),
    store=re.compile(r"\b(STG|RED|ATOM)\."),
    skip=re.compile(r"^(Function:|\s*$)"),
)
PTX = Dialect(
    label=re.compile(r"^(\$L__\w+):"),
    branch=re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);"),
    mufu=re.compile(r"\b(ex2|lg2|rcp|rsqrt|sqrt|sin|cos|tanh)\.approx"),
    ex2=re.compile(r"\bex2\.approx"),
    shfl=re.compile(r"\bshfl\.sync"),
    store=re.compile(r"\b(st|red|atom)\.global"),
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


# ---- the S tile's MMA, read from the TTGIR ------------------------------------------------------------
# The MMA ops of Triton's GPU dialect (Triton 3.2 spells the dialects out: triton_gpu, triton_nvidia_gpu).
TTGIR_DOT = re.compile(r"\b((?:tt|triton)\.dot|(?:ttng|triton_nvidia_gpu)\.(?:warp_group_dot|tc_gen5_mma))\b")
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


def score_lines() -> Tuple[str, range]:
    """(file name, line range) of :func:`infcl.kernels.score_tiles.score_dot`: where S's MMA op comes from."""
    import inspect

    from infcl.kernels import score_tiles as tiles

    source, start = inspect.getsourcelines(tiles.score_dot.fn)
    return Path(inspect.getsourcefile(tiles.score_dot.fn)).name, range(start, start + len(source))


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


# ---- one target ------------------------------------------------------------------------------------


def _config(kernel: str, c: Dict) -> str:
    out = f"{c['BLOCK_M']}x{c['BLOCK_N']} d{c['BLOCK_D']}"
    if c.get("ROW_TILES", 1) > 1:
        out = f"{c['ROW_TILES']}x " + out
    if "BLOCK_OUT" in c and kernel in ("dq", "dk"):
        out += f" out{c['BLOCK_OUT']}"
    return out


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
    """The softmax kernels compiled for a tile that holds no positive, as all but one or two column blocks
    per row block do with the positives on the diagonal: ``holds_positive`` (tile_stats.py) replaced, in the
    kernels' modules, by a constant False, so the uniform branch around the positives' work folds away.
    (The real kernels' listing holds that branch's body, and the counts take it as run on every tile.)
    Only in a process of its own: Triton keys and checks a compiled kernel by the globals it used."""
    import triton

    from infcl.kernels import softmax_backward_tiles as backward_tiles
    from infcl.kernels import softmax_forward
    from infcl.kernels import softmax_forward_tiles as forward_tiles

    @triton.jit
    def never(lo, hi, c0, BLOCK_N, BRANCH):
        return False

    modules = (softmax_forward, forward_tiles, backward_tiles)
    saved = [module.holds_positive for module in modules]
    for module in modules:
        module.holds_positive = never
    try:
        yield
    finally:
        for module, fn in zip(modules, saved):
            module.holds_positive = fn


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
) -> List[Dict]:
    """Compile both losses' calls for ``arch`` at each batch of ``batches`` (with ``tiles`` in place of the
    default configs, and with ``no_positive`` as :func:`without_positives`) on a stand-in GPU of ``sms`` SMs
    (default: the target's flagship); one row per kernel. Runs in a worker process
    (:func:`triton_compile.init_worker`)."""
    with tile_overrides(arch, dtype, precision, tiles or {}):
        with without_positives() if no_positive else contextlib.nullcontext():
            return _report_target(arch, dtype, precision, dim, batches, entries, sms or LIMITS[arch].sms)


def _report_target(arch, dtype, precision, dim, batches, entries, sms) -> List[Dict]:
    import torch

    rows: Dict[Tuple[str, str], Dict] = {}
    elt = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for batch in batches:
        for entry in entries:
            call = triton_compile.Call(
                arch, entry, dtype, precision, dim, batch, batch, symmetric=entry == "cal_inf_loss"
            )
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
            with triton_compile.compile_only(arch, sms=sms) as (compiled, start):
                q, k, labels = triton_compile._inputs(call)
                triton_compile.call_loss(call, q, k, labels, *triton_compile._params()).backward()
                launches = list(zip(compiled[start:], triton_compile._RECORDER.launches[start:]))
            for (fn, kernel, log), launch in launches:
                name = triton_compile._kernel_name(fn)
                key = (entry, name)
                if key not in rows:
                    # dq / dk: grid axis 1 is the D slices, each recomputing S (the same at every B)
                    slices = launch["grid"][1] if name in ("dq", "dk") else 1
                    rows[key] = _kernel_row(arch, dtype, precision, dim, name, fn, kernel, log, launch, elt, slices)
                _add_launch(rows[key], batch, launch, sms)
    return list(rows.values())


def _add_launch(row: Dict, batch: int, launch: Dict, sms: int) -> None:
    programs = math.prod(launch["grid"])
    row[f"programs@{batch}"] = programs
    row[f"waves@{batch}"] = programs / (sms * max(row["ctas_per_sm"], 1))


def _dtype_label(dtype: str, precision: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": f"fp32-{precision}"}.get(dtype, dtype)


def _compiled_figures(arch, fn, kernel, log, n_chunks: int, entries: int, peeled: bool = True) -> Dict:
    """What is read from one compiled kernel: its MMAs, registers, spills, shared memory, occupancy and its
    tile loop's counts per S entry (``entries``: the S entries one pass of the tile loop covers)."""
    usage = triton_compile._resources(fn, kernel, log, arch)
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
        "regs": usage["regs"],
        "spill_bytes": usage["spill_bytes"],
        "smem": usage["smem"],
        "smem_limit": usage["smem_limit"],
        "ctas_per_sm": ctas,
        "cta_limiter": limiter,
    }


def _per_entry_model(row: Dict, nbytes: float, flops: float, entries: int, slices: int) -> Dict:
    """The modelled figures of one pass of the tile loop (``nbytes`` operand bytes, ``flops``) per S entry,
    and over every D slice: what the time model (:func:`model_kernel`) reads."""
    per_entry = row["instr_per_entry"]
    return {
        "tile_bytes": nbytes,
        "flop_per_byte": flops / nbytes if nbytes else math.inf,
        "slices": slices,
        "instr_per_entry_all_slices": per_entry * slices if per_entry is not None else None,
        "flops_per_entry": flops * slices / entries,
        "l2_bytes_per_entry": nbytes * slices / entries,
    }


def _kernel_row(arch, dtype, precision, dim, name, fn, kernel, log, launch, elt, slices) -> Dict:
    entries = launch["BLOCK_M"] * launch["BLOCK_N"] * launch.get("ROW_TILES", 1)  # one pass of the tile loop
    figures = _compiled_figures(arch, fn, kernel, log, math.ceil(dim / launch["BLOCK_D"]), entries)
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
    return {**row, **_per_entry_model(row, nbytes, flops, entries, slices)}


# ---- Inf-CL's kernels, compiled the same way ---------------------------------------------------------
# inf_cl.flash's kernels by their names (triton_compile._kernel_name), as the rows name them.
INF_CL_KERNELS = {"prob_fwd": "inf-cl forward", "dq_prob_bwd": "inf-cl dq", "dk_prob_bwd": "inf-cl dk"}
# Inf-CL's symmetric loss is two calls, one per direction (bench.methods.inf_cl_loss): each kernel runs twice.
INF_CL_CALLS = 2


def kernel_label(name: str) -> str:
    """The report's name of a kernel from its function name (``_dq_kernel`` -> ``dq``, Inf-CL's
    ``_dq_prob_bwd_kernel`` -> ``inf-cl dq``): profiler rows and compiled rows meet on it."""
    name = name.strip("_").replace("_kernel", "")
    return INF_CL_KERNELS.get(name, name)


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


def report_inf_cl(arch: int, dim: int = DIM, batches=BATCHES, sms: Optional[int] = None) -> List[Dict]:
    """Inf-CL's forward, dq and dk kernels as its own launchers (``inf_cl.flash._flash_prob_forward`` /
    ``_backward``) launch them for one direction at D = ``dim`` (q and k upcast to fp32 in heads of the
    first of bench.methods' INF_CL_HEAD_DIMS dividing D, so tl.dot runs tf32), compile-only for ``arch``;
    one row per kernel. The launchers assert CUDA tensors: CPU tensors that say they are (nothing is read)."""
    import torch
    from inf_cl import flash

    from bench.methods import INF_CL_HEAD_DIMS

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    sms = sms or LIMITS[arch].sms
    head = next((h for h in INF_CL_HEAD_DIMS if dim % h == 0), None)
    if head is None:  # Inf-CL takes no such D (bench.methods lists it as unavailable)
        return []
    rows: Dict[str, Dict] = {}
    for batch in batches:
        q, k = (torch.Tensor._make_subclass(OnCuda, torch.zeros(batch, dim // head, head)) for _ in "qk")
        with triton_compile.compile_only(arch, sms=sms) as (compiled, start):
            lse = flash._flash_prob_forward(q, k)
            flash._flash_prob_backward(q, k, lse, torch.ones_like(lse))
            launches = list(zip(compiled[start:], triton_compile._RECORDER.launches[start:]))
        for (fn, kernel, log), launch in launches:
            name = kernel_label(triton_compile._kernel_name(fn))
            if name not in rows:
                bm, bn = launch["BLOCK_M"], launch["BLOCK_N"]
                figures = _compiled_figures(arch, fn, kernel, log, dim // head, bm * bn, peeled=False)
                row = {
                    "target": f"sm_{arch}",
                    "dtype": "fp32-tf32",
                    "D": dim,
                    "kernel": name,
                    "config": f"{bm}x{bn} d{head}",
                    "min_mma_m": min(bm, bn),
                    "calls": INF_CL_CALLS,
                    "s_mma": "-",
                    "s_layouts": 0,
                    "s_layout": "-",
                    **figures,
                }
                rows[name] = {**row, **_per_entry_model(row, *inf_cl_bytes_flops(name, bm, bn, dim, 4), bm * bn, 1)}
            _add_launch(rows[name], batch, launch, sms)
    return list(rows.values())


# The figures of the softmax kernels' tiles without a positive (:func:`without_positives`), beside each row's.
NO_POSITIVE_FIGURES = ("instr_per_entry", "mufu_per_entry", "shfl_per_entry", "instr_per_entry_all_slices")


def inf_cl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("inf_cl") is not None


def run(
    targets=TARGETS,
    dtypes=(BF16,),
    dims=(DIM,),
    batches=BATCHES,
    entries=ENTRIES,
    workers: int = WORKERS,
    tiles: Optional[Dict[str, Tuple[int, ...]]] = None,
    no_positive: bool = True,
    inf_cl: bool = False,
    sms: Optional[int] = None,
) -> List[Dict]:
    """Every (target, dtype) of the report in spawned workers (which import infcl with TRITON_INTERPRET=0), one
    process per job; targets whose ptxas the wheel lacks are skipped. ``no_positive``: the softmax kernels
    also compiled as :func:`without_positives`, their figures in the ``*_no_pos`` columns. ``inf_cl``: also
    Inf-CL's kernels (:func:`report_inf_cl`) at each D. ``sms``: the stand-in GPU's SM count (default: each
    target's flagship), which the launch plans read."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers, context, initializer=triton_compile.init_worker, max_tasks_per_child=1
    ) as pool:
        known = [arch for arch in targets if pool.submit(triton_compile.ptxas_knows, arch).result()]
        cases = [(arch, dtype, precision, dim) for arch in known for dtype, precision in dtypes for dim in dims]
        jobs = [pool.submit(report_target, *case, batches, entries, tiles, False, sms) for case in cases]
        plain = ("cal_inf_loss",) if "cal_inf_loss" in entries and no_positive else ()
        extra = [pool.submit(report_target, *case, batches, plain, tiles, True, sms) for case in cases if plain]
        theirs = [pool.submit(report_inf_cl, arch, dim, batches, sms) for arch in known for dim in dims if inf_cl]
        rows = [row for job in jobs for row in job.result()]
        key = ("target", "dtype", "D", "kernel")
        skipped = {tuple(row[k] for k in key): row for job in extra for row in job.result()}
        for row in rows:
            other = skipped.get(tuple(row[k] for k in key))
            if other is not None:
                row.update({f"{name}_no_pos": other[name] for name in NO_POSITIVE_FIGURES})
        return rows + [row for job in theirs for row in job.result()]


# ---- the time model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """What the time model assumes of one GPU. Every field is a CLI option of ``python -m bench.static``."""

    name: str
    sms: int
    clock_ghz: float  # sustained SM clock under this load
    tflops: float  # dense bf16 / fp16 tensor-core rate a large GEMM reaches (cuBLAS), not the datasheet peak
    l2_tbs: float  # L2 -> SM operand bandwidth, TB/s
    issue_per_clk: int = 128  # lane instructions issued per SM per clock: 4 schedulers x 1 warp instruction x 32
    mufu_per_clk: int = 16  # MUFU results (ex2, lg2, rcp) per SM per clock: 4 per scheduler
    fma_per_clk: int = 128  # fp32 FMA lanes per SM per clock (fp32 products without tensor cores)


# tf32 MMAs run at half the 16-bit rate on sm_80 / sm_90 / sm_100 (the datasheets' dense figures).
TF32_RATE = 0.5
# The H100 SXM (sm_90): 132 SMs; clock 1.755 GHz (max 1.98, ~1.75 sustained under tensor-core load, the
# issue's figure); tensor rate 750 TFLOP/s, the bf16 GEMM rate bench measured on that machine (735-770, against
# a 989 datasheet peak); L2 7.5 TB/s, the top of the 5.5-7.5 range of published H100 L2 read bandwidths, which
# with the serial sum fits the measured per-kernel times (docs/benchmarks.md, "The time model").
H100 = Device("H100 SXM", LIMITS[90].sms, 1.755, 750.0, 7.5)
# Unmeasured targets: the H100's GEMM fraction of its datasheet peak (750 / 989) applied to theirs, and its L2
# bytes per SM per clock (7.5 TB/s / 132 / 1.755 GHz = 32.4 B) scaled by their SMs and clock.
_GEMM_FRACTION = H100.tflops / 989.4
_L2_BYTES_PER_SM_CLK = H100.l2_tbs * 1e12 / (H100.sms * H100.clock_ghz * 1e9)
DEVICES = {
    90: H100,
    80: Device(
        "A100 SXM (assumed)",
        LIMITS[80].sms,
        1.41,
        round(_GEMM_FRACTION * 312, 1),
        round(_L2_BYTES_PER_SM_CLK * LIMITS[80].sms * 1.41e-3, 2),
    ),
    100: Device(
        "B200 (assumed)",
        LIMITS[100].sms,
        1.8,
        round(_GEMM_FRACTION * 2250, 1),
        round(_L2_BYTES_PER_SM_CLK * LIMITS[100].sms * 1.8e-3, 2),
    ),
}
# The batches the model reports, and the GEMM-equivalents (2 B^2 D flops each) of the bound: S, and in the
# backward S again, dq and dk.
MODEL_BATCHES = (32768, 65536)
BOUND_GEMMS = 5
MODEL_TERMS = ("tensor", "issue", "mufu", "l2")


def tensor_rate(device: Device, dtype: str) -> float:
    """flop/s of the products in operand type ``dtype`` (a row's label: bf16, fp16, fp32-tf32, fp32-ieee)."""
    if dtype in ("bf16", "fp16"):
        return device.tflops * 1e12
    if dtype == "fp32-tf32":
        return device.tflops * 1e12 * TF32_RATE
    return 2.0 * device.fma_per_clk * device.sms * device.clock_ghz * 1e9


def _figure(row: Dict, name: str) -> float:
    """A row's per-entry figure for the tiles without a positive (all but one or two column blocks per row
    block) where the report has it, else the listing's."""
    value = row.get(f"{name}_no_pos")
    return float(row[name] if value in (None, "") else value)


def model_kernel(row: Dict, batch: int, device: Device) -> Dict:
    """Modelled time (ms) of one launch of ``row``'s kernel at Bq = Bk = ``batch``, B^2 S entries.

    - tensor: the flops per S entry (S, and dq / dk's product, over all D slices) at :func:`tensor_rate`;
    - issue: the tile loop's lane instructions per entry (all slices) at ``issue_per_clk`` per SM per clock;
    - mufu: MUFU per entry (all slices) at ``mufu_per_clk`` per SM per clock;
    - l2: the modelled operand bytes per entry (:func:`modelled_bytes_flops`) at ``l2_tbs``;
    - tail: ceil(waves) / waves, the last wave's idle SMs (waves from the launch plan's programs at ``batch``
      over SMs x CTAs/SM; 1 where the report has no plan at that batch).
    ``bound`` = tail x the largest term: every unit overlapped with the others. ``serial`` = tail x (tensor
    + max(issue, mufu) + l2): nothing overlaps (MUFU instructions are issued in the same stream, so issue and
    MUFU are one term). ``serial`` is the estimate: on the H100 it fits the measured kernels (the bound does
    not; docs/benchmarks.md).
    """
    entries = float(batch) * batch
    clock = device.clock_ghz * 1e9
    slices = int(row.get("slices") or 1)
    terms = {
        "tensor": float(row["flops_per_entry"]) * entries / tensor_rate(device, row["dtype"]),
        "issue": _figure(row, "instr_per_entry_all_slices") * entries / (device.sms * device.issue_per_clk * clock),
        "mufu": _figure(row, "mufu_per_entry") * slices * entries / (device.sms * device.mufu_per_clk * clock),
        "l2": float(row["l2_bytes_per_entry"]) * entries / (device.l2_tbs * 1e12),
    }
    terms = {name: 1e3 * value for name, value in terms.items()}
    programs = row.get(f"programs@{batch}")
    waves = int(programs) / (device.sms * max(int(row["ctas_per_sm"]), 1)) if programs not in (None, "") else None
    tail = math.ceil(waves) / waves if waves else 1.0
    return {
        **{f"{name}_ms": value for name, value in terms.items()},
        "waves": waves,
        "tail": tail,
        "bound_ms": tail * max(terms.values()),
        "serial_ms": tail * (terms["tensor"] + max(terms["issue"], terms["mufu"]) + terms["l2"]),
        "limiter": max(terms, key=terms.get),
    }


MODEL_KERNELS = ("forward", "dq", "dk", "inf-cl forward", "inf-cl dq", "inf-cl dk")


def model_rows(
    rows: List[Dict],
    batches=MODEL_BATCHES,
    devices: Optional[Dict[int, Device]] = None,
    measured: Optional[Dict[Tuple, float]] = None,
) -> List[Dict]:
    """The time model of every softmax kernel row (infcl's forward, dq, dk; Inf-CL's) at each batch, then a
    total per (target, dtype, D, batch, method): the symmetric loss's forward + backward, Inf-CL's kernels
    counted twice (two calls), beside the bound of :data:`BOUND_GEMMS` GEMMs at the tensor rate.
    ``measured``: {(target, dtype, D, batch, kernel): ms} (:func:`read_measured`; "infcl total" and
    "inf-cl total" name the totals) gives each row its measured time and the estimate's error."""
    devices = devices or DEVICES
    measured = measured or {}
    out = []
    for batch in batches:
        totals: Dict[Tuple, Dict] = {}
        for row in rows:
            if row["kernel"] not in MODEL_KERNELS:
                continue
            arch = int(str(row["target"]).removeprefix("sm_"))
            device = devices[arch]
            method = "inf-cl" if row["kernel"].startswith("inf-cl") else "infcl"
            # Measured rows carry the loss's input dtype: Inf-CL's kernels run fp32 (tf32 products) on bf16 inputs.
            inputs = "bf16" if method == "inf-cl" else row["dtype"]
            key = (row["target"], inputs, int(row["D"]), batch)
            model = {
                "target": row["target"],
                "device": device.name,
                "dtype": row["dtype"],
                "D": int(row["D"]),
                "kernel": row["kernel"],
                "batch": batch,
                "calls": int(row.get("calls") or 1),
                **model_kernel(row, batch, device),
            }
            out.append(_with_measured(model, measured.get((*key, row["kernel"]))))
            total = totals.setdefault(
                (*key, method),
                {
                    "target": row["target"],
                    "device": device.name,
                    "dtype": inputs,
                    "D": int(row["D"]),
                    "kernel": f"{method} total",
                    "batch": batch,
                    "calls": 1,
                    "bound_ms": 0.0,
                    "serial_ms": 0.0,
                    "gemm_bound_ms": 1e3
                    * BOUND_GEMMS
                    * 2.0
                    * batch
                    * batch
                    * int(row["D"])
                    / tensor_rate(device, "bf16"),
                },
            )
            for name in ("bound_ms", "serial_ms"):
                total[name] += model["calls"] * model[name]
        for key, total in totals.items():
            total["x_gemm_bound"] = total["serial_ms"] / total["gemm_bound_ms"]
            out.append(_with_measured(total, measured.get((*key[:4], total["kernel"]))))
    return out


def _with_measured(model: Dict, measured_ms: Optional[float]) -> Dict:
    if measured_ms:
        model.update(
            measured_ms=measured_ms,
            serial_error=model["serial_ms"] / measured_ms - 1,
            bound_error=model["bound_ms"] / measured_ms - 1,
        )
    return model


def read_measured(path: Path) -> Dict[Tuple, float]:
    """{(target, dtype, D, batch, kernel): measured ms} from a CSV with those columns and ``measured_ms``
    (bench/results/gpu-h100-kernels.csv; python -m bench.gpu_first's kernels.csv)."""
    with open(path, newline="") as f:
        return {
            (r["target"], r["dtype"], int(r["D"]), int(r["batch"]), r["kernel"]): float(r["measured_ms"])
            for r in csv.DictReader(f)
            if r.get("measured_ms")
        }


def read_rows(path: Path) -> List[Dict]:
    """A report CSV (:func:`write_csv`) read back: the time model needs no compile to be rerun."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def format_model(models: List[Dict]) -> str:
    heads = [
        "target",
        "device",
        "D",
        "kernel",
        "B",
        "calls",
        "tensor",
        "issue",
        "mufu",
        "L2",
        "tail",
        "bound (max)",
        "estimate (serial)",
        "limiter",
        "measured",
        "error",
        "x 5-GEMM bound",
    ]
    cells = [heads]
    for m in models:
        error = f"{100 * m['serial_error']:+.0f}% (max {100 * m['bound_error']:+.0f}%)" if "serial_error" in m else "-"
        cells.append(
            [
                m["target"],
                m["device"],
                str(m["D"]),
                m["kernel"],
                str(m["batch"]),
                str(m["calls"]),
                *[_fmt(m.get(f"{t}_ms"), 2) for t in MODEL_TERMS],
                _fmt(m.get("tail"), 2),
                _fmt(m["bound_ms"], 1),
                _fmt(m["serial_ms"], 1),
                m.get("limiter", "-"),
                _fmt(m.get("measured_ms"), 1),
                error,
                _fmt(m.get("x_gemm_bound"), 2),
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(heads))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(heads))).rstrip() for c in cells]
    return "time model, ms per launch (docs/benchmarks.md, 'The time model'):\n" + "\n".join(lines)


# ---- output ----------------------------------------------------------------------------------------


def _fmt(value, digits=1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def format_table(rows: List[Dict], batches=BATCHES) -> str:
    heads = [
        "target",
        "dtype",
        "kernel",
        "config",
        "warps",
        "mma (sass, or ptx)",
        "instr/entry",
        "no pos.",
        "slices",
        "mufu/entry",
        "no pos.",
        "shfl/entry",
        "regs",
        "spill",
        "smem KiB",
        "CTAs/SM",
        *[f"waves B={b}" for b in batches],
        "flop/byte",
    ]
    cells = [heads]
    for r in rows:
        mma = r["mma_sass"] if r["mma_sass"] != "n/a" else r["mma_ptx"]
        cells.append(
            [
                r["target"],
                r["dtype"],
                r["kernel"],
                r["config"],
                str(r["warps"]),
                mma,
                _fmt(r["instr_per_entry"]),
                _fmt(r.get("instr_per_entry_no_pos")),
                str(r["slices"]),
                _fmt(r["mufu_per_entry"], 2),
                _fmt(r.get("mufu_per_entry_no_pos"), 2),
                _fmt(r["shfl_per_entry"], 2),
                str(r["regs"]),
                str(r["spill_bytes"]),
                f"{r['smem'] / 1024:.0f}",
                f"{r['ctas_per_sm']} ({r['cta_limiter']})",
                *[_fmt(r.get(f"waves@{b}"), 2) for b in batches],
                _fmt(r["flop_per_byte"]),
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(heads))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(heads))).rstrip() for c in cells)


def write_csv(rows: List[Dict], path: Path) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})


# The plot's panels: (CSV column, axis label).
PLOT_PANELS = (
    ("instr_per_entry_all_slices", "lane instructions per S entry (all D slices)"),
    ("mufu_per_entry", "MUFU per S entry (per D slice in dq/dk)"),
    ("flop_per_byte", "modelled L2 flop/byte"),
)


def write_plot(rows: List[Dict], path: Path) -> None:
    """One panel per :data:`PLOT_PANELS` figure: a bar per kernel, grouped by (target, dtype, D)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["target"], r["dtype"], r["D"]) for r in rows))
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    width = 0.8 / len(kernels)
    fig, axes = plt.subplots(1, len(PLOT_PANELS), figsize=(6 * len(PLOT_PANELS), 4.5))
    for ax, (column, label) in zip(axes, PLOT_PANELS):
        for j, kernel in enumerate(kernels):
            values = {(r["target"], r["dtype"], r["D"]): r[column] for r in rows if r["kernel"] == kernel}
            xs = [i + j * width for i, g in enumerate(groups) if values.get(g) is not None]
            ys = [values[g] for g in groups if values.get(g) is not None]
            ax.bar(xs, ys, width, label=kernel)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([f"{t} {d}\nD={dim}" for t, d, dim in groups], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("infcl Triton kernels, static report (compile-only; counted and modelled, not timed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The per-kernel times measured on the H100 (torch.profiler), which the model is compared with by default.
MEASURED = DEFAULT_OUT / "gpu-h100-kernels.csv"


def devices_from(args) -> Dict[int, Device]:
    """Each target's :data:`DEVICES` entry with the options given (``--sms``, ``--tflops``, ...) replacing its
    fields, on every target."""
    given = {
        name: getattr(args, name)
        for name in ("sms", "clock_ghz", "tflops", "l2_tbs", "issue_per_clk", "mufu_per_clk")
        if getattr(args, name) is not None
    }
    return {arch: replace(device, **given) for arch, device in DEVICES.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.static", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(map(str, TARGETS)), help="compute capabilities, e.g. 90,80")
    parser.add_argument("--tf32", action="store_true", help="also fp32 inputs with tf32 products")
    parser.add_argument("--dims", default=str(DIM), help="feature dims, e.g. 512,1000 (1000: ragged chunks)")
    parser.add_argument(
        "--tile",
        action="append",
        default=[],
        metavar="KERNEL=MxN[:warps[:stages[:out]]]",
        help=f"replace a default config ({', '.join(TILE_KERNELS)}) on every target; repeatable",
    )
    parser.add_argument("--losses", default="clip,siglip", help="clip (cal_inf_loss), siglip (cal_siglip_loss)")
    parser.add_argument(
        "--inf-cl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also Inf-CL's kernels, compile-only (default: when inf_cl is importable)",
    )
    parser.add_argument("--from-csv", type=Path, help="rerun the time model on a stored report CSV, no compile")
    model = parser.add_argument_group("the time model (default: each target's DEVICES entry; H100 SXM for sm_90)")
    model.add_argument("--model-batches", default=",".join(map(str, MODEL_BATCHES)), help="B of the time model")
    model.add_argument("--sms", type=int, help="SM count (also the stand-in GPU's, which the launch plans read)")
    model.add_argument("--clock-ghz", type=float, help="sustained SM clock, GHz")
    model.add_argument("--tflops", type=float, help="dense bf16 tensor rate a GEMM reaches, TFLOP/s")
    model.add_argument("--l2-tbs", type=float, help="L2 operand bandwidth, TB/s")
    model.add_argument("--issue-per-clk", type=int, help="lane instructions issued per SM per clock")
    model.add_argument("--mufu-per-clk", type=int, help="MUFU results per SM per clock")
    model.add_argument(
        "--measured",
        type=Path,
        default=MEASURED if MEASURED.exists() else None,
        help="per-kernel times to compare with (CSV: target,dtype,D,batch,kernel,measured_ms)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--name", default="static", help="CSV / plot file name (without .csv / .png)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    targets = tuple(int(t) for t in args.targets.replace(",", " ").split())
    unknown = [t for t in targets if t not in LIMITS]
    if unknown:
        parser.error(f"--targets: no SM limits for {unknown}; known: {sorted(LIMITS)}")
    try:
        tiles = dict(parse_tile(spec) for spec in args.tile)
    except ValueError as err:
        parser.error(str(err))
    losses = {"clip": "cal_inf_loss", "siglip": "cal_siglip_loss"}
    try:
        entries = tuple(losses[name] for name in args.losses.replace(",", " ").split())
    except KeyError as err:
        parser.error(f"--losses: unknown loss {err}; choose from {sorted(losses)}")
    dims = tuple(int(d) for d in args.dims.replace(",", " ").split())
    model_batches = tuple(int(b) for b in args.model_batches.replace(",", " ").split())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.csv"
    if args.from_csv:
        rows = read_rows(args.from_csv)
    else:
        inf_cl = inf_cl_installed() if args.inf_cl is None else args.inf_cl
        batches = tuple(sorted(set(BATCHES) | set(model_batches)))
        rows = run(
            targets,
            (BF16, TF32) if args.tf32 else (BF16,),
            dims,
            batches,
            entries,
            tiles=tiles,
            inf_cl=inf_cl,
            sms=args.sms,
        )
        print(format_table(rows, batches))
        write_csv(rows, path)
        print(f"wrote {path}")
        if not args.no_plot:
            write_plot(rows, path.with_suffix(".png"))
            print(f"wrote {path.with_suffix('.png')}")
    models = model_rows(rows, model_batches, devices_from(args), read_measured(args.measured) if args.measured else {})
    print(format_model(models))
    model_path = args.out / f"{args.name}-model.csv"
    write_csv(models, model_path)
    print(f"wrote {model_path}")


if __name__ == "__main__":
    main()
