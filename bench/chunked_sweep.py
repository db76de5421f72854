"""``python -m bench.chunked_sweep``: the chunked route's A/B on a GPU, beside the one GPU runner (bench/gpu_first/).

Two questions the first gpu-first run on an H100 left open (docs/benchmarks.md, "Measured: one H100, 2026-12-06"):

- ``stats``: the forward's stats pass read S at 1.0 TB/s against a copy's 3.0 (17.7 of the route's 64 ms at
  B = 65536). Each candidate tiling of the pass (block rows x columns, warps, tiles per column split) times
  :func:`infcl.kernels.chunked_softmax.chunk_stats` on one symmetric chunk (C x Bk float32 scores) and compares its
  row and column stats with the shipped tiling's (a tiling changes only the order of the sums); then the route's
  whole forward + backward at the largest B, with the shipped tiling and the fastest candidate, in one process.
- ``auto``: where ``backend="auto"`` should take the route below B = 16384 (the smallest B gpu-first measured):
  the CLIP and SigLIP losses' forward + backward, bf16, D = 512, the route against the fused kernels and vanilla.
- ``matryoshka``: the fused Matryoshka kernels (``backend="triton"``, :mod:`infcl.kernels.matryoshka`) against the
  same Triton backend running one loss per prefix and against one full-dimension loss: bf16, D = 768, dims
  (768, 512, 256, 128, 64), symmetric, B = 16384 (their GEMM-equivalents model 18.7 fused against 16.6 per prefix
  and 9 for one loss: ``auto`` takes the fused kernels until this measures them).

Rows go to ``<out>/sweep.jsonl`` as they come. ``--dry-run``: the same on CPU tensors at toy sizes (with
TRITON_INTERPRET=1, the passes run in Triton's interpreter; the torch tiles stand in for the fused kernels).
"""

import argparse
import contextlib
import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from .errors import relative
from .gpu_first.speed import chunk_plan, ours
from .gpu_first.timing import device_for, fwd_bwd, time_step, timed

# (block_m, block_n, num_warps, split_tiles): the shipped tiling first.
CANDIDATES = (
    (64, 64, 8, 16),
    (64, 64, 4, 16),
    (64, 64, 8, 32),
    (64, 64, 8, 8),
    (128, 64, 8, 16),
    (64, 128, 8, 16),
    (32, 128, 4, 16),
    (32, 64, 4, 16),
    (128, 64, 4, 16),
    (32, 256, 8, 16),
)


def append_row(path: Path, row: Dict) -> None:
    """One JSON line per row, written as it comes (the rows' keys differ between steps)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


@contextlib.contextmanager
def stats_tiling(config: Tuple[int, int, int, int]):
    """The stats pass under ``config`` (block_m, block_n, warps, tiles per column split) inside the block; the
    shipped tiling again after it."""
    from infcl.kernels import chunked_softmax as passes

    block_m, block_n, warps, split = config
    saved = passes.CHUNK_STATS_TILE, passes.CHUNK_SPLIT_TILES
    passes.CHUNK_STATS_TILE = replace(saved[0], block_m=block_m, block_n=block_n, num_warps=warps)
    passes.CHUNK_SPLIT_TILES = split
    try:
        yield
    finally:
        passes.CHUNK_STATS_TILE, passes.CHUNK_SPLIT_TILES = saved


def _stats_run(raw, scale, pos, config: Tuple[int, int, int, int]):
    """One symmetric chunk_stats call under ``config``: (rows_out, column stats)."""
    from infcl.kernels.chunked_softmax import chunk_stats

    with stats_tiling(config):
        rows_out = torch.empty(3, raw.shape[0], dtype=torch.float32, device=raw.device)
        return rows_out, chunk_stats(raw, scale, pos, True, rows_out)


def sweep_stats(out: Path, rows: int, cols: int, repeats: int, device, candidates=CANDIDATES) -> List[Dict]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    raw = (torch.randn(rows, cols, generator=gen) * 0.3).to(device)
    scale = torch.tensor(1 / 0.07, device=device)
    pos = torch.arange(rows, device=device)
    copy_s = timed(lambda: raw.clone(), device, repeats)
    base = _stats_run(raw, scale, pos, CANDIDATES[0])
    results = []
    for config in candidates:
        row = {"step": "stats", "config": "x".join(map(str, config)), "rows": rows, "cols": cols}
        try:
            got = _stats_run(raw, scale, pos, config)
            seconds = timed(functools.partial(_stats_run, raw, scale, pos, config), device, repeats)
            row.update(
                status="ok",
                ms=seconds * 1e3,
                gb_s=raw.numel() * 4 / seconds / 1e9,
                copy_gb_s=2 * raw.numel() * 4 / copy_s / 1e9,
                row_r_rel=relative(got[0][1], base[0][1]),
                row_max_equal=bool(torch.equal(got[0][0], base[0][0])),
                col_r_rel=relative(got[1][1], base[1][1]),
                col_max_equal=bool(torch.equal(got[1][0], base[1][0])),
            )
        except Exception as err:  # a config that does not compile or fit is a row, the next one runs
            row.update(status="error", note=f"{type(err).__name__}: {str(err)[:160]}")
        append_row(out / "sweep.jsonl", row)
        print(row, flush=True)
        results.append(row)
    return results


def route_ab(out: Path, best: Tuple[int, int, int, int], batches, dim: int, repeats: int, device, dry: bool):
    """The route's forward + backward (CLIP, symmetric) with the shipped stats tiling and with ``best``."""
    from .methods import make_inputs

    for batch in batches:
        q, k, scale = make_inputs(batch, dim, torch.bfloat16, device)
        fn = ours("clip", dry)["chunked"]
        for config in dict.fromkeys((CANDIDATES[0], best)):
            with stats_tiling(config):
                result = time_step(fwd_bwd(fn, q, k, scale), repeats, device)
            row = {"step": "route", "config": "x".join(map(str, config)), "loss": "clip", "batch": batch,
                   "note": chunk_plan(q, k), **result}  # fmt: skip
            append_row(out / "sweep.jsonl", row)
            print(row, flush=True)


