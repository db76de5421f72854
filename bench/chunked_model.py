"""``python -m bench.chunked_model``: a MODEL (not a measurement) of the chunked route's time, beside bench.static.

The symmetric bf16 loss, forward + backward, one block of B x B at D = 512 (``backend="chunked"``,
docs/chunked.md), per kernel as a roofline: each kernel takes max(its flops / the GEMM rate, its HBM bytes / the
bandwidth), and the kernels run one after another (no overlap between them, no launch gaps). Per S entry:

    forward   scores GEMM (2*D flops, writes 4 B)   stats pass (reads 4 B)
    backward  scores GEMM (2*D flops, writes 4 B)   grad pass (reads 4 B, writes dS 2 B)
              dq GEMM (2*D flops, reads dS 2 B)     dk GEMM (2*D flops, reads dS 2 B; + dk's float32 read and
                                                    write once per chunk: 8 * D / C bytes an entry)

Assumptions (printed with every run): H200 bf16 dense GEMM rate 652 TFLOP/s (measured: bench/results/
gpu-first-h200.md) for every product whatever its shape, HBM ~4.1 TB/s for every pass, C = 2048. ``--from-ab``
replaces them with a GPU's measured rates from ``python -m bench.gpu_ab``'s ab.csv (the three products at the
chosen C, the two passes' GB/s). The measured columns (fused kernels, vanilla) are the H200 run's.
"""

import argparse
import csv
from pathlib import Path
from typing import Dict, Optional

GEMM_TFLOPS = 652.0  # H200, bf16, measured by the gpu-first run (bench/results/gpu-first-h200.md)
HBM_TBS = 4.1  # H200, a plain copy's rate, ~85% of the 4.8 TB/s peak
DIM = 512
CHUNK_ROWS = 2048
# bench/results/gpu-first-h200.md: B -> (infcl "triton" ms, vanilla ms), bf16, D = 512, symmetric fwd + bwd.
MEASURED_MS = {16384: (16.1, 6.7), 32768: (49.5, 27.4), 65536: (191.9, 113.9)}


def modelled_ms(
    b: int, d: int = DIM, chunk_rows: int = CHUNK_ROWS, rates: Optional[Dict[str, float]] = None
) -> Dict[str, float]:
    """Per-kernel times (ms) of one B x B block and their sum ("serial"), and the issue's estimate ("overlapped":
    4 GEMM-equivalents at the GEMM rate plus the passes' 10 bytes an entry and dk's read-modify-write at the HBM
    rate). ``rates``: TFLOP/s of "scores", "dq", "dk" and GB/s of "stats pass", "grad pass" (default: the
    module's assumptions)."""
    rates = dict(rates or {})
    flops = 2.0 * b * b * d
    entries = float(b) * b
    hbm = HBM_TBS * 1e12
    dk_rmw = (b / chunk_rows) * b * d * 8

    def gemm(name: str, nbytes: float) -> float:
        return max(flops / (rates.get(name, GEMM_TFLOPS) * 1e12), nbytes / hbm) * 1e3

    def stream(name: str, nbytes: float) -> float:
        return nbytes / (rates.get(name, HBM_TBS * 1e3) * 1e9) * 1e3

    kernels = {
        "scores (forward)": gemm("scores", 4 * entries),
        "stats pass": stream("stats pass", 4 * entries),
        "scores (backward)": gemm("scores", 4 * entries),
        "grad pass": stream("grad pass", 6 * entries),
        "dq product": gemm("dq", 2 * entries),
        "dk product": gemm("dk", 2 * entries) + dk_rmw / hbm * 1e3,
    }
    kernels["serial"] = sum(kernels.values())
    kernels["overlapped"] = (4 * flops / (GEMM_TFLOPS * 1e12) + (10 * entries + dk_rmw) / hbm) * 1e3
    return kernels


def rates_from_ab(path: Path, chunk_rows: int) -> Dict[str, float]:
    """The three products' TFLOP/s at C = ``chunk_rows`` and the passes' GB/s (largest C measured) from ab.csv."""
    rates = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["step"] == "gemm" and row["case"].startswith(f"C={chunk_rows} ") and row["unit"] == "TFLOP/s":
                rates[row["metric"]] = float(row["value"])
            if row["step"] == "passes" and row["unit"] == "GB/s" and row["metric"] != "copy":
                rates[row["metric"]] = float(row["value"])
    return rates


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.chunked_model", description=__doc__.splitlines()[0])
    parser.add_argument("--from-ab", type=Path, help="ab.csv of python -m bench.gpu_ab: its measured rates")
    parser.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS)
    args = parser.parse_args(argv)
    rates = rates_from_ab(args.from_ab, args.chunk_rows) if args.from_ab else {}
    print("MODEL, not a measurement: the chunked route (backend='chunked'), bf16, D = 512, symmetric fwd + bwd")
    print(
        f"assumptions: GEMM {GEMM_TFLOPS:g} TFLOP/s (H200 bf16, measured) for every product, HBM {HBM_TBS:g} TB/s "
        f"for every pass, C = {args.chunk_rows}, kernels back to back (no overlap, no launch gaps)"
    )
    if rates:
        print(f"measured rates from {args.from_ab}: " + ", ".join(f"{k} {v:g}" for k, v in sorted(rates.items())))
    print(
        f"{'B':>7} {'GEMMs ms':>9} {'passes ms':>9} {'model ms':>9} {'issue est.':>10} {'fused ms':>9} {'vanilla':>8}"
    )
    for b, (fused, vanilla) in MEASURED_MS.items():
        t = modelled_ms(b, DIM, args.chunk_rows, rates)
        gemms = sum(v for k, v in t.items() if "product" in k or "scores" in k)
        passes = t["stats pass"] + t["grad pass"]
        print(
            f"{b:>7} {gemms:9.1f} {passes:9.1f} {t['serial']:9.1f} {t['overlapped']:10.1f} {fused:9.1f} {vanilla:8.1f}"
        )


if __name__ == "__main__":
    main()
