"""What issue 56's cheap options cost: label smoothing and the SigLIP loss with ids, each against the same loss
without it, in one run (target: <= 1.05x).

    python -m bench.options [--batch 4096] [--dim 512] [--backend cpu] [--repeats 5] [--csv out.csv]

Pairs (forward + backward from fp32 unit-norm features to their gradients; the softmax loss symmetric):

- ``smoothing``: ``cal_inf_loss`` plain against ``label_smoothing=0.1``;
- ``smoothing, ids``: with ``q_ids``/``k_ids`` from B/4 classes (false negatives under multi_positive None), without
  and with ``label_smoothing=0.1``;
- ``smoothing, ids "sum"``: the same ids, ``multi_positive="sum"``, without and with it;
- ``siglip ids``: ``cal_siglip_loss`` plain against ``q_ids``/``k_ids`` (the same B/4 classes: every same-id column
  a positive).

The methods run alternately, ``--repeats`` rounds after one warm-up; each keeps its best time and the ratio is
with / without. ``--clock cpu`` (the default) times the process's CPU time, which a loaded machine's other
processes do not inflate (with ``--threads 1`` it is the one thread's); ``--clock wall`` the wall-clock time.
Read the ratios with the load average printed beside them.
"""

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

from bench.machine import cpu_name
from bench.report import write_rows

SCALE = 20.0
EPS = 0.1


def pairs(batch: int, dim: int, backend: str) -> Dict[str, Tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (without the option, with it): callables that run forward + backward once on fresh leaves."""
    from infcl import cal_inf_loss, cal_siglip_loss

    gen = torch.Generator().manual_seed(0)
    base = [torch.nn.functional.normalize(torch.randn(batch, dim, generator=gen), dim=-1) for _ in range(2)]
    ids = torch.randint(0, max(1, batch // 4), (batch,), generator=gen)
    ids_kw = dict(q_ids=ids, k_ids=ids)

    def softmax(**kw):
        def run():
            q, k = (e.clone().requires_grad_() for e in base)
            cal_inf_loss(q, k, scale=SCALE, symmetric=True, backend=backend, **kw).backward()

        return run

    def siglip(**kw):
        def run():
            q, k = (e.clone().requires_grad_() for e in base)
            cal_siglip_loss(q, k, torch.tensor(10.0), torch.tensor(-10.0), backend=backend, **kw).backward()

        return run

    return {
        "smoothing": (softmax(), softmax(label_smoothing=EPS)),
        "smoothing, ids": (softmax(**ids_kw), softmax(label_smoothing=EPS, **ids_kw)),
        'smoothing, ids "sum"': (
            softmax(multi_positive="sum", **ids_kw),
            softmax(multi_positive="sum", label_smoothing=EPS, **ids_kw),
        ),
        "siglip ids": (siglip(), siglip(**ids_kw)),
    }


def run(batch: int, dim: int, backend: str, repeats: int, clock: str = "cpu") -> List[dict]:
    table = pairs(batch, dim, backend)
    now = time.process_time if clock == "cpu" else time.perf_counter
    best = {(name, i): float("inf") for name in table for i in (0, 1)}
    for round_ in range(repeats + 1):  # round 0: warm-up (builds, caches)
        for name, steps in table.items():
            for i in (round_ % 2, 1 - round_ % 2):  # without / with first in turn
                start = now()
                steps[i]()
                seconds = now() - start
                if round_:
                    best[name, i] = min(best[name, i], seconds)
    return [
        {
            "option": name,
            "backend": backend,
            "batch": batch,
            "dim": dim,
            "without_s": round(best[name, 0], 6),
            "with_s": round(best[name, 1], 6),
            "ratio": round(best[name, 1] / best[name, 0], 3),
            "clock": clock,
        }
        for name in table
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.options", description=__doc__)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--csv", help="also write the rows here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.batch, args.dim, args.backend, args.repeats, args.clock)
    load = os.getloadavg()[0]
    print(f"option cost, fp32 fwd+bwd, {cpu_name()}, {args.threads} thread(s), load {load:.1f}")
    cols = list(rows[0])
    print(" | ".join(cols))
    for row in rows:
        print(" | ".join(str(row[c]) for c in cols))
    if args.csv:
        write_rows(args.csv, rows, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
