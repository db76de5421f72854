"""sentence-transformers' loss stage, theirs against infcl's, per option: time and peak memory.

    python -m bench.st_loss [--batch 1024 4096] [--dim 384] [--repeats 3] [--backend cpu torch] [--options ...]

The loss stage is what the two implementations do differently: from a batch of embeddings (anchors, positives,
one hard-negative column: triplets; random fp32, unit norm) to the loss and its gradients to the embeddings,
``compute_loss_from_embeddings`` + ``backward`` of sentence-transformers' ``MultipleNegativesRankingLoss`` and of
``infcl.sentence_transformers``' on each ``--backend`` (GIST: infcl's loss from embeddings and guide embeddings,
alone: theirs broadcasts a B x B x D cosine, several GiB at these sizes). Each option runs theirs and ours on
every backend alternately, ``--repeats`` times, in one process, and keeps each one's best time; memory is the peak
resident set above the one held when the call started (/proc/self/clear_refs resets the high-water mark; freed
memory is trimmed back to the system before each call). Times on a shared machine are noisy: read the ratios.
Prints one table row per (option, batch, backend); ``--csv PATH`` also writes them.
"""

import argparse
import ctypes
import ctypes.util
import gc
import os
import resource
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from bench.machine import cpu_name
from bench.report import write_rows

MIB = 2**20
HARDNESS = 5.0  # hardness_strength for the hardness options
# option -> MultipleNegativesRankingLoss keyword arguments (None: GIST)
OPTIONS: Dict[str, Optional[dict]] = {
    "default": {},
    "symmetric per_direction": {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
    "all four directions": {"directions": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")},
    "in_batch_negatives": {"hardness_mode": "in_batch_negatives", "hardness_strength": HARDNESS},
    "hard_negatives": {"hardness_mode": "hard_negatives", "hardness_strength": HARDNESS},
    "all_negatives": {"hardness_mode": "all_negatives", "hardness_strength": HARDNESS},
    "GIST (margin 0.1)": None,
}


class _Model(torch.nn.Module):
    """What the loss constructors keep as ``model``: the loss stage never calls it."""

    similarity_fn_name = "cosine"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(step: Callable[[], None]):
    """(seconds, peak bytes above the start) of one call of ``step``."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None:
        ctypes.CDLL(libc).malloc_trim(0)
    base = _rss_bytes()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return seconds, max(0, _peak_bytes() - base)


def embeddings(batch: int, dim: int, columns: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.functional.normalize(torch.randn(batch, dim, generator=gen), dim=-1) for _ in range(columns)]


def loss_steps(option: str, batch: int, dim: int, backend: str):
    """(theirs or None, ours on ``backend``): callables that run the loss stage once on fresh leaves."""
    from sentence_transformers.sentence_transformer import losses as st_losses

    import infcl.sentence_transformers as inf_losses

    base = embeddings(batch, dim)
    model = _Model()
    kwargs = OPTIONS[option]
    if kwargs is None:
        return None, _gist_step(base, embeddings(batch, dim // 2, seed=1), backend)
    losses = (
        st_losses.MultipleNegativesRankingLoss(model, **kwargs),
        inf_losses.MultipleNegativesRankingLoss(model, **kwargs, backend=backend),
    )

    def step(loss):
        def run():
            leaves = [e.clone().requires_grad_() for e in base]
            loss.compute_loss_from_embeddings(leaves, None).backward()

        return run

    return step(losses[0]), step(losses[1])


def _gist_step(base, guide, backend: str):
    from infcl.sentence_transformers.objective import gist_loss

    def ours():
        leaves = [e.clone().requires_grad_() for e in base]
        gist_loss(
            leaves[0],
            leaves[1:],
            guide[0],
            guide[1:],
            temperature=0.01,
            margin_strategy="absolute",
            margin=0.1,
            contrast_anchors=True,
            contrast_positives=True,
            backend=backend,
        ).backward()

    return ours


def run_option(option: str, batch: int, dim: int, repeats: int, backends: Sequence[str]) -> List[dict]:
    """One row per backend: theirs and ours on every backend run alternately, best time and largest peak each."""
    steps = {"theirs": loss_steps(option, batch, dim, backends[0])[0]}
    steps.update({backend: loss_steps(option, batch, dim, backend)[1] for backend in backends})
    best = {name: (float("inf"), 0) for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            if step is None:
                continue
            seconds, peak = measure(step)
            best[name] = (min(best[name][0], seconds), max(best[name][1], peak))
    rows = []
    for backend in backends:
        row = {
            "option": option,
            "batch": batch,
            "backend": backend,
            "ours_s": best[backend][0],
            "ours_mib": best[backend][1] / MIB,
        }
        if steps["theirs"] is not None:
            row.update(
                theirs_s=best["theirs"][0],
                theirs_mib=best["theirs"][1] / MIB,
                ratio=best[backend][0] / best["theirs"][0],
            )
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", nargs="+", default=["cpu", "torch"], help="infcl's backends (cal_inf_loss's)")
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS), metavar="OPTION")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# sentence-transformers loss stage, D={args.dim}, triplets, fp32, infcl backends {args.backend}, "
        f"best of {args.repeats} alternating; {cpu_name()}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f} at the start"
    )
    print("| option | B | backend | theirs s | ours s | ours / theirs | theirs MiB | ours MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for batch in args.batch:
        for option in args.options:
            for row in run_option(option, batch, args.dim, args.repeats, args.backend):
                rows.append(row)
                theirs = (
                    ("—", "—", "—")
                    if "theirs_s" not in row
                    else (f"{row['theirs_s']:.3f}", f"{row['ratio']:.2f}", f"{row['theirs_mib']:.0f}")
                )
                print(
                    f"| {option} | {batch} | {row['backend']} | {theirs[0]} | {row['ours_s']:.3f} | {theirs[1]} | "
                    f"{theirs[2]} | {row['ours_mib']:.0f} |",
                    flush=True,
                )
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")
    if args.csv:
        columns = ["option", "batch", "backend", "theirs_s", "ours_s", "ratio", "theirs_mib", "ours_mib"]
        write_rows(args.csv, rows, columns)


if __name__ == "__main__":
    sys.exit(main())
