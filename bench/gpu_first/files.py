"""The files the run writes, with their columns, and how rows reach them: appended one at a time as a step has
them (a run cut off from outside still leaves its data), and read back for the summary."""

import csv
import io
from pathlib import Path
from typing import Dict, List

# Every file the run writes, with its columns (``--dry-run`` writes these headers).
FILES = {
    "steps.csv": ("step", "status", "rc", "wall_s", "timeout_s", "note"),
    "env.csv": ("key", "value"),
    "speed.csv": (
        "method",
        "loss",
        "batch",
        "dim",
        "dtype",
        "status",
        "time_ms",
        "time_min_ms",
        "repeats",
        "peak_mib",
        "gemm_tflops",
        "bound_ms",
        "x_bound",
        "first_call_s",
        "sm_clock_mhz",
        "note",
    ),
    "kernels.csv": ("target", "dtype", "D", "batch", "kernel", "method", "calls_per_step", "measured_ms", "source"),
    "correctness.csv": (
        "case",
        "backend",
        "batch",
        "dtype",
        "symmetric",
        "status",
        "loss_err",
        "dq_err",
        "dk_err",
        "dscale_err",
        "dbias_err",
        "vanilla_err",
        "tolerance",
        "storage_floor",
        "within_tol",
        "within_vanilla",
        "bit_identical",
        "first_call_s",
        "note",
    ),
    # the chunked route's own measurements, one result a row: products, passes, S bits, the million, the dtype_out
    # probes, the auto table's suggestion, the peers' installs
    "route.csv": ("step", "case", "metric", "value", "unit", "note"),
}


def append_row(path: Path, row: Dict) -> None:
    """One row appended to ``path`` (header from :data:`FILES`), in one write: the file is complete after every
    row, and the correctness steps' rows do not interleave."""
    columns = FILES[path.name]
    if not path.exists():
        write_header(path)
    line = _csv_line([_cell(row.get(c)) for c in columns])
    with open(path, "a") as f:
        f.write(line)


def write_header(path: Path) -> None:
    with open(path, "w") as f:
        f.write(_csv_line(FILES[path.name]))


def _csv_line(cells) -> str:
    buf = io.StringIO()
    csv.writer(buf).writerow(cells)
    return buf.getvalue()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def route_row(out: Path, step: str, case: str, metric: str, value, unit: str = "", note: str = "") -> None:
    """One result of the route's steps appended to route.csv (and printed: the step's log)."""
    append_row(out / "route.csv", {"step": step, "case": case, "metric": metric, "value": value, "unit": unit,
                                   "note": note})  # fmt: skip
    print(f"{step:10} {case:34} {metric:24} {_cell(value)} {unit} {note}", flush=True)


def read_rows(path: Path, columns=None) -> List:
    """``path``'s rows as dicts (none if it does not exist yet), or as tuples of ``columns``."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [tuple(r[c] for c in columns) for r in rows] if columns else rows
