"""The chunked route's passes (``backend="chunked"``: infcl/kernels/chunked_softmax.py, and SigLIP's one pass,
infcl/kernels/chunked_sigmoid.py) compiled for a GPU target
as the route launches them on a GPU, one row per pass: registers, spills, the tile loop's lane instructions,
MUFU, shuffles and barriers per S entry (:mod:`.counts`), and the HBM bytes per S entry the pass moves.

The route's products are cuBLAS calls (not compiled here: :mod:`bench.chunked_model` models them); its passes read
the float32 [C, Bk] scores a product wrote. They are compiled by calling their launchers on CPU tensors of a GPU
chunk's dtypes and alignment (float32 scores, dS in the operand dtype, C and Bk multiples of every tile, as the
GPU plan's C = a multiple of 64 and Bk = B make them) under the compile-only driver; the launch grid at a batch
B is the one the launcher plans for the route's chunk at that B (:func:`chunk_rows_at`), read from the same
launchers. The kernels' code does not depend on C or Bk beyond that alignment.
"""

import concurrent.futures
import contextlib
import math
import multiprocessing
from typing import Dict, List, Optional

from .counts import compiled_figures
from .driver import triton_compile
from .infcl_internals import without_positives
from .matrix import BATCHES, TARGETS
from .resources import LIMITS

# The compile shapes: C rows and Bk columns, multiples of every pass's tile (so the kernels compiled are the
# even-tiled ones a GPU chunk at B = 16k..1M runs).
COMPILE_ROWS, COMPILE_COLS = 256, 4096
# The feature dim and the budget the route's C is planned with (docs/chunked.md: bf16, D = 512, 1 GiB).
PLAN_DIM = 512


def chunk_rows_at(
    batch: int, dim: int = PLAN_DIM, operand_bytes: int = 2, budget_mb: Optional[float] = None, in_gemm: bool = True
) -> int:
    """C, the rows of the route's chunk for a B x B block on a GPU (infcl.backends.chunked.plan's rule: everything
    the block holds, the float32 dq and dk included, within the budget) at ``budget_mb`` (default: the route's
    default budget, whatever INFCL_CHUNK_BUDGET_MB says); ``in_gemm``: dq and dk accumulate inside the GEMM (where
    ``addmm(..., out_dtype=)`` runs; else the products' float32 results count too)."""
    from infcl.backends.chunked import plan

    need = plan.footprint(batch, batch, dim, _operand(operand_bytes), True, True, in_gemm)
    budget = plan.budget_bytes(plan.DEFAULT_BUDGET_MB if budget_mb is None else budget_mb)
    return min(need.fitting_rows(batch, budget, plan.ROW_ALIGN), plan.MAX_ROWS["cuda"])


def _operand(nbytes: int):
    import torch

    return {2: torch.bfloat16, 4: torch.float32}[nbytes]


def _pass_calls(dtype: str, symmetric: bool):
    """(kernel label, launcher call) of each pass of one chunk, on CPU tensors of a GPU chunk's dtypes."""
    import torch

    from infcl.kernels import chunked_softmax as passes
    from infcl.kernels.chunked_sigmoid import sigmoid_chunk

    operand = getattr(torch, dtype)
    c, n = COMPILE_ROWS, COMPILE_COLS
    raw = torch.zeros(c, n)
    scale = torch.tensor(10.0)
    pos = torch.arange(c)
    rows = torch.zeros(3, c)
    cols = torch.zeros(2, n) if symmetric else None
    ds = torch.zeros(c, n, dtype=operand)
    factor = torch.ones(c) if operand == torch.float16 else scale
    g_row, g_col = torch.ones(c), torch.ones(n)
    params = torch.tensor([10.0, -10.0])
    return (
        lambda: passes.chunk_stats(raw, scale, pos, symmetric, rows, cols),
        lambda: passes.chunk_grad(
            raw, ds, scale, factor, pos, rows[:2], g_row, cols, g_col if symmetric else None, operand
        ),
        # SigLIP's one pass as its forward launches it: the loss and dS at once (infcl.backends.chunked.sigmoid)
        lambda: sigmoid_chunk(raw, params, pos, torch.empty(c), ds, factor, g_row, operand),
    )


def report_chunked(
    arch: int, dtype: str = "bfloat16", symmetric: bool = True, batches=BATCHES, sms=None, no_positive: bool = False
) -> List[Dict]:
    """One row per compiled pass of the chunked route (its kernel's name), for ``arch`` in ``dtype``; the launch
    plan (programs, waves) at each of ``batches``; ``no_positive``: compiled for tiles without a positive
    (:func:`without_positives`). Runs in a worker process (:func:`triton_compile.init_worker`)."""
    import torch

    from infcl.kernels import chunked_softmax as passes

    sms = sms or LIMITS[arch].sms
    rows: Dict[str, Dict] = {}
    with without_positives() if no_positive else contextlib.nullcontext():
        with triton_compile.compile_only(arch, sms=sms) as (compiled, start):
            for call in _pass_calls(dtype, symmetric):
                call()
            launches = list(zip(compiled[start:], triton_compile._RECORDER.launches[start:]))
    elt = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for (fn, kernel, log), launch in launches:
        kind = triton_compile._kernel_name(fn).replace("chunk", "").strip("_")  # stats, merge, grad, sigmoid
        name = "chunk siglip" if kind == "sigmoid" else f"chunk {kind}"
        if name in rows:
            continue
        usage = triton_compile._resources(fn, kernel, log, arch)
        # per S entry; the merge's per partial (PARTS x BLOCK a pass of its loop)
        entries = launch["BLOCK_M"] * launch["BLOCK_N"] if "BLOCK_N" in launch else launch["BLOCK"] * launch["PARTS"]
        figures = compiled_figures(arch, kernel, usage, 1, entries)
        row = {
            "target": f"sm_{arch}",
            "dtype": {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype],
            "D": PLAN_DIM,
            "kernel": name,
            "config": _config(launch),
            "calls": 1,
            **figures,
        }
        for batch in batches:
            c = chunk_rows_at(batch, operand_bytes=elt)
            programs = passes.launch_programs("grad" if kind == "sigmoid" else kind, c, batch, symmetric)
            row[f"chunk_rows@{batch}"] = c
            row[f"programs@{batch}"] = programs
            row[f"waves@{batch}"] = programs / (sms * max(row["ctas_per_sm"], 1))
        row.update(pass_traffic(name, elt, symmetric))
        rows[name] = row
    return list(rows.values())


