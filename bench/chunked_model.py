"""``python -m bench.chunked_model``: a MODEL (not a measurement) of the chunked route's time, per kernel, from its
compiled passes (``python -m bench.static``'s ``static-chunked.csv``) and each GPU's rates.

The symmetric softmax (CLIP) loss and the sigmoid (SigLIP) loss, bf16, D = 512, forward + backward, one B x B
block (``backend="chunked"``, docs/chunked.md), C the plan's rows at the default 1 GiB budget. Per kernel, summed
over the chunks:

- a cuBLAS product takes max(flops / the GEMM rate, its HBM bytes / the HBM rate): its operands, its output, and
  for the score product the **float32 output, 4 bytes per S entry** (stated on its own: on an H100 it is as long
  as the product's flops); dk's accumulation into the float32 dk is in the product (beta = 1: the [Bk, D] float32
  dk read and written once per chunk);
- a pass takes tail x max(its lane instructions per S entry (the compiled tile loop, tiles without a positive:
  all but one or two per row block) / the issue rate, its HBM bytes per entry / the HBM rate): the loads are
  pipelined (the next tile's load is issued before the current tile's arithmetic), so issue and memory overlap;
  tail = ceil(waves) / waves of its launch;
- the merge of a chunk's partials: its bytes (partials written by the pass and read, the column stats) at the HBM
  rate, or its instructions at the issue rate;
- every launch adds a gap (:data:`LAUNCH_GAP_US`): launches per chunk are counted from the route's host loop.

The kernels run back to back (no overlap between kernels). SigLIP's route (3 GEMM-equivalents: the forward forms
S, the loss and dS in one pass and takes both products; the backward only scales) reads its pass's figures from
the report's ``chunk siglip`` row (infcl/kernels/chunked_sigmoid.py; a report without one: the softmax grad
pass's, said in the output), its bytes from that kernel's own traffic (S in, dS out, the loss partials).
``--from-ab`` replaces the rates with a GPU's measured ones (``python -m bench --preset gpu-first``'s route.csv).
"""

import argparse
import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

DIM = 512
BATCHES = (16384, 32768, 65536)
STATIC_CSV = Path(__file__).resolve().parent / "results" / "static-chunked.csv"
# Per-launch gap between dependent kernels on one stream (launch latency hidden by the queue; the ramp-up and drain
# of each kernel), microseconds: an assumption until the A/B measures the route end to end.
LAUNCH_GAP_US = 2.0
# Launches per chunk in the route's host loop: forward: scores, stats, merge; backward: scores, grad, the scale
# gradient's two sums, the row factor (fp16 only: not counted), dq, dk.
LAUNCHES_FORWARD, LAUNCHES_BACKWARD = 3, 6
# SigLIP's route: forward: scores, the sigmoid pass, its loss sum, dq, dk; backward: two scalings.
LAUNCHES_SIGLIP = 7
# The targets of issue 53 at B = 65536 (ms): (loss, device) -> ms.
TARGETS = {("clip", "H200"): 42.0, ("clip", "H100 SXM"): 48.0, ("siglip", "H200"): 30.0, ("siglip", "H100 SXM"): 36.0}
# bench/results/gpu-first-h200.md: B -> (infcl "triton" ms, vanilla ms), bf16, D = 512, symmetric fwd + bwd (H200).
MEASURED_MS = {16384: (16.1, 6.7), 32768: (49.5, 27.4), 65536: (191.9, 113.9)}


@dataclass(frozen=True)
class GPU:
    """What the model assumes of one GPU."""

    name: str
    sms: int
    clock_ghz: float  # sustained SM clock under load
    gemm_tflops: float  # bf16 dense GEMM rate cuBLAS reaches (measured where said)
    hbm_tbs: float  # a streaming kernel's HBM rate: ~85% of the datasheet peak, as a copy reaches
    issue_per_clk: int = 128  # lane instructions per SM per clock


