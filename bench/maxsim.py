"""The late-interaction (MaxSim) loss stage: sentence-transformers' against infcl's, time and peak memory.

    python -m bench --preset late-interaction [--batch 1024 4096] [--lq 32] [--ld 180] [--dim 128] [--repeats 2]
        [--backend cpu torch]
    python -m bench.maxsim ...   (the same)

From a batch of token embeddings (B queries [B, Lq, D], one document each [B, Ld, D], random fp32, unit-norm
tokens, random lengths: each query and document has a real-token count drawn in [L/2, L], the rest masked) to the
loss and its gradients to the embeddings: theirs is what ``MultiVectorMultipleNegativesRankingLoss.forward`` does
after embedding (``colbert_scores`` with the masks over the stacked documents, ``cross_entropy`` of the scaled
scores, ``backward``), ours ``infcl.cal_maxsim_loss`` on each ``--backend``. They run alternately, ``--repeats``
times, in one process; each keeps its best time and largest peak. Memory: the peak resident set above the one held
when the call started (the inputs exist before; their gradients, B * (Lq + Ld) * D * 4 bytes, are allocated in
the call and counted), and the same less those gradients ("beyond grads"). Times on a shared machine are noisy:
read the ratios. Prints one table row per (batch, backend); ``--csv PATH`` also writes them.

The GEMM bound, measured in the same run as ``bench.gemm`` does for the dense loss (``torch.mm`` of [B, D] x [D, B]
into a preallocated output): each backend's forward alone (no grad) on the first ``RATE_QUERIES`` queries against
every document, and a run of those products with as many flops, in turn, ``RATE_ROUNDS`` times, best of each (runs of
about the same length, so that a shared machine's load weighs on both alike). The token-product rate is the real
tokens' products, 2 * D * (sum of those queries' real lengths) * (sum of the documents'), over the forward's time
(everything else the forward does counts against it).
"""

import argparse
import ctypes
import ctypes.util
import math
import os
import sys
from typing import List, Sequence

import torch
import torch.nn.functional as F

from bench.gemm import gemm_flops
from bench.machine import cpu_name
from bench.report import write_rows
from bench.st_loss import MIB, measure

SCALE = 1.0  # MultiVectorMultipleNegativesRankingLoss's default
# glibc's mallopt parameter and the value main() sets: buffers from 64 KiB up are mapped and unmapped on their own.
M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES = -3, 64 * 1024
# The rate measurement: the forward's queries (the first ones, against every document) and its rounds.
RATE_QUERIES = 128
RATE_ROUNDS = 3


