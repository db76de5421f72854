"""The command line of ``python -m bench.static`` (the package docstring is its help)."""

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Dict

from .chunked import format_chunked, run_chunked
from .inf_cl_kernels import inf_cl_installed
from .infcl_internals import TILE_KERNELS, parse_tile
from .matrix import BATCHES, BF16, DIM, TARGETS, TF32
from .report import DEFAULT_OUT, format_model, format_table, read_measured, read_rows, write_csv, write_plot
from .resources import LIMITS
from .time_model import DEVICES, MODEL_BATCHES, Device, model_rows
from .workers import run

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
    parser = argparse.ArgumentParser(
        prog="python -m bench.static", description=sys.modules[__package__].__doc__.split("\n\n")[0]
    )
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
        "--masks",
        choices=("ids", "guide", "both"),
        help="cal_inf_loss with mask options (ids of 7 classes, a guide of width 100): the masked kernels",
    )
    parser.add_argument("--multi-positive", choices=("mean", "sum"), help="with --masks ids or both")
    parser.add_argument(
        "--label-smoothing", type=float, default=0.0, help="cal_inf_loss's label_smoothing (with --masks: kept sums)"
    )
    parser.add_argument(
        "--inf-cl",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also Inf-CL's kernels, compile-only (default: when inf_cl is importable)",
    )
    parser.add_argument(
        "--chunked",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the chunked route's passes (<name>-chunked.csv; bench.chunked_model reads it)",
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
    if args.multi_positive and args.masks not in ("ids", "both"):
        parser.error("--multi-positive needs --masks ids or both")
    options = {
        name: value
        for name, value in (
            ("masks", args.masks),
            ("multi_positive", args.multi_positive),
            ("label_smoothing", args.label_smoothing),
        )
        if value
    }
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
            options=options,
        )
        print(format_table(rows, batches))
        write_csv(rows, path)
        print(f"wrote {path}")
        if args.chunked:
            chunked = run_chunked(targets, batches, sms=args.sms)
            print(format_chunked(chunked, batches))
            write_csv(chunked, args.out / f"{args.name}-chunked.csv")
            print(f"wrote {args.out / f'{args.name}-chunked.csv'} (python -m bench.chunked_model models it)")
        if not args.no_plot:
            write_plot(rows, path.with_suffix(".png"))
            print(f"wrote {path.with_suffix('.png')}")
    # The measured times are the plain calls' kernels: not compared with other options' kernels.
    measured = read_measured(args.measured) if args.measured and not options else {}
    models = model_rows(rows, model_batches, devices_from(args), measured)
    print(format_model(models))
    model_path = args.out / f"{args.name}-model.csv"
    write_csv(models, model_path)
    print(f"wrote {model_path}")
