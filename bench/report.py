"""Results: ratios against vanilla and the GEMM bound, the printed table, the CSV and the plot."""

import csv
import math
from pathlib import Path
from typing import Dict, List

from .gemm import gemm_bound_seconds, gemm_flops
from .methods import BASELINE, MASK_METHODS, MASKED_BACKENDS, plain_of

COLUMNS = (
    "method",
    "loss",
    "device",
    "device_name",
    "dtype",
    "batch",
    "dim",
    "symmetric",
    "mode",
    "status",
    "time_s",
    "time_min_s",
    "repeats",
    "peak_extra_mib",
    "time_vs_vanilla",
    "memory_vs_vanilla",
    "time_vs_plain",
    "memory_vs_plain",
    "gemm_bound_s",
    "time_vs_gemm_bound",
    "gemm_gflops",
    "gemm_route",
    "gemm_equivalents",
    "gemm_fraction",
    "loss_rel_error",
    "grad_rel_error",
    "threads",
    "load_avg",
    "note",
)


# Columns the CSV keeps and the printed table leaves out: where it ran, spreads, and the raw rates behind
# the ratios it shows. ``load_avg``: the higher of the 1-minute load averages at the job's start and end
# (the table's title gives their range), the benchmark's own threads included (a quiet machine reads about
# --threads at the end of a long job): on a shared machine a timing means little without it.
CSV_ONLY = (
    "device",
    "device_name",
    "time_min_s",
    "repeats",
    "gemm_bound_s",
    "gemm_gflops",
    "gemm_equivalents",
    "loss_rel_error",
    "threads",
    "load_avg",
)
# Shown in the table only when some row has them (the mask options' cost against the plain tiles).
PLAIN_RATIOS = ("time_vs_plain", "memory_vs_plain")
# Characters of a note shown in the printed table (the CSV keeps it whole).
NOTE_WIDTH = 70
# Significant digits of the floats in the CSV.
CSV_DIGITS = 6


def _key(row: Dict):
    return row["loss"], row["device"], row["dtype"], row["batch"], row["dim"], row["symmetric"], row["mode"]


def add_ratios(rows: List[Dict]) -> None:
    """Fill the ratio columns in place; each row's GEMM bound is from its own ``gemm_gflops``."""
    vanilla = {_key(r): r for r in rows if r["method"] == BASELINE and r["status"] == "ok"}
    plain = {(_key(r), r["method"]): r for r in rows if r["method"] in MASKED_BACKENDS and r["status"] == "ok"}
    for row in rows:
        if row["status"] != "ok":
            continue
        base = plain.get((_key(row), plain_of(row["method"]))) if row["method"] in MASK_METHODS else None
        if base is not None:  # the cost of ids / a guide on the same backend, in the same run
            if base["peak_extra_mib"] > 0:
                row["memory_vs_plain"] = row["peak_extra_mib"] / base["peak_extra_mib"]
            if row.get("time_s") is not None and base.get("time_s") is not None:
                row["time_vs_plain"] = row["time_s"] / base["time_s"]
        base = vanilla.get(_key(row))
        if base is not None:
            if base["peak_extra_mib"] > 0:
                row["memory_vs_vanilla"] = row["peak_extra_mib"] / base["peak_extra_mib"]
            if row.get("time_s") is not None and base.get("time_s") is not None:
                row["time_vs_vanilla"] = row["time_s"] / base["time_s"]
        rate = row.get("gemm_gflops")
        if rate is not None and row.get("time_s") is not None:
            row["gemm_bound_s"] = gemm_bound_seconds(row["batch"], row["dim"], row["mode"], rate * 1e9)
            row["time_vs_gemm_bound"] = row["time_s"] / row["gemm_bound_s"]
            if row.get("gemm_equivalents"):  # the method's own products per second, / the matmul rate
                row["gemm_fraction"] = (
                    row["gemm_equivalents"] * gemm_flops(row["batch"], row["dim"]) / row["time_s"] / (rate * 1e9)
                )