def token_batch(batch: int, lq: int, ld: int, dim: int, seed: int = 0):
    """(q, docs, q_mask, docs_mask): unit-norm fp32 tokens and masks of random real lengths in [L/2, L]."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, lq, dim, generator=gen), dim=-1)
    docs = F.normalize(torch.randn(batch, ld, dim, generator=gen), dim=-1)
    masks = []
    for length in (lq, ld):
        real = torch.randint(length // 2, length + 1, (batch, 1), generator=gen)
        masks.append(torch.arange(length)[None] < real)
    return q, docs, *masks


def fixed_mmap_threshold() -> None:
    """Pin glibc's mmap threshold (as MALLOC_MMAP_THRESHOLD_ would): glibc otherwise raises it after the first large
    free, and a later call then reuses the heap a previous one left, so its peak resident set misses its own buffers
    (sentence-transformers' 2 GiB run first made infcl's gradients look free)."""
    libc = ctypes.util.find_library("c")
    if libc is not None:
        ctypes.CDLL(libc).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def steps(batch: int, lq: int, ld: int, dim: int, backends: Sequence[str], theirs_too: bool = True):
    """({name: callable} running each loss stage once on leaves made before the call (their grads reset),
    {backend: callable} running its forward alone without grad, the real tokens' product flops)."""
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores

    from infcl import cal_maxsim_loss

    q, docs, q_mask, docs_mask = token_batch(batch, lq, ld, dim)
    q.requires_grad_()
    docs.requires_grad_()
    labels = torch.arange(batch)

    def theirs():
        q.grad = docs.grad = None
        scores = colbert_scores(q, docs[:, None], queries_mask=q_mask, documents_mask=docs_mask[:, None])
        F.cross_entropy(scores * SCALE, labels).backward()

    def ours(backend):
        def run():
            q.grad = docs.grad = None
            cal_maxsim_loss(q, docs, scale=SCALE, q_mask=q_mask, docs_mask=docs_mask, backend=backend).backward()

        return run

    n = min(RATE_QUERIES, batch)

    def forward(backend):
        def run():
            with torch.no_grad():
                cal_maxsim_loss(
                    q[:n], docs, torch.arange(n), SCALE, q_mask=q_mask[:n], docs_mask=docs_mask, backend=backend
                )

        return run

    flops = 2.0 * dim * float(q_mask[:n].sum()) * float(docs_mask.sum())
    named = {**({"theirs": theirs} if theirs_too else {}), **{backend: ours(backend) for backend in backends}}
    return named, {backend: forward(backend) for backend in backends}, flops


def gemm_run(batch: int, dim: int, flops: float):
    """(callable, its flops): ``torch.mm`` [B, D] x [D, B] into a preallocated output, as ``bench.gemm`` times the
    dense loss's bound, repeated for at least ``flops``."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(batch, dim, generator=gen), torch.randn(batch, dim, generator=gen)
    out = torch.empty(batch, batch)
    reps = max(1, math.ceil(flops / gemm_flops(batch, dim)))

    def run():
        for _ in range(reps):
            torch.mm(a, b.T, out=out)

    return run, reps * gemm_flops(batch, dim)


def run_batch(
    batch: int, lq: int, ld: int, dim: int, repeats: int, backends: Sequence[str], theirs_too: bool = True
) -> List[dict]:
    named, forwards, flops = steps(batch, lq, ld, dim, backends, theirs_too)
    best = {name: (float("inf"), 0) for name in named}
    best.setdefault("theirs", (math.nan, math.nan))  # not run (--no-theirs)
    for _ in range(repeats):
        for name, step in named.items():
            seconds, peak = measure(step)
            best[name] = (min(best[name][0], seconds), max(best[name][1], peak))
    gemm, gemm_total = gemm_run(batch, dim, flops)
    forward_s = {name: float("inf") for name in forwards}
    gemm_s = float("inf")
    for _ in range(RATE_ROUNDS):
        for name, step in forwards.items():
            forward_s[name] = min(forward_s[name], measure(step)[0])
        gemm_s = min(gemm_s, measure(gemm)[0])
    gemm_gflops = gemm_total / gemm_s / 1e9
    grads = batch * (lq + ld) * dim * 4 / MIB
    rows = []
    for backend in backends:
        product_gflops = flops / forward_s[backend] / 1e9
        rows.append(
            {
                "batch": batch,
                "backend": backend,
                "theirs_s": best["theirs"][0],
                "ours_s": best[backend][0],
                "ratio": best[backend][0] / best["theirs"][0],
                "theirs_mib": best["theirs"][1] / MIB,
                "ours_mib": best[backend][1] / MIB,
                "theirs_beyond_grads_mib": best["theirs"][1] / MIB - grads,
                "ours_beyond_grads_mib": best[backend][1] / MIB - grads,
                "ours_forward_s": forward_s[backend],
                "product_gflops": product_gflops,
                "gemm_gflops": gemm_gflops,
                "of_gemm": product_gflops / gemm_gflops,
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench --preset late-interaction", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", default="late-interaction", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--lq", type=int, default=32)
    parser.add_argument("--ld", type=int, default=180)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--backend", nargs="+", default=["cpu", "torch"], help="infcl's backends (cal_maxsim_loss's: cpu, torch)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--theirs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run sentence-transformers' loss too (--no-theirs: infcl's rows alone, e.g. where theirs takes an hour)",
    )
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    fixed_mmap_threshold()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# late-interaction loss stage, Lq={args.lq}, Ld={args.ld}, D={args.dim}, fp32, one document per query, "
        f"random real lengths in [L/2, L]; best of {args.repeats} alternating; {cpu_name()}, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f} at the start"
    )
    print(
        "| B | backend | theirs s | ours s | ours / theirs | theirs MiB (beyond grads) | ours MiB (beyond grads) "
        f"| fwd s ({RATE_QUERIES} queries) | token products GFLOP/s | GEMM GFLOP/s | of GEMM |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for batch in args.batch:
        for row in run_batch(batch, args.lq, args.ld, args.dim, args.repeats, args.backend, args.theirs):
            rows.append(row)
            print(
                f"| {batch} | {row['backend']} | {row['theirs_s']:.2f} | {row['ours_s']:.2f} | {row['ratio']:.2f} | "
                f"{row['theirs_mib']:.0f} ({row['theirs_beyond_grads_mib']:.0f}) | "
                f"{row['ours_mib']:.0f} ({row['ours_beyond_grads_mib']:.0f}) | {row['ours_forward_s']:.2f} | "
                f"{row['product_gflops']:.0f} | {row['gemm_gflops']:.0f} | {row['of_gemm']:.2f} |",
                flush=True,
            )
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    if args.csv:
        write_rows(args.csv, rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
