"""``python -m bench``: time and peak memory of the contrastive loss, vanilla vs infcl's backends.

With no arguments it runs the embedded "default" sweep (about 1-2 minutes on 2 cores) and writes
bench/results/default.csv and default.png. ``--preset issue`` is the full run of issue 4. Any of
--batch-sizes/--dims/--dtype/--modes/--one-direction replaces that field of the chosen preset's first
sweep and writes "custom.csv" (or --name). ``--loss siglip`` runs the same sweeps on the sigmoid
(SigLIP) loss, vanilla being open_clip's SigLipLoss, and prefixes the file names with "siglip-".
``--ids`` / ``--guide`` add each listed mask-capable backend (torch, cpu, triton) with false-negative ids / a guide
(``--loss siglip --ids``: the sigmoid loss with ids, every text of the image's class a positive)
("torch+ids", "cpu+guide", ...; bench.methods) beside the plain backend, and the time_vs_plain /
memory_vs_plain columns give their cost. ``--preset late-interaction`` runs bench.maxsim instead: the MaxSim loss
(``cal_maxsim_loss``) against sentence-transformers' multi-vector loss, with that module's options.
"""

import argparse
import itertools
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from .gemm import best_route, estimated_seconds, probe_rates
from .machine import AVX2_PROXY_ENV, device_name
from .methods import BASELINE, LOSSES, MASKED_BACKENDS, METHODS, PLAIN
from .presets import GPU_FIRST, LATE_INTERACTION, MATRYOSHKA, PRESETS, Sweep, custom_sweep
from .report import COLUMNS, add_ratios, format_table, write_csv, write_plot
from .worker import DTYPES, MODES, Job, run_isolated, set_worker_threads

# The options that replace a field of the preset's first sweep (bench.presets.Sweep) when given.
SWEEP_OPTIONS = ("batch_sizes", "dims", "dtype", "modes", "symmetric", "memory_only")
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
# The vanilla loss holds about this many [B, B] buffers at its fwd+bwd peak (logits, two
# log-softmax outputs, their gradients): measured ~1.4 GB at B=8192 and ~5.1 GB at B=16384 in fp32.
VANILLA_BUFFERS = 5
# Default --max-vanilla-gb: this share of the device's memory (the rest: inputs, the OS, neighbours).
VANILLA_MEMORY_SHARE = 0.5
DEFAULT_REPEATS = 5
# Default per-configuration limit: vanilla fwd+bwd at B=16384 takes ~18 s a run on 2 cores.
TIMEOUT_S = 1800
# Default --time-budget: a configuration estimated (bench.gemm) to take longer is skipped, e.g. vanilla bf16
# where torch's bf16 matmul crawls (0.5-17 GFLOP/s on an AVX2-only CPU).
TIME_BUDGET_S = 300.0


def _ints(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in text.replace(",", " ").split())


def _names(text: str) -> Tuple[str, ...]:
    return tuple(x for x in text.replace(",", " ").split())


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS) + [GPU_FIRST, LATE_INTERACTION, MATRYOSHKA],
        default="default",
        help=f"embedded sweep(s) to run; {GPU_FIRST}: the bounded first GPU run (python -m bench.gpu_first "
        f"--help for its options); {LATE_INTERACTION}: the MaxSim loss against sentence-transformers' (python -m "
        "bench.maxsim --help)",
    )
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default="clip",
        help="clip: the contrastive loss (cal_inf_loss); siglip: the sigmoid loss (cal_siglip_loss)",
    )
    p.add_argument("--batch-sizes", type=_ints, help="e.g. 2048,4096")
    p.add_argument("--dims", type=_ints, help="feature sizes D, e.g. 256,512")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--modes", type=_names, help=f"subset of {','.join(MODES)}")
    p.add_argument("--methods", type=_names, help=f"subset of {','.join(METHODS)} (default: all)")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument(
        "--symmetric",
        dest="symmetric",
        action="store_true",
        default=None,
        help="the CLIP loss (q->k + k->q) / 2 (the presets' choice)",
    )
    direction.add_argument("--one-direction", dest="symmetric", action="store_false", help="the q->k loss only")
    p.add_argument(
        "--ids",
        action="store_true",
        help="also each listed mask-capable backend with false-negative ids (torch+ids, cpu+ids)",
    )
    p.add_argument(
        "--guide",
        action="store_true",
        help="also each listed mask-capable backend with a guide of width D (torch+guide, cpu+guide)",
    )
    p.add_argument("--memory-only", action="store_true", default=None, help="peak memory only, one run each")
    p.add_argument(
        "--repeats",
        type=int,
        help=f"timed runs per configuration (median reported; default: the preset's, else {DEFAULT_REPEATS})",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before the timed ones")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=_usable_cores(), help="CPU threads per worker (default: all cores)")
    p.add_argument(
        "--max-vanilla-gb",
        type=float,
        help=f"skip vanilla where its estimated logits memory exceeds this (default: "
        f"{VANILLA_MEMORY_SHARE:g} x the device's memory)",
    )
    p.add_argument(
        "--avx2-proxy",
        action="store_true",
        help="run the workers as an AVX2-only CPU would (bench.machine.AVX2_PROXY_ENV; the machine's name says so)",
    )
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per configuration")
    p.add_argument(
        "--time-budget",
        type=float,
        default=TIME_BUDGET_S,
        help="skip a configuration whose runs, at the GEMM bound of the matmul route it multiplies in, would "
        "take longer than this many seconds (default: %(default)g)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default bench/results/)")
    p.add_argument("--name", help="output file stem (default: the preset name, or 'custom')")
    args = p.parse_args(argv)
    for mode in args.modes or ():
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r}; choose from {MODES}")
    for name in args.methods or ():
        if name not in METHODS:
            p.error(f"--methods: unknown method {name!r}; choose from {tuple(METHODS)}")
    if args.loss == "siglip" and args.guide:
        p.error("--guide is an option of the clip loss (--ids: the sigmoid loss with ids, several positives per row)")
    if args.loss == "siglip" and args.symmetric is not None:
        p.error("--symmetric / --one-direction choose the direction of the clip loss; the siglip loss has one form")
    return args