# The H100 SXM: bf16 GEMM 750 TFLOP/s (measured on one, docs/benchmarks.md "On a GPU"), HBM3 3.35 TB/s peak -> 2.85.
# The H200: bf16 GEMM 652 TFLOP/s (measured by the gpu-first run, bench/results/gpu-first-h200.md), HBM3e 4.8 TB/s
# peak -> 4.1. Both 132 SMs at the 1.755 GHz sustained clock bench.static's time model takes for the H100.
GPUS = {
    "H100 SXM": GPU("H100 SXM", 132, 1.755, 750.0, 2.85),
    "H200": GPU("H200", 132, 1.755, 652.0, 4.1),
}


def read_passes(path: Path, target: str = "sm_90") -> Dict[str, Dict]:
    """The compiled passes' rows of ``target`` from a static-chunked.csv, by pass name."""
    with open(path, newline="") as f:
        return {r["kernel"]: r for r in csv.DictReader(f) if r["target"] == target}


def _num(row: Dict, name: str, fallback: Optional[str] = None) -> float:
    value = row.get(name)
    if value in (None, "") and fallback:
        value = row.get(fallback)
    return float(value)


def chunk_rows(batch: int) -> int:
    """The route's C at the default budget (whatever INFCL_CHUNK_BUDGET_MB says)."""
    from bench.static.chunked import chunk_rows_at
    from infcl.backends.chunked.plan import DEFAULT_BUDGET_MB

    return chunk_rows_at(batch, DIM, budget_mb=DEFAULT_BUDGET_MB)


def _product(name: str, flops: float, nbytes: float, gpu: GPU, rates: Dict[str, float]) -> Dict:
    tflops = rates.get(name, gpu.gemm_tflops)
    compute, memory = flops / (tflops * 1e12) * 1e3, nbytes / (gpu.hbm_tbs * 1e12) * 1e3
    return {"kernel": name, "flops_ms": compute, "hbm_ms": memory, "issue_ms": None,
            "ms": max(compute, memory), "limiter": "GEMM" if compute >= memory else "HBM"}  # fmt: skip


def _pass(name: str, row: Dict, entries: float, nbytes: float, gpu: GPU, rates: Dict[str, float], waves=None) -> Dict:
    instr = _num(row, "instr_per_entry_no_pos", "instr_per_entry")
    issue = instr * entries / (gpu.sms * gpu.issue_per_clk * gpu.clock_ghz * 1e9) * 1e3
    hbm_rate = rates.get(name, gpu.hbm_tbs * 1e3) * 1e9  # GB/s -> B/s
    memory = nbytes / hbm_rate * 1e3
    tail = math.ceil(waves) / waves if waves else 1.0
    return {"kernel": name, "flops_ms": None, "hbm_ms": memory, "issue_ms": issue, "tail": tail,
            "ms": tail * max(issue, memory), "limiter": "issue" if issue > memory else "HBM"}  # fmt: skip


def _waves(row: Dict, programs: int, gpu: GPU) -> float:
    return programs / (gpu.sms * max(int(float(row["ctas_per_sm"])), 1))


