"""One rank of the property suite's ring part, started by tests/test_properties_ring.py through helpers/distributed.py.

``python -m workers.properties_ring_worker N`` (``world`` processes) draws N seeded cases (:func:`draw_case`:
the same global batch on every rank), runs each on every CPU backend over the whole group with this rank's
shard, as a user would hold it, and writes (loss, dq, dk, dscale) per case and backend, or the error.

A case: uneven shards (1..5 rows per rank, Bk > Bq per rank when one-directional), global labels (a
permutation, random columns with repeats, or the diagonal), exact duplicate columns and rows (ties in S),
ids with duplicates across ranks as views (a metadata column, every other entry) in int64 / int32, a guide
with small-integer entries (every score exact in float32, so a duplicate ties its threshold in any
summation order) at margin 0 or 1, features as transposed or strided views, every reduction and an
upstream gradient.
"""

import sys
import zlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from helpers.distributed import finish, init_worker
from helpers.layouts import ids_as, view_as
from helpers.support import tiled_backends
from infcl import cal_inf_loss
from infcl.backends.torch_tiles import TorchTilesBackend

# "torch-tiny": the torch tiles shrunk so that every shard spans several tiles.
BACKENDS = ("reference", "torch-tiny") + tuple(tiled_backends())
TINY_TILES = (2, 3)
LAYOUTS = ("contiguous", "transposed", "strided")


@dataclass
class Case:
    """A global batch and how it is split: rank r holds q rows q_offsets[r]:+q_sizes[r] (k likewise)."""

    q: torch.Tensor  # [Bq, D] float32
    k: torch.Tensor  # [Bk, D] float32
    labels: Optional[torch.Tensor]  # [Bq] global columns, or None (the diagonal: needs equal shards)
    q_sizes: Tuple[int, ...]
    k_sizes: Tuple[int, ...]
    symmetric: bool
    reduction: str
    scale: float
    upstream: torch.Tensor  # [Bq] float64 (per row under "none"; its per-rank sums are the scalars otherwise)
    options: dict  # q_ids, k_ids, multi_positive, guide, guide_margin, guide_margin_strategy (global tensors)
    layouts: Tuple[str, str, str]  # q's and k's views, the ids' view

    @property
    def q_offsets(self):
        return [sum(self.q_sizes[:r]) for r in range(len(self.q_sizes))]

    @property
    def k_offsets(self):
        return [sum(self.k_sizes[:r]) for r in range(len(self.k_sizes))]