def _config(launch: Dict) -> str:
    if "BLOCK_N" in launch:
        return f"{launch['BLOCK_M']}x{launch['BLOCK_N']} split{launch.get('SPLIT_TILES', 1)}"
    return f"{launch['PARTS']}x{launch['BLOCK']}"


def pass_traffic(kernel: str, elt: int, symmetric: bool) -> Dict:
    """HBM bytes per S entry a pass moves (the score chunk read, dS written; the O(C + Bk) partials and stats, the
    SigLIP pass's loss partials included, are below 1% and left to :mod:`bench.chunked_model`'s per-chunk terms)."""
    per_entry = {"chunk stats": 4.0, "chunk grad": 4.0 + elt, "chunk siglip": 4.0 + elt}.get(kernel, 0.0)
    return {"hbm_bytes_per_entry": per_entry, "symmetric": symmetric}


def waves_tail(programs: int, ctas_per_sm: int, sms: int) -> float:
    """ceil(waves) / waves: the last wave's idle share of a launch of ``programs`` CTAs."""
    waves = programs / (sms * max(ctas_per_sm, 1))
    return math.ceil(waves) / waves if waves else 1.0


# The figures of the passes compiled for tiles without a positive (all but one or two column tiles per row block).
NO_POSITIVE_FIGURES = ("instr_per_entry", "mufu_per_entry", "shfl_per_entry", "bar_per_tile")


def run_chunked(targets=TARGETS, batches=BATCHES, dtype: str = "bfloat16", workers: int = 2, sms=None) -> List[Dict]:
    """:func:`report_chunked` for every target whose ptxas the wheel has, each in a spawned worker, with the
    no-positive figures (``*_no_pos``) beside each row's."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers, context, initializer=triton_compile.init_worker, max_tasks_per_child=1
    ) as pool:
        known = [arch for arch in targets if pool.submit(triton_compile.ptxas_knows, arch).result()]
        jobs = [pool.submit(report_chunked, arch, dtype, True, batches, sms) for arch in known]
        plain = [pool.submit(report_chunked, arch, dtype, True, batches, sms, True) for arch in known]
        rows = [row for job in jobs for row in job.result()]
        other = {(r["target"], r["kernel"]): r for job in plain for r in job.result()}
    for row in rows:
        twin = other.get((row["target"], row["kernel"]))
        if twin is not None:
            row.update({f"{name}_no_pos": twin[name] for name in NO_POSITIVE_FIGURES})
    return rows


def format_chunked(rows: List[Dict], batches=BATCHES) -> str:
    """The passes' table: per compiled pass, registers, spills, the tile loop's lane instructions, MUFU, shuffles per
    S entry (the merge: per partial) with and without a positive in the tile, barriers per tile, HBM bytes per S
    entry, occupancy and waves."""
    heads = ["target", "dtype", "pass", "config", "warps", "regs", "spill", "instr/entry", "no pos.", "mufu/entry",
             "shfl/entry", "BAR/tile", "HBM B/entry", "CTAs/SM", *[f"C, waves B={b}" for b in batches]]  # fmt: skip
    cells = [heads]
    for r in rows:
        cells.append(
            [
                str(r["target"]),
                str(r["dtype"]),
                str(r["kernel"]),
                str(r["config"]),
                str(r["warps"]),
                str(r["regs"]),
                str(r["spill_bytes"]),
                _fmt(r.get("instr_per_entry")),
                _fmt(r.get("instr_per_entry_no_pos")),
                _fmt(r.get("mufu_per_entry"), 2),
                _fmt(r.get("shfl_per_entry"), 2),
                _fmt(r.get("bar_per_tile"), 0),
                _fmt(r.get("hbm_bytes_per_entry"), 0),
                f"{r['ctas_per_sm']} ({r['cta_limiter']})",
                *[f"{r.get(f'chunk_rows@{b}', '-')}, {_fmt(r.get(f'waves@{b}'), 2)}" for b in batches],
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(heads))]
    title = "the chunked route's passes (compile-only; merge: per partial, not per S entry):\n"
    return title + "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(heads))).rstrip() for c in cells)


def _fmt(value, digits=1) -> str:
    if value in (None, ""):
        return "-"
    try:
        return f"{float(value):.{digits}f}"
    except (TypeError, ValueError):
        return str(value)