def model_loss(loss: str, batch: int, gpu: GPU, passes: Dict[str, Dict], rates: Optional[Dict] = None) -> List[Dict]:
    """Per-kernel rows (ms, summed over the chunks) of one forward + backward of ``loss`` ("clip", "siglip") at
    Bq = Bk = ``batch``, and a "total" row."""
    import torch

    from infcl.kernels.chunked_softmax import launch_programs, pass_bytes
    from infcl.kernels.tiling import CHUNK_SPLIT_TILES, CHUNK_STATS_TILE

    rates = dict(rates or {})
    c = chunk_rows(batch)
    n_chunks = math.ceil(batch / c)
    entries = float(batch) * batch
    flops = 2.0 * entries * DIM
    operands = n_chunks * batch * DIM * 2 + batch * DIM * 2  # k (or q) read per chunk, the chunk's rows once
    fp32_out = 4 * entries
    dk_rmw = n_chunks * batch * DIM * 8  # the float32 dk read and written by each chunk's product (beta = 1)
    stats, grad, merge = passes["chunk stats"], passes["chunk grad"], passes["chunk merge"]
    forward_bytes, backward_bytes = (n_chunks * b for b in pass_bytes(c, batch, torch.bfloat16, True))
    rows = [_product("scores", flops, fp32_out + operands, gpu, rates)]
    if loss == "clip":
        merge_bytes = forward_bytes - 4 * entries
        merge_programs = launch_programs("merge", c, batch, True)
        tile = CHUNK_STATS_TILE
        splits = math.ceil(math.ceil(batch / tile.block_n) / CHUNK_SPLIT_TILES)
        partials = n_chunks * (splits * c + math.ceil(c / tile.block_m) * batch)  # (m, rest) pairs merged
        rows += [
            _pass("stats pass", stats, entries, 4 * entries, gpu, rates,
                  _waves(stats, launch_programs("stats", c, batch, True), gpu)),
            _pass("merge", merge, partials, merge_bytes, gpu, rates, _waves(merge, merge_programs, gpu)),
            {**_product("scores", flops, fp32_out + operands, gpu, rates), "kernel": "scores (backward)"},
            _pass("grad pass", grad, entries, backward_bytes, gpu, rates,
                  _waves(grad, launch_programs("grad", c, batch, True), gpu)),
        ]  # fmt: skip
        launches = n_chunks * (LAUNCHES_FORWARD + LAUNCHES_BACKWARD)
    else:
        from infcl.kernels.chunked_sigmoid import pass_bytes as siglip_bytes

        sig = passes.get("chunk siglip", grad)
        # its own traffic: S read (4 B/entry), dS written (bf16), each row's loss partials per split
        sig_bytes = n_chunks * sum(siglip_bytes(c, batch, torch.bfloat16, True))
        rows.append(_pass("siglip pass", sig, entries, sig_bytes, gpu, rates,
                          _waves(sig, launch_programs("grad", c, batch, True), gpu)))  # fmt: skip
        launches = n_chunks * LAUNCHES_SIGLIP
    rows += [
        _product("dq", flops, 2 * entries + operands, gpu, rates),
        _product("dk", flops, 2 * entries + operands + dk_rmw, gpu, rates),
        {"kernel": "launch gaps", "ms": launches * LAUNCH_GAP_US * 1e-3, "limiter": f"{launches} launches"},
    ]
    total = sum(r["ms"] for r in rows)
    write_ms = fp32_out / (gpu.hbm_tbs * 1e12) * 1e3
    out = [{"loss": loss, "device": gpu.name, "batch": batch, "C": c, "chunks": n_chunks, **r} for r in rows]
    out.append({"loss": loss, "device": gpu.name, "batch": batch, "C": c, "chunks": n_chunks, "kernel": "total",
                "ms": total, "fp32_write_ms": write_ms, "limiter": ""})  # fmt: skip
    return out


