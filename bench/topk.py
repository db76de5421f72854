"""Top-k search (``infcl.topk_scores``) at scale against sentence-transformers' chunked search, and against the
GEMM it is bound by.

    python -m bench.topk scale --queries 100000 --corpus 100000 [--dim 384] [--n 50] [--backend cpu]
    python -m bench.topk scale --preset cpu-100k | cpu-16k-1m | gpu-1m
    python -m bench.topk ratio [--queries 8192] [--corpus 65536] [--dim 384] [--n 50] [--repeats 2]  # vs one GEMM

``scale``, in one process on the same unit-norm float32 embeddings: one ``topk_scores`` call, then
upstream's search as ``sentence_transformers.util.mine_hard_negatives(use_faiss=False)`` does it (6.2:
``model.similarity`` = ``util.cos_sim`` of ``--upstream-batch`` queries (its ``faiss_batch_size``, default
16384) against the whole corpus, then ``torch.topk``), each method's wall time and the growth of the resident
set's peak while it runs (VmHWM, reset first; on CUDA the allocator's peak) beside the embeddings' own size,
and how many rows' index lists agree. ``--upstream-batch 0`` leaves upstream out (its chunk of
``batch x corpus`` float32 scores must fit in memory). ``ratio``: the native kernel (or ``--backend``)
against the torch tiles' walk of S = q @ k.T doing nothing but the tile products (the ranks' reference), and
against one ``torch.mm`` of the whole S where it fits in 4 GiB. Writes a CSV with ``--csv``.
Timings on a shared machine are noisy: compare the ratios within one run.

Presets: ``cpu-100k`` (100k x 100k, D = 384, the native kernel), ``cpu-16k-1m`` (16k queries x 1M corpus;
upstream's default batch would hold 16384 x 1M floats = 61 GiB, so upstream runs with ``--upstream-batch
1024``), ``gpu-1m`` (1M x 1M on CUDA with the Triton kernel, upstream's search beside it at its default
batch: written for a GPU, never run on one yet).
"""

import argparse
import ctypes
import ctypes.util
import gc

import torch
import torch.nn.functional as F

from bench.machine import device_name
from bench.retrieval import gemm_equivalent, measured, report
from infcl import topk_scores

# ratio's second reference, one torch.mm of the whole S, runs only where S takes at most this much.
WHOLE_GEMM_BYTES = 4 * 2**30
# n = 10: upstream's search returns range_max + max_positives columns, 5 at its defaults (3 negatives, one
# positive); either method returns 12 bytes per row and column (the "returned lists" column).
PRESETS = {
    "cpu-100k": dict(queries=100_000, corpus=100_000, n=10, device="cpu", backend="cpu", upstream_batch=16384),
    "cpu-16k-1m": dict(queries=16_384, corpus=1_000_000, n=10, device="cpu", backend="cpu", upstream_batch=1024),
    "gpu-1m": dict(queries=1_000_000, corpus=1_000_000, n=10, device="cuda", backend="triton", upstream_batch=16384),
}


def embeddings(rows: int, dim: int, seed: int, device: str) -> torch.Tensor:
    """Unit-norm float32 rows, drawn in chunks (no float64 copy of a million rows)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, dim, device=device)
    for i in range(0, rows, 65536):
        chunk = torch.randn(min(65536, rows - i), dim, generator=gen)
        out[i : i + chunk.shape[0]] = F.normalize(chunk, dim=1)
    return out


def upstream_search(queries: torch.Tensor, corpus: torch.Tensor, n: int, batch: int):
    """sentence-transformers 6.2's ``mine_hard_negatives(use_faiss=False)`` search, as written there."""
    from sentence_transformers.util import cos_sim

    scores, indices = [], []
    k = min(n, corpus.shape[0])
    for i in range(0, queries.shape[0], batch):
        chunk = cos_sim(queries[i : i + batch], corpus)  # model.similarity for a cosine model
        top = torch.topk(chunk, k=k, dim=1)
        del chunk
        scores.append(top.values)
        indices.append(top.indices)
    return torch.cat(scores), torch.cat(indices)


def _release() -> None:
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is not None:
        ctypes.CDLL(name).malloc_trim(0)


def _measured(fn, device: torch.device):
    """(result, seconds, peak growth in bytes) of one call of ``fn``."""
    _release()
    return measured(fn, device)


def scale(args) -> list:
    device = torch.device(args.device)
    queries = embeddings(args.queries, args.dim, 0, args.device)
    corpus = embeddings(args.corpus, args.dim, 1, args.device)
    mib = 2**20
    features = (queries.numel() + corpus.numel()) * 4 / mib
    ours, wall, growth = _measured(lambda: topk_scores(queries, corpus, args.n, backend=args.backend), device)
    lists = ours.scores.numel() * 12 / mib  # float32 scores + int64 indices: what either method returns
    rows = [(f"infcl topk_scores {args.backend}", wall, growth / mib, features, lists, "")]
    if args.upstream_batch:
        search = lambda: upstream_search(queries, corpus, args.n, args.upstream_batch)  # noqa: E731
        (_, theirs), wall_u, growth_u = _measured(search, device)
        agree = (theirs.to(ours.indices.device) == ours.indices).all(dim=1).float().mean().item()
        rows.append((f"upstream chunked (batch {args.upstream_batch})", wall_u, growth_u / mib, features, lists, ""))
        rows.append(("  upstream / infcl", wall_u / wall, growth_u / max(growth, 1), "", "", f"{agree:.4%} rows agree"))
    return rows


def ratio(args) -> list:
    device = torch.device(args.device)
    queries = embeddings(args.queries, args.dim, 0, args.device)
    corpus = embeddings(args.corpus, args.dim, 1, args.device)
    gemm = min(_measured(lambda: gemm_equivalent(queries, corpus), device)[1] for _ in range(args.repeats))
    rows = [("gemm-equivalent (torch tiles' products)", gemm, 1.0)]
    if queries.shape[0] * corpus.shape[0] * 4 <= WHOLE_GEMM_BYTES:
        whole = min(_measured(lambda: torch.mm(queries, corpus.T), device)[1] for _ in range(args.repeats))
        rows.append(("one torch.mm of the whole S (O(Bq Bk) memory)", whole, whole / gemm))
    search = lambda: topk_scores(queries, corpus, args.n, backend=args.backend)  # noqa: E731
    ours = min(_measured(search, device)[1] for _ in range(args.repeats))
    return rows + [(f"topk_scores {args.backend}", ours, ours / gemm)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("scale", "ratio"))
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None)
    parser.add_argument("--queries", type=int, default=8192)
    parser.add_argument("--corpus", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--n", type=int, default=50, help="columns per row (upstream: range_max + max_positives)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--upstream-batch", type=int, default=16384, help="upstream's faiss_batch_size; 0: skip")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2, help="ratio: the best of this many runs of each")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)
    torch.set_num_threads(args.threads)
    if args.mode == "scale":
        header = ("what", "seconds", "peak growth MiB", "embeddings MiB", "returned lists MiB", "note")
        rows = scale(args)
    else:
        header = ("what", "seconds", "x gemm-equivalent")
        rows = ratio(args)
    where = device_name(torch.device(args.device))
    print(f"{args.queries} x {args.corpus} D={args.dim} n={args.n} fp32 threads={args.threads} on {where}")
    settings = ("queries", "corpus", "dim", "n", "threads")
    report(header, rows, args.csv, {**{name: getattr(args, name) for name in settings}, "device": where})


if __name__ == "__main__":
    main()