def _sweeps(args) -> Tuple[str, Tuple[Sweep, ...]]:
    overrides = {name: getattr(args, name) for name in SWEEP_OPTIONS}
    sweeps = PRESETS[args.preset]
    prefix = "" if args.loss == "clip" else f"{args.loss}-"
    if any(v is not None for v in overrides.values()):
        return args.name or f"{prefix}custom", (custom_sweep(sweeps[0], **overrides),)
    return args.name or f"{prefix}{args.preset}", sweeps


def _device_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def _vanilla_too_big(batch: int, dtype: str, max_gb: float):
    estimate = VANILLA_BUFFERS * batch * batch * DTYPES[dtype].itemsize / 1e9
    return f"estimated logits memory {estimate:.3g} GB > --max-vanilla-gb {max_gb:.3g}" if estimate > max_gb else None


def route_rates(args, sweeps) -> Dict[Tuple[str, int], Dict[str, float]]:
    """Per (dtype, D) of the timed sweeps, each matmul route's probed rate (bench.gemm.probe_rates): once,
    up front, in this process, so no slow route runs between a method's timed runs."""
    torch.set_num_threads(args.threads)
    rates = {}
    for sw in sweeps:
        for dim in () if sw.memory_only else sw.dims:
            if (sw.dtype, dim) not in rates:
                probed = probe_rates(max(sw.batch_sizes), dim, DTYPES[sw.dtype], torch.device(args.device))
                rates[sw.dtype, dim] = probed
                if len(probed) > 1:
                    shown = ", ".join(f"{route} {rate:.3g} GFLOP/s" for route, rate in probed.items())
                    print(
                        f"bench: {sw.dtype} D={dim} matmul routes: {shown} -> the bound takes {best_route(probed)}",
                        file=sys.stderr,
                    )
    return rates


def _too_slow(job: Job, rates: Dict[str, float], budget_s: float):
    """Why ``job`` is skipped by --time-budget (its runs at its route's GEMM bound), or None. Vanilla
    multiplies in the inputs' dtype; the tiled methods are estimated at the best route."""
    route = job.dtype if job.method == BASELINE else job.route()
    run_s = estimated_seconds(job.batch, job.dim, job.mode, rates.get(route, float("nan")))
    if run_s is None:
        return None
    total = run_s * (job.warmup + job.repeats + 1)  # + the memory run
    if total <= budget_s:
        return None
    return (
        f"estimated >= {total:.3g} s ({job.warmup + job.repeats + 1} runs at {rates[route]:.3g} GFLOP/s, "
        f"{route} matmul) > --time-budget {budget_s:g} s"
    )