def rates_from_ab(path: Path, chunk_rows_: int) -> Dict[str, float]:
    """From the GPU runner's route.csv: the three products' TFLOP/s at the measured C nearest ``chunk_rows_``, and
    the passes' GB/s at the largest C measured."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    gemm = [r for r in rows if r["step"] == "gemm" and r["unit"] == "TFLOP/s" and r["case"].startswith("C=")]
    rates: Dict[str, float] = {}
    if gemm:
        measured = sorted({int(r["case"].split()[0][2:]) for r in gemm})
        nearest = min(measured, key=lambda c: abs(c - chunk_rows_))
        rates.update({r["metric"]: float(r["value"]) for r in gemm if r["case"].startswith(f"C={nearest} ")})
    for row in rows:  # in order: the largest C last
        if row["step"] == "passes" and row["unit"] == "GB/s" and row["metric"] != "copy":
            rates[row["metric"]] = float(row["value"])
    return rates


def _f(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_rows(rows: List[Dict]) -> str:
    heads = ["kernel", "GEMM ms", "HBM ms", "issue ms", "tail", "ms", "limiter"]
    cells = [heads] + [
        [
            r["kernel"],
            _f(r.get("flops_ms")),
            _f(r.get("hbm_ms")),
            _f(r.get("issue_ms")),
            _f(r.get("tail")),
            _f(r["ms"]),
            str(r.get("limiter", "")),
        ]  # fmt: skip
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(heads))]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(heads))).rstrip() for c in cells)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.chunked_model", description=__doc__.splitlines()[0])
    parser.add_argument("--static-csv", type=Path, default=STATIC_CSV, help="python -m bench.static's chunked CSV")
    parser.add_argument("--target", default="sm_90", help="the compiled target whose passes are modelled")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--from-ab", type=Path, help="the GPU runner's route.csv: its measured rates replace the GPUs'")
    parser.add_argument("--out", type=Path, help="write every row to this CSV")
    args = parser.parse_args(argv)
    passes = read_passes(args.static_csv, args.target)
    batches = [int(b) for b in args.batches.replace(",", " ").split()]
    print("MODEL, not a measurement: the chunked route (backend='chunked'), bf16, D = 512, forward + backward")
    print(f"passes: {args.static_csv} ({args.target}), instructions per S entry of tiles without a positive")
    for name, p in passes.items():
        print(f"  {name:12} {p['config']:16} regs {p['regs']:>4} spill {p['spill_bytes']} instr/entry "
              f"{float(p.get('instr_per_entry_no_pos') or p['instr_per_entry']):.1f} "
              f"(with positive {float(p['instr_per_entry']):.1f}) CTAs/SM {p['ctas_per_sm']}")  # fmt: skip
    if "chunk siglip" not in passes:
        print("  (no compiled SigLIP pass in the report: SigLIP takes the softmax grad pass's figures)")
    summary, everything = [], []
    rates = rates_from_ab(args.from_ab, chunk_rows(max(batches))) if args.from_ab else {}
    # with one GPU's measured rates: that GPU alone (its SMs and clock taken as the H100's and H200's)
    gpus = [replace(GPUS["H200"], name="the measured GPU")] if rates else list(GPUS.values())
    for g in gpus:
        print(f"\n== {g.name}: GEMM {g.gemm_tflops:g} TFLOP/s, HBM {g.hbm_tbs:g} TB/s, {g.sms} SMs at "
              f"{g.clock_ghz:g} GHz x {g.issue_per_clk} lanes/clk, launch gap {LAUNCH_GAP_US:g} us"
              + (f"; measured rates {rates}" if rates else ""))  # fmt: skip
        for loss in ("clip", "siglip"):
            for b in batches:
                rows = model_loss(loss, b, g, passes, rates)
                everything += rows
                total = rows[-1]
                if b == max(batches):
                    print(f"-- {loss} B={b} C={total['C']} ({total['chunks']} chunks); the score product's float32 "
                          f"output alone: {total['fp32_write_ms']:.2f} ms at the HBM rate")  # fmt: skip
                    print(format_rows(rows))
                summary.append((g.name, loss, b, total["ms"]))
    print("\nmodelled totals, ms (fused / vanilla: measured on an H200, CLIP)")
    for name, loss, b, ms in summary:
        target = TARGETS.get((loss, name)) if b == 65536 else None
        fused = MEASURED_MS.get(b, (None, None)) if loss == "clip" else (None, None)
        verdict = "" if target is None else f"  target <= {target:g}: {'holds' if ms <= target else 'MISSED'}"
        extra = f"  fused {fused[0]:g} vanilla {fused[1]:g}" if fused[0] else ""
        print(f"  {name:9} {loss:7} B={b:6d} {ms:7.1f}{extra}{verdict}")
    if args.out:
        from .report import write_rows  # here: the model itself needs no torch

        write_rows(args.out, everything)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