def draw_case(world: int, index: int) -> Case:
    """Case ``index`` of a ring of ``world`` ranks, the same in every process (a seeded generator)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"properties-ring/{world}/{index}".encode()))

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    symmetric = bool(pick((False, True)))
    q_sizes = tuple(int(n) for n in torch.randint(1, 6, (world,), generator=gen))
    k_sizes = (
        q_sizes
        if symmetric or pick((False, True))
        else tuple(n + int(torch.randint(0, 4, (1,), generator=gen)) for n in q_sizes)
    )
    bq, bk, d = sum(q_sizes), sum(k_sizes), int(torch.randint(1, 7, (1,), generator=gen))
    q = F.normalize(torch.randn(bq, d, generator=gen), dim=1)
    k = F.normalize(torch.randn(bk, d, generator=gen), dim=1)
    if symmetric:
        labels = torch.randperm(bq, generator=gen)
    else:
        labels = pick(("diagonal", "random", "random")) if k_sizes == q_sizes else "random"
        labels = None if labels == "diagonal" else torch.randint(0, bk, (bq,), generator=gen)
    lab = torch.arange(bq) if labels is None else labels
    # Exact duplicates, across ranks too: columns copying a row's labelled column, rows copying rows.
    dups = [
        (int(torch.randint(0, bk, (1,), generator=gen)), int(lab[int(torch.randint(0, bq, (1,), generator=gen))]))
        for _ in range(int(torch.randint(0, 3, (1,), generator=gen)))
    ]
    for dst, src in dups:
        k[dst] = k[src]
        if dst < bq and src < bq:
            q[dst] = q[src]
    multi_positive = pick((None, None, "mean", "sum"))
    options = {"multi_positive": multi_positive, "q_ids": None, "k_ids": None, "guide": None}
    if multi_positive is not None or pick((False, True)):
        classes = int(torch.randint(1, 4, (1,), generator=gen))
        k_ids = torch.randint(0, classes, (bk,), generator=gen)
        q_ids = k_ids[lab].clone() if pick((False, True)) else torch.randint(0, classes, (bq,), generator=gen)
        for dst, src in dups:
            k_ids[dst] = k_ids[src]
        options.update(q_ids=q_ids, k_ids=k_ids)
    if pick((False, True)):
        dg = int(torch.randint(1, 9, (1,), generator=gen))
        gq = torch.randint(-3, 4, (bq, dg), generator=gen).float()
        gk = torch.randint(-3, 4, (bk, dg), generator=gen).float()
        for dst, src in dups:
            gk[dst] = gk[src]
        strategy = pick(("absolute", "relative"))
        margin = pick((0.0, 0.0, 1.0)) if strategy == "absolute" else pick((0.0, 0.5))
        options.update(guide=(gq, gk), guide_margin=margin, guide_margin_strategy=strategy)
    return Case(
        q=q,
        k=k,
        labels=labels,
        q_sizes=q_sizes,
        k_sizes=k_sizes,
        symmetric=symmetric,
        reduction=pick(("mean", "sum", "none")),
        scale=float(pick((1.0, 7.0, 20.0))),
        upstream=torch.rand(bq, generator=gen, dtype=torch.float64) + 0.5,
        options=options,
        layouts=(pick(LAYOUTS), pick(LAYOUTS), pick(("contiguous", "meta", "strided"))),
    )


def local_options(case: Case, rank: int) -> dict:
    """This rank's slice of the mask options, ids held as ``case.layouts[2]`` (int64 or int32)."""
    qs = slice(case.q_offsets[rank], case.q_offsets[rank] + case.q_sizes[rank])
    ks = slice(case.k_offsets[rank], case.k_offsets[rank] + case.k_sizes[rank])
    opts = dict(case.options)
    if opts["q_ids"] is not None:
        dtype = torch.int32 if (rank + len(case.q)) % 2 else torch.int64
        opts["q_ids"] = ids_as(opts["q_ids"][qs], case.layouts[2], dtype)
        opts["k_ids"] = ids_as(opts["k_ids"][ks], case.layouts[2], dtype)
    if opts["guide"] is not None:
        opts["guide"] = (view_as(opts["guide"][0][qs], case.layouts[0]), opts["guide"][1][ks])
    return opts


def _run(case: Case, rank: int, backend: str) -> dict:
    qs = slice(case.q_offsets[rank], case.q_offsets[rank] + case.q_sizes[rank])
    ks = slice(case.k_offsets[rank], case.k_offsets[rank] + case.k_sizes[rank])
    q = view_as(case.q[qs], case.layouts[0]).requires_grad_(True)
    k = view_as(case.k[ks], case.layouts[1]).requires_grad_(True)
    scale = torch.tensor(case.scale, requires_grad=True)
    labels = None if case.labels is None else case.labels[qs]
    route = TorchTilesBackend(*TINY_TILES) if backend == "torch-tiny" else backend  # options from the call
    loss = cal_inf_loss(
        q,
        k,
        labels,
        scale,
        symmetric=case.symmetric,
        reduction=case.reduction,
        backend=route,
        group=None,
        **local_options(case, rank),
    )
    upstream = case.upstream[qs] if case.reduction == "none" else case.upstream[qs].sum()
    loss.backward(upstream.to(loss.dtype))
    return {"loss": loss.detach(), "dq": q.grad, "dk": k.grad, "dscale": scale.grad}


def main(count: int) -> None:
    rank, world = init_worker()
    results = {}
    for index in range(count):
        case = draw_case(world, index)
        for backend in BACKENDS:
            try:
                results[index, backend] = _run(case, rank, backend)
            except Exception as err:  # reported by the test with the case; the other ranks raise alike
                results[index, backend] = {"error": f"{type(err).__name__}: {err}"}
    finish(results)


if __name__ == "__main__":
    main(int(sys.argv[1]))
