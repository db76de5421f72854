"""The report's output: the table of compiled kernels and the time model's table (stdout), the CSVs they are
written to and read back from (``--from-csv``, ``--measured``), and the plot."""

import csv
from pathlib import Path
from typing import Dict, List, Tuple

from .matrix import BATCHES
from .time_model import MODEL_TERMS

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results"


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


def write_csv(rows: List[Dict], path: Path) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})


def read_rows(path: Path) -> List[Dict]:
    """A report CSV (:func:`write_csv`) read back: the time model needs no compile to be rerun."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_measured(path: Path) -> Dict[Tuple, float]:
    """{(target, dtype, D, batch, kernel): measured ms} from a CSV with those columns and ``measured_ms``
    (bench/results/gpu-h100-kernels.csv; python -m bench.gpu_first's kernels.csv)."""
    with open(path, newline="") as f:
        return {
            (r["target"], r["dtype"], int(r["D"]), int(r["batch"]), r["kernel"]): float(r["measured_ms"])
            for r in csv.DictReader(f)
            if r.get("measured_ms")
        }


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
