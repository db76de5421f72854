"""summary.md: the tables to paste, rewritten after every stage from whatever CSVs exist so far; the per-kernel
table beside the static time model (this run's, or the stored report's when the static step did not finish)."""

import dataclasses
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .correctness import GRADS, REL_TOL
from .files import read_rows
from .plan import DIM


def _table(heads: Sequence[str], rows: List[Sequence]) -> str:
    lines = ["| " + " | ".join(heads) + " |", "| " + " | ".join("---" for _ in heads) + " |"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _num(text, fmt="{:.3g}") -> str:
    try:
        return fmt.format(float(text))
    except (TypeError, ValueError):
        return text or "-"


def model_for_summary(out: Path) -> Tuple[List[Dict], str]:
    """The static model's rows: this run's static step's, or else the stored report's (bench/results/static.csv,
    compiled by the Triton on the machine that made it) with this device's SM count and GEMM rate."""
    from .. import static

    path = out / "static-model.csv"
    if path.exists():
        return read_rows(path), "this run's bench.static (compiled by this machine's Triton)"
    stored = static.DEFAULT_OUT / "static.csv"
    if not stored.exists():
        return [], "no static model"
    env = dict(read_rows(out / "env.csv", ("key", "value")))
    device = static.DEVICES[90]
    rates = [
        float(r["gemm_tflops"])
        for r in read_rows(out / "speed.csv")
        if r["method"].startswith("torch.mm") and r["gemm_tflops"]
    ]
    if env.get("sms"):
        device = dataclasses.replace(device, sms=int(env["sms"]))
    if rates:
        device = dataclasses.replace(device, tflops=rates[0])
    rows = [r for r in static.read_rows(stored) if r["target"] == "sm_90" and r["D"] == str(DIM)]
    measured = static.read_measured(out / "kernels.csv") if (out / "kernels.csv").exists() else {}
    try:
        models = static.model_rows(rows, static.MODEL_BATCHES, {90: device}, measured)
    except (KeyError, ValueError) as err:  # a report written before the model's columns
        return [], f"no static model: the stored bench/results/static.csv lacks {err}"
    return models, "the stored bench/results/static.csv (sm_90, compiled by the Triton of the machine that made it)"


def write_summary(out: Path) -> Path:
    """summary.md: the run's tables, from whatever CSVs exist so far."""
    env = dict(read_rows(out / "env.csv", ("key", "value")))
    head = ", ".join(
        f"{k} {env[k]}" for k in ("device", "sms", "torch", "cuda", "triton", "inf_cl", "infcl_commit") if k in env
    )
    parts = [f"# gpu-first: {head or 'no env yet'}", ""]
    if env.get("driver, max SM clock, power limit"):
        parts += [f"driver, max SM clock, power limit: {env['driver, max SM clock, power limit']}", ""]
    steps = read_rows(out / "steps.csv")
    parts += ["steps: " + "; ".join(f"{s['step']} {s['status']} {_num(s['wall_s'], '{:.0f}')} s" for s in steps), ""]
    for section in (_speed_section, _route_section, _kernels_section, _correctness_section, _first_calls_section):
        parts += section(out)
    path = out / "summary.md"
    path.write_text("\n".join(parts))
    return path


def _speed_section(out: Path) -> List[str]:
    """The speed table: each method's time beside vanilla's and the 5-GEMM bound."""
    speed = read_rows(out / "speed.csv")
    gemm = [r for r in speed if r["method"].startswith("torch.mm")]
    if not speed:
        return []
    vanilla = {(r["loss"], r["batch"]): float(r["time_ms"]) for r in speed if r["method"] == "vanilla" and r["time_ms"]}
    rows = []
    for r in sorted(speed, key=lambda r: (r["loss"], int(r["batch"] or 0))):
        if r["method"].startswith("torch.mm"):
            continue
        base = vanilla.get((r["loss"], r["batch"]))
        x_vanilla = float(r["time_ms"]) / base if r["time_ms"] and base else None
        rows.append(
            [
                r["loss"],
                r["batch"],
                r["method"],
                _num(r["time_ms"], "{:.1f}") if r["status"] == "ok" else r["status"],
                _num(x_vanilla, "{:.2f}"),
                _num(r["x_bound"], "{:.2f}"),
                _num(r["peak_mib"], "{:.0f}"),
                _num(r["first_call_s"], "{:.1f}"),
                _num(r["sm_clock_mhz"], "{:.0f}"),
                r["note"][:80],
            ]
        )
    rate = f"{float(gemm[0]['gemm_tflops']):.0f} TFLOP/s" if gemm and gemm[0]["gemm_tflops"] else "?"
    return [
        f"## Speed: bf16, D = {DIM}, CLIP symmetric and SigLIP, forward + backward (CUDA events, median); bf16 GEMM "
        f"{rate}; the bound: the route's 4 (CLIP) / 3 (SigLIP) GEMM-equivalents, the others' 5",
        "",
        _table(
            ["loss", "B", "method", "ms", "x vanilla", "x GEMM bound", "peak MiB", "first call s", "SM MHz", "note"],
            rows,
        ),
        "",
    ]


def _route_section(out: Path) -> List[str]:
    """The chunked route's own rows (probes, products, passes, S bits, the million, peers' installs, the auto
    table's suggestion), as they came."""
    rows = [[r["step"], r["case"], r["metric"], _num(r["value"]), r["unit"], r["note"][:90]]
            for r in read_rows(out / "route.csv")]  # fmt: skip
    if not rows:
        return []
    return ["## The chunked route (route.csv)", "", _table(["step", "case", "metric", "value", "unit", "note"], rows),
            ""]  # fmt: skip


def _kernels_section(out: Path) -> List[str]:
    """The per-kernel table: torch.profiler's times beside the static model's."""
    kernels = read_rows(out / "kernels.csv")
    if not kernels:
        return []
    models, source = model_for_summary(out)
    by_key = {(str(m["batch"]), m["kernel"]): m for m in models}
    rows = []
    for r in kernels:
        m = by_key.get((r["batch"], r["kernel"]), {})
        serial, bound = m.get("serial_ms"), m.get("bound_ms")
        error = "-"
        if serial and r["measured_ms"]:
            error = f"{100 * (float(serial) / float(r['measured_ms']) - 1):+.0f}%"
        rows.append(
            [
                r["batch"],
                r["kernel"],
                _num(r["calls_per_step"], "{:.0f}"),
                _num(r["measured_ms"], "{:.2f}"),
                _num(serial, "{:.2f}"),
                _num(bound, "{:.2f}"),
                m.get("limiter", "-"),
                error,
            ]
        )
    return [
        "## Per kernel (torch.profiler, ms per call) beside the static model",
        "",
        f"model: {source}",
        "",
        _table(["B", "kernel", "calls/step", "measured", "model (serial)", "model (max)", "limiter", "error"], rows),
        "",
    ]


def _correctness_section(out: Path) -> List[str]:
    """The correctness table: each case's errors against float64."""
    checks = read_rows(out / "correctness.csv")
    if not checks:
        return []
    rows = [
        [
            r["case"],
            r.get("backend", ""),
            r["batch"],
            r["dtype"],
            {"True": "sym", "False": "one"}.get(r["symmetric"], "-"),
            r["status"] if r["status"] != "ok" else "",
            *[_num(r[f"{n}_err"], "{:.1e}") for n in GRADS],
            _num(r["vanilla_err"], "{:.1e}"),
            r["within_tol"],
            r["within_vanilla"],
            r["bit_identical"],
            _num(r["first_call_s"], "{:.1f}"),
            r["note"][:80],
        ]
        for r in checks
    ]
    return [
        "## Correctness: relative 2-norm error against float64 (infcl's torch tiles in float64)",
        "",
        f"within tol: each error <= its storage floor (the truth rounded to the result's dtype) + {REL_TOL}; "
        "within vanilla: each <= 2 x torch's own + 2^-9",
        "",
        _table(
            [
                "case",
                "backend",
                "B",
                "dtype",
                "dir",
                "status",
                *GRADS,
                "vanilla worst",
                "within tol",
                "within vanilla",
                "rerun identical",
                "first call s",
                "note",
            ],
            rows,
        ),
        "",
    ]


def _first_calls_section(out: Path) -> List[str]:
    """The first calls (the compile) less a warm call, at the smallest speed batch."""
    speed = read_rows(out / "speed.csv")
    batches = [int(r["batch"]) for r in speed if r["batch"] and not r["method"].startswith("torch.mm")]
    smallest = str(min(batches)) if batches else None
    firsts = [
        [
            f"{r['method']} {r['loss']} bf16 fwd+bwd, B={r['batch']}",
            _num(r["first_call_s"], "{:.2f}"),
            _num(float(r["time_ms"]) / 1e3, "{:.3f}"),
            _num(float(r["first_call_s"]) - float(r["time_ms"]) / 1e3, "{:.2f}"),
        ]
        for r in speed
        if r["status"] == "ok" and r["first_call_s"] and r["batch"] == smallest
    ]
    if not firsts:
        return []
    return [
        "## First call (Triton's compile, or Inf-CL's and its process group's start) less a warm call",
        "",
        _table(["what", "first call s", "warm s", "difference s"], firsts),
        "",
        "The correctness table's first calls include the compile of each case's kernels.",
        "",
    ]