def _fmt(value, digits: int = 3) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)[:NOTE_WIDTH]


def format_table(rows: List[Dict], title: str = "") -> str:
    """Measured rows as an aligned table under ``title`` (which names the machine); rows skipped for an
    unavailable method are summarized below it."""
    with_plain = any(r.get("time_vs_plain") is not None for r in rows)  # --ids / --guide: cost beside "torch"
    heads = tuple(c for c in COLUMNS if c not in CSV_ONLY and (with_plain or c not in PLAIN_RATIOS))
    shown = [r for r in rows if not (r["status"] == "skipped" and r.get("unavailable"))]
    cells = [heads] + [tuple(_fmt(r.get(h)) for h in heads) for r in shown]
    widths = [max(len(c[i]) for c in cells) for i in range(len(heads))]
    # Numbers right-aligned, the free-text note (last) left-aligned.
    lines = ["  ".join([c[i].rjust(widths[i]) for i in range(len(heads) - 1)] + [c[-1]]) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if title:
        lines.insert(0, title)
    skipped = {r["method"]: r["note"] for r in rows if r["status"] == "skipped" and r.get("unavailable")}
    lines += [f"skipped {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines)


def write_rows(path, rows: List[Dict], columns=None) -> None:
    """``rows`` as they are, as a CSV at ``path``: ``columns``, or every key in the order the rows first name it."""
    columns = list(dict.fromkeys(k for r in rows for k in r)) if columns is None else columns
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def _csv_cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.{CSV_DIGITS}g}"
    return "" if value is None else str(value)


def write_csv(rows: List[Dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _csv_cell(row.get(c)) for c in COLUMNS})


def _series(rows: List[Dict], value: str):
    """{label: (batches, values)} of the ok rows with ``value``, one mode per series (fwd+bwd first)."""
    out = {}
    for row in sorted(rows, key=lambda r: (r["batch"], r["mode"] != "forward+backward")):
        if row["status"] != "ok" or not row.get(value):
            continue  # log axes: nothing to draw for a missing or zero value
        label = f"{row['method']} {row['dtype']} D={row['dim']}"
        xs, ys, mode = out.setdefault(label, ([], [], row["mode"]))
        if row["mode"] == mode and row["batch"] not in xs:
            xs.append(row["batch"])
            ys.append(row[value])
    return out


def _bounds(rows: List[Dict]):
    """{label: (batches, seconds)}: per dtype and D, the GEMM bound at each B from the fastest matmul
    rate its rows measured, for forward+backward (or the one mode that was run)."""
    best = {}
    for row in rows:
        if row["status"] == "ok" and row.get("gemm_bound_s"):
            key = (row["dtype"], row["dim"], row["mode"])
            per_batch = best.setdefault(key, {})
            per_batch[row["batch"]] = min(per_batch.get(row["batch"], math.inf), row["gemm_bound_s"])
    out = {}
    for (dtype, dim, mode), per_batch in best.items():
        if mode != "forward+backward" and (dtype, dim, "forward+backward") in best:
            continue
        batches = sorted(per_batch)
        out[f"GEMM bound {dtype} D={dim} ({mode})"] = (batches, [per_batch[b] for b in batches])
    return out


def write_plot(rows: List[Dict], path: Path, title: str) -> None:
    """Peak extra memory and time against B on log-log axes, with the GEMM bound dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.8))
    for label, (xs, ys, mode) in _series(rows, "peak_extra_mib").items():
        ax_mem.plot(xs, ys, marker="o", label=f"{label} ({mode})")
    for label, (xs, ys, mode) in _series(rows, "time_s").items():
        ax_time.plot(xs, ys, marker="o", label=f"{label} ({mode})")
    for label, (xs, ys) in _bounds(rows).items():
        ax_time.plot(xs, ys, "k--", linewidth=1, label=label)
    for ax, ylabel in ((ax_mem, "peak extra memory [MiB]"), (ax_time, "time [s] (median)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size B")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