def plan(args, sweeps, rates=None) -> Tuple[List[Job], List[Dict]]:
    """The jobs to run, and the rows decided without running: unavailable methods, oversized vanilla,
    configurations over the time budget (``rates``: from :func:`route_rates`; None: no estimate)."""
    rates = rates or {}
    device = torch.device(args.device)
    max_gb = args.max_vanilla_gb or VANILLA_MEMORY_SHARE * _device_memory_gb(device)
    jobs, decided = [], []
    for sw in sweeps:
        repeats = 1 if sw.memory_only else (args.repeats or sw.repeats or DEFAULT_REPEATS)
        common = dict(
            dtype=sw.dtype,
            device=args.device,
            threads=args.threads,
            warmup=args.warmup,
            repeats=repeats,
            loss=args.loss,
            symmetric=sw.symmetric and args.loss == "clip",
            memory_only=sw.memory_only,
            accuracy=sw.accuracy and not sw.memory_only,
        )
        names = [m for m in sw.methods if args.methods is None or m in args.methods]
        if (args.ids or args.guide) and not set(names) & set(MASKED_BACKENDS):
            names.append(PLAIN)  # the mask options' cost is taken against the plain backend of the same run
        options = [option for option, asked in (("ids", args.ids), ("guide", args.guide)) if asked]
        names += [f"{plain}+{option}" for plain in names if plain in MASKED_BACKENDS for option in options]
        for dim, batch in itertools.product(sw.dims, sw.batch_sizes):
            routes = rates.get((sw.dtype, dim), {})
            for name, mode in itertools.product(names, sw.modes):
                job = Job(name, batch, dim, mode=mode, gemm_route=best_route(routes) if routes else "", **common)
                unavailable = METHODS[name].unavailable_for(args.loss, device, dim)
                too_big = _vanilla_too_big(batch, sw.dtype, max_gb) if name == BASELINE else None
                too_big = too_big or _too_slow(job, routes, args.time_budget)
                if unavailable is None and too_big is None:
                    jobs.append(job)
                else:
                    decided.append(
                        {
                            **row_of(job),
                            "status": "skipped",
                            "note": unavailable or too_big,
                            "unavailable": unavailable is not None,
                        }
                    )
    return jobs, decided


def row_of(job: Job) -> Dict:
    """The job's fields that are result columns (bench.report.COLUMNS)."""
    return {name: value for name, value in asdict(job).items() if name in COLUMNS}


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal (logs, CI); the per-config lines still print.
    return tqdm(total=total, unit="config", file=sys.stderr, dynamic_ncols=True, disable=None)


def load_average() -> Optional[float]:
    """The 1-minute load average (None where the OS has none): other processes' share of the cores."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run(jobs: List[Job], timeout_s: float) -> List[Dict]:
    """Run every job in its own process; returns one row per job."""
    rows = []
    bar = _progress(len(jobs))
    say = bar.write if bar is not None else (lambda s: print(s, file=sys.stderr, flush=True))
    for i, job in enumerate(jobs, 1):
        if bar is not None:
            bar.set_description(job.label())
        before = load_average()
        result = run_isolated(job, timeout_s)
        loads = [x for x in (before, load_average()) if x is not None]
        rows.append({**row_of(job), **result, "load_avg": round(max(loads), 2) if loads else None})
        t = f"{result['time_s']:.4g} s, " if "time_s" in result else ""
        mem = f"{result['peak_extra_mib']:.1f} MiB" if "peak_extra_mib" in result else result.get("note", "")
        gemm = f", GEMM {result['gemm_gflops']:.1f} GFLOP/s" if "gemm_gflops" in result else ""
        load = f", load {max(loads):.2f}" if loads else ""
        say(f"[{i}/{len(jobs)}] {job.label()}: {result['status']} {t}{mem}{gemm}{load}")
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset")
    known, rest = pre.parse_known_args(argv)
    if known.preset == GPU_FIRST:  # a scripted run with its own options, not a sweep
        from .gpu_first import main as gpu_first_main

        return gpu_first_main(rest)
    if known.preset == MATRYOSHKA:  # issue 56's table: its own methods and options (bench.matryoshka)
        from .matryoshka import main as matryoshka_main

        return matryoshka_main(rest)
    if known.preset == LATE_INTERACTION:  # infcl's MaxSim loss against sentence-transformers', its own options
        from .maxsim import main as maxsim_main

        return maxsim_main(rest)
    args = parse_args(argv)
    name, sweeps = _sweeps(args)
    set_worker_threads(args.threads)
    if args.avx2_proxy:
        os.environ.update(AVX2_PROXY_ENV)  # before the first worker starts: each variable is read at start-up
    jobs, decided = plan(args, sweeps, route_rates(args, sweeps))
    print(
        f"bench: {len(jobs)} configurations on {args.device} with {args.threads} thread(s) -> {args.out}/{name}.*",
        file=sys.stderr,
    )
    rows = run(jobs, args.timeout) + decided
    rows.sort(
        key=lambda r: (r["dtype"], r["dim"], r["batch"], MODES.index(r["mode"]), list(METHODS).index(r["method"]))
    )
    add_ratios(rows)
    machine = device_name(args.device)
    for row in rows:
        row["device_name"] = machine
    loads = [r["load_avg"] for r in rows if r.get("load_avg") is not None]
    load = f", load average {min(loads):.2f}-{max(loads):.2f}" if loads else ""
    where = f"{args.device} ({machine}), {args.threads} thread(s){load}"
    print(format_table(rows, f"infcl bench '{name}' ({args.loss} loss) on {where}"))
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = args.out / f"{name}.csv", args.out / f"{name}.png"
    write_csv(rows, csv_path)
    write_plot(rows, png_path, f"infcl bench '{name}' ({args.loss} loss) on {where}")
    print(f"wrote {csv_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