def auto_table(out: Path, batches, dim: int, repeats: int, device, dry: bool) -> None:
    from .methods import make_inputs

    for loss in ("clip", "siglip"):
        for batch in batches:
            q, k, scale = make_inputs(batch, dim, torch.bfloat16, device)
            plan = chunk_plan(q, k)
            for name, fn in ours(loss, dry).items():
                row = {"step": "auto", "method": name, "loss": loss, "batch": batch,
                       "note": plan if name == "chunked" else ""}  # fmt: skip
                try:
                    row.update(status="ok", **time_step(fwd_bwd(fn, q, k, scale), repeats, device))
                except Exception as err:
                    row.update(status="error", note=f"{type(err).__name__}: {str(err)[:160]}")
                append_row(out / "sweep.jsonl", row)
                print(row, flush=True)


MATRYOSHKA_DIMS = (768, 512, 256, 128, 64)


def _per_prefix_triton():
    """The Triton backend without its fused Matryoshka block operations: the loss runs its plain ones per prefix
    (:class:`infcl.losses.matryoshka.MatryoshkaSteps` looks them up by name)."""
    from infcl.backends.triton.backend import TritonBackend

    def hidden(self):
        raise AttributeError("per prefix")

    fused = ("matryoshka_forward_block", "matryoshka_backward_block")
    return type("PerPrefixTriton", (TritonBackend,), {name: property(hidden) for name in fused})()


def matryoshka_ab(out: Path, batch: int, dim: int, dims, repeats: int, device, dry: bool) -> None:
    from infcl import cal_inf_loss

    from .methods import make_inputs

    q, k, scale = make_inputs(batch, dim, torch.float32 if dry else torch.bfloat16, device)
    fused = "torch" if dry else "triton"
    methods = {
        "one loss": lambda q_, k_, s_: cal_inf_loss(q_, k_, scale=s_, symmetric=True, backend=fused),
        "matryoshka fused": lambda q_, k_, s_: cal_inf_loss(
            q_, k_, scale=s_, symmetric=True, matryoshka=dims, backend=fused
        ),
        "matryoshka per prefix": lambda q_, k_, s_: cal_inf_loss(
            q_, k_, scale=s_, symmetric=True, matryoshka=dims, backend="cpu" if dry else _per_prefix_triton()
        ),
    }
    for name, fn in methods.items():
        row = {"step": "matryoshka", "method": name, "batch": batch, "dim": dim, "dims": list(dims)}
        try:
            row.update(status="ok", **time_step(fwd_bwd(fn, q, k, scale), repeats, device))
        except Exception as err:
            row.update(status="error", note=f"{type(err).__name__}: {str(err)[:160]}")
        append_row(out / "sweep.jsonl", row)
        print(row, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chunked_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/chunked-sweep"))
    p.add_argument(
        "--steps",
        default="stats,auto,matryoshka",
        help="stats (the stats pass's tilings + the route's A/B), auto, matryoshka",
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dry-run", action="store_true", help="CPU tensors at toy sizes (TRITON_INTERPRET=1)")
    p.add_argument("--candidates", type=int, default=len(CANDIDATES), help="only the first N stats tilings")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = device_for(args.dry_run)
    dim = 32 if args.dry_run else 512
    steps = set(args.steps.split(","))
    if "stats" in steps:
        rows, cols = (64, 256) if args.dry_run else (2048, 65536)
        swept = sweep_stats(args.out, rows, cols, args.repeats, device, CANDIDATES[: args.candidates])
        results = [r for r in swept if r.get("status") == "ok"]
        close = [r for r in results if r["row_r_rel"] < 1e-5 and r["col_r_rel"] < 1e-5]
        best = min(close, key=lambda r: r["ms"])["config"] if close else "x".join(map(str, CANDIDATES[0]))
        route_ab(args.out, tuple(map(int, best.split("x"))), (64,) if args.dry_run else (32768, 65536), dim,
                 args.repeats, device, args.dry_run)  # fmt: skip
    if "auto" in steps:
        auto_table(args.out, (64,) if args.dry_run else (2048, 4096, 8192), dim, args.repeats, device, args.dry_run)
    if "matryoshka" in steps:
        dims = (32, 16, 8) if args.dry_run else MATRYOSHKA_DIMS
        matryoshka_ab(args.out, 64 if args.dry_run else 16384, dims[0], dims, args.repeats, device, args.dry_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
