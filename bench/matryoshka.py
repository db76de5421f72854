"""Fused Matryoshka (``cal_inf_loss(matryoshka=...)``) against one full-dimension infcl loss and sentence-transformers'
``MatryoshkaLoss(MultipleNegativesRankingLoss)`` loss stage: time and peak memory (issue 56's table).

    python -m bench --preset matryoshka [--batch 4096] [--dim 768] [--dims 768 512 256 128 64] [--repeats 3]
    python -m bench.matryoshka ...                                    (the same)

Every method runs the symmetric loss, forward + backward, from fp32 unit-norm embeddings (two columns: anchors,
positives) to the gradients of the embeddings, in one process, alternately, ``--repeats`` times; each keeps its
best time and its largest peak resident set above the one held when the call started (bench.st_loss.measure):

- ``infcl one loss (cpu|torch)``: ``cal_inf_loss(q, k, symmetric=True)`` at the full dimension D, on the native
  kernel and on the torch tiles;
- ``infcl matryoshka (cpu|torch)``: ``cal_inf_loss(..., matryoshka=dims)``: every prefix out of one tiled pass
  forward and one backward (fused), on the native kernel (csrc/matryoshka_*.cpp) and on the torch tiles;
- ``theirs MatryoshkaLoss(MNRL)``: what sentence-transformers' MatryoshkaLoss runs per step for these embeddings:
  its ``shrink`` per dimension and ``MultipleNegativesRankingLoss(directions=(query_to_doc, doc_to_query),
  partition_mode="per_direction").compute_loss_from_embeddings``, summed, then backward.

Ratios: ``vs one loss`` against ``infcl one loss (cpu)`` (the first of ``--backends``), ``vs theirs`` against
theirs; the last line states issue 56's targets for the fused route (time <= 1.3x one loss, <= 0.5x theirs, peak
<= 1.2x one loss). Times on a shared machine are
noisy: read the ratios, and the load average printed with them.
"""

import argparse
import os
import sys
from typing import Callable, Dict, List

import torch

from bench.machine import cpu_name
from bench.report import write_rows
from bench.st_loss import measure

MIB = 2**20
SCALE = 20.0  # MultipleNegativesRankingLoss's default scale: cos_sim * 20
BACKENDS = ("cpu", "torch")  # the native kernel first: the ratios are against its one loss
THEIRS = "theirs MatryoshkaLoss(MNRL)"
# Issue 56's targets for the fused route against one full-dimension loss and theirs, in one run.
TARGETS = {"time_vs_one_loss": 1.3, "time_vs_theirs": 0.5, "memory_vs_one_loss": 1.2}


def _embeddings(batch: int, dim: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.functional.normalize(torch.randn(batch, dim, generator=gen), dim=-1) for _ in range(2)]


def steps(batch: int, dim: int, dims, backends=BACKENDS) -> Dict[str, Callable[[], None]]:
    from sentence_transformers.sentence_transformer import losses as st_losses
    from sentence_transformers.sentence_transformer.losses.matryoshka import shrink

    from infcl import cal_inf_loss

    base = _embeddings(batch, dim)

    def leaves():
        return [e.clone().requires_grad_() for e in base]

    def one(backend):
        def run():
            q, k = leaves()
            cal_inf_loss(q, k, scale=SCALE, symmetric=True, backend=backend).backward()

        return run

    def prefixes(backend):
        def run():
            q, k = leaves()
            cal_inf_loss(q, k, scale=SCALE, symmetric=True, matryoshka=tuple(dims), backend=backend).backward()

        return run

    class _Model(torch.nn.Module):
        similarity_fn_name = "cosine"

    mnrl = st_losses.MultipleNegativesRankingLoss(
        _Model(), directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    )

    def theirs():
        embs = leaves()
        loss = sum(mnrl.compute_loss_from_embeddings([shrink(e, m) for e in embs], None) for m in dims)
        loss.backward()

    table = {f"infcl one loss ({name})": one(name) for name in backends}
    table.update({f"infcl matryoshka ({name}: fused)": prefixes(name) for name in backends})
    table[THEIRS] = theirs
    return table


def run(batch: int, dim: int, dims, repeats: int, backends=BACKENDS) -> List[dict]:
    table = steps(batch, dim, dims, backends)
    best = {name: (float("inf"), 0) for name in table}
    for _ in range(repeats):
        for name, step in table.items():
            seconds, peak = measure(step)
            best[name] = (min(best[name][0], seconds), max(best[name][1], peak))
    one, theirs = best[f"infcl one loss ({backends[0]})"], best[THEIRS]
    return [
        {
            "method": name,
            "batch": batch,
            "dim": dim,
            "dims": " ".join(map(str, dims)),
            "seconds": round(seconds, 3),
            "peak_mib": round(peak / MIB, 1),
            "time_vs_one_loss": round(seconds / one[0], 3),
            "memory_vs_one_loss": round(peak / one[1], 3) if one[1] else None,
            "time_vs_theirs": round(seconds / theirs[0], 3),
        }
        for name, (seconds, peak) in best.items()
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench --preset matryoshka",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--dims", type=int, nargs="+", default=[768, 512, 256, 128, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument(
        "--backends",
        nargs="+",
        default=list(BACKENDS),
        choices=BACKENDS,
        help="infcl's routes (the first is the ratios' one loss); the torch tiles take minutes at B = 4096",
    )
    p.add_argument("--csv", help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.batch, args.dim, args.dims, args.repeats, tuple(args.backends))
    load = os.getloadavg()[0]
    print(f"Matryoshka loss stage, symmetric fp32 fwd+bwd, {cpu_name()}, {args.threads} thread(s), load {load:.1f}")
    cols = list(rows[0])
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    fused = next(row for row in rows if row["method"] == f"infcl matryoshka ({args.backends[0]}: fused)")
    verdicts = [
        f"{key} {fused[key]} (<= {bound}: {'met' if fused[key] <= bound else 'NOT met'})"
        for key, bound in TARGETS.items()
    ]
    print(f"targets, {fused['method']}: " + "; ".join(verdicts))
    if args.csv:
        write_rows(args.csv, rows, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
