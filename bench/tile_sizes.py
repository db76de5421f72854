"""Scan TorchTilesBackend's tile sizes at one problem size, as a ratio to this machine's GEMM bound.

    python -m bench.tile_sizes                      # B=4096, D=512, fp32, symmetric fwd+bwd
    python -m bench.tile_sizes --batch 2048 --tile-q 128,256 --tile-k 512,1024 --threads 1

Runs in one process (time only; a tile's memory is a few tile_q x tile_k buffers, O(1) in B), calls
the autograd Function directly with a ``TorchTilesBackend(tile_q, tile_k)`` so that no registry entry
changes, and prints one line per tile pair: median fwd+bwd seconds and time / (4-GEMM bound).
The comment on CPU_TILES in infcl/backends/torch_tiles.py cites this scan.
"""

import argparse

import torch

from infcl.backends.torch_tiles import CPU_TILES, TorchTilesBackend
from infcl.contract import accum_dtype
from infcl.function import InfLossFunction, LossPlan
from infcl.ring.layout import single_layout

from .gemm import gemm_bound_seconds, measure_gemm
from .machine import cpu_name
from .measure import Step, loss_step, median, time_step
from .methods import make_inputs
from .worker import DTYPES

MODE = "forward+backward"


def _ints(text: str):
    return tuple(int(x) for x in text.replace(",", " ").split())


def tiles_step(q, k, scale, backend: TorchTilesBackend) -> Step:
    """Symmetric fwd+bwd of the loss through the one autograd Function, with this tile backend."""
    labels = torch.arange(q.shape[0], device=q.device)
    plan = LossPlan(backend=backend, symmetric=True, layout=single_layout(q.shape[0], k.shape[0]))

    def loss_fn(q, k, scale):
        rows, cols, _, _ = InfLossFunction.apply(q, k, scale, labels, plan)  # (and the per-row infos)
        return ((rows + cols) / 2).mean()

    return loss_step(loss_fn, q, k, scale, MODE)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.tile_sizes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--tile-q", type=_ints, default=(64, 128, 256, 512))
    p.add_argument("--tile-k", type=_ints, default=(256, 512, 1024, 2048))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    q, k, scale = make_inputs(args.batch, args.dim, DTYPES[args.dtype], device)
    gemm = measure_gemm(args.batch, args.dim, DTYPES[args.dtype], device, warmup=1, repeats=args.repeats)
    bound = gemm_bound_seconds(args.batch, args.dim, MODE, gemm["gflops"] * 1e9)
    print(f"{cpu_name()}, {torch.get_num_threads()} thread(s)")
    print(
        f"B={args.batch} D={args.dim} {args.dtype} symmetric {MODE}; "
        f"GEMM {gemm['gflops']:.1f} GFLOP/s, 4-GEMM bound {bound:.3f} s; "
        f"current CPU default {CPU_TILES[0]}x{CPU_TILES[1]}"
    )
    print(f"{'tile_q':>7} {'tile_k':>7} {'tile_KiB':>9} {'time_s':>8} {'vs_bound':>9}")
    results = []
    for tq in args.tile_q:
        for tk in args.tile_k:
            step = tiles_step(q, k, scale, TorchTilesBackend(tq, tk))
            t = median(time_step(step, device, warmup=1, repeats=args.repeats))
            results.append((t, tq, tk))
            kib = tq * tk * accum_dtype(q.dtype).itemsize / 1024  # one tile buffer
            print(f"{tq:>7} {tk:>7} {kib:>9.0f} {t:>8.3f} {t / bound:>9.2f}", flush=True)
    t, tq, tk = min(results)
    print(f"best: {tq}x{tk} at {t:.3f} s = {t / bound:.2f}x the GEMM bound")


if __name__ == "__main__":
    main()
