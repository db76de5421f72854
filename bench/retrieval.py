"""Retrieval ranks and the distillation loss against the GEMM they are bound by, and the ranks at scale.

    python -m bench.retrieval ratio [--n 8192] [--dim 512] [--threads 2] [--backends torch,cpu]  # vs one GEMM
    python -m bench.retrieval scale --n 65536 [--dim 512] [--backend cpu] [--rows R]  # time, peak memory
    python -m bench.retrieval memory --n 8192 --method open_clip|infcl     # distillation fwd+bwd peak memory

``ratio``: in one process, the same sizes, min of ``--repeats``, each backend of ``--backends`` (default:
the torch tiles, the native kernel where it is built, and Triton on CUDA): the GEMM-equivalent is the
torch tiles' walk of S = q @ k.T doing nothing but the tile products, so each ratio says what the ranks
(two passes, the first only over tiles holding a positive) and the distillation loss (forward: two
products per tile, student and teacher; backward: four, S and T again plus dq and dk; the Triton kernels
recompute more, see their modules) cost against one GEMM's worth of products. ``scale``: one call of
``retrieval_metrics`` on N x N unit features, its wall time and the growth
of the resident set's peak during it (VmHWM, reset first), beside the features' own size; with ``--rows R``
only the first R images are ranked against all N texts (ids make each image's own text its positive), and
the time is also scaled by N / R to the whole N x N (every tile costs the same), for sets too large to rank
whole in the time at hand. ``memory``: the
same peak growth for one forward and backward of open_clip's ``DistillClipLoss`` or ``InfDistillClipLoss``
(one method per process, so that neither inherits the other's freed heap).
Timings on a shared machine are noisy: compare the ratios within one run. Writes a CSV with ``--csv``.
"""

import argparse
import csv
import os
import time

import torch
import torch.nn.functional as F

from infcl.backends.torch_tiles import TORCH_TILES
from infcl.metrics import retrieval_metrics


def _features(n: int, dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, dim, generator=gen), dim=1)
    text = F.normalize(image + torch.randn(n, dim, generator=gen) / dim**0.5, dim=1)  # noise as long as the signal
    return image, text


def gemm_equivalent(q: torch.Tensor, k: torch.Tensor) -> None:
    """One pass of the torch tiles' products over S = q @ k.T, nothing else."""
    tq, tk = TORCH_TILES.tiles(q.device)
    buf = torch.empty(min(tq, q.shape[0]) * min(tk, k.shape[0]), dtype=q.dtype, device=q.device)
    for i0 in range(0, q.shape[0], tq):
        qi = q[i0 : i0 + tq]
        for j0 in range(0, k.shape[0], tk):
            kj = k[j0 : j0 + tk]
            torch.mm(qi, kj.T, out=buf[: qi.shape[0] * kj.shape[0]].view(qi.shape[0], kj.shape[0]))
    if q.device.type == "cuda":
        torch.cuda.synchronize()


def _best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _distill_step(image, text, t_image, t_text, backend):
    from infcl.distill import cal_distill_loss

    s_image, s_text = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale = torch.tensor(20.0, requires_grad=True, device=image.device)
    loss = cal_distill_loss(s_image, s_text, t_image, t_text, scale, 30.0, backend=backend)
    loss.backward()
    if image.device.type == "cuda":
        torch.cuda.synchronize()


def _backends(args) -> list:
    from infcl.backends import unavailable_reason

    if args.backends:
        return args.backends.split(",")
    device = torch.device(args.device)
    return ["torch"] + [name for name in ("cpu", "triton") if unavailable_reason(name, device) is None]


def ratio(args) -> list:
    image, text, t_image, t_text = (
        t.to(args.device) for t in (*_features(args.n, args.dim), *_features(args.n, args.dim, seed=1))
    )
    gemm = _best_of(lambda: gemm_equivalent(image, text), args.repeats)
    rows = [("gemm-equivalent (torch tiles' products)", gemm, 1.0, 1.0)]
    for backend in _backends(args):
        ranks = _best_of(lambda b=backend: retrieval_metrics(image, text, backend=b), args.repeats)
        rows.append((f"retrieval_metrics {backend}", ranks, ranks / gemm, 1.0))  # + the tiles holding a positive
        distill = _best_of(lambda b=backend: _distill_step(image, text, t_image, t_text, b), args.repeats)
        rows.append((f"cal_distill_loss fwd+bwd {backend}", distill, distill / gemm, 6.0))
    return rows


def _peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmHWM: the peak resident set, VmRSS: the current one), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rss() -> int:
    return _status_bytes("VmHWM")


def _rss() -> int:
    return _status_bytes("VmRSS")


def measured(fn, device: torch.device):
    """(result, seconds, peak memory growth in bytes) of one call of ``fn`` on ``device``: CUDA's allocator peak
    (synchronized before and after), else the process's peak resident set."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = _rss()
        _peak_rss_reset()
    start = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    growth = (torch.cuda.max_memory_allocated() if cuda else _peak_rss()) - before
    return out, wall, growth


def scale(args) -> list:
    image, text = (t.to(args.device) for t in _features(args.n, args.dim))
    rows = args.rows or args.n
    if not 0 < rows <= args.n:
        raise SystemExit(f"--rows must be in 1..--n ({args.n}), got {rows}")
    image = image[:rows]
    # A slice of rows: the first `rows` images against every text, each image's positive its own text
    # (any_positive over ids; the texts past `rows` have no positive, so no rank). The call walks rows x n
    # tiles, the whole set's n x n tiles in n / rows times the time.
    slice_args = {} if rows == args.n else _slice_ids(rows, args.n, image.device)
    metrics, wall, growth = measured(
        lambda: retrieval_metrics(image, text, backend=args.backend, **slice_args), image.device
    )
    features = (image.numel() + text.numel()) * image.element_size()
    print({k: round(v, 6) for k, v in metrics.items()})
    out = [(f"retrieval_metrics {args.backend} {rows} x {args.n}", wall, growth / 2**20, features / 2**20)]
    if rows < args.n:
        whole = wall * args.n / rows
        out.append((f"  extrapolated {args.n} x {args.n} (x {args.n / rows:.1f})", whole, float("nan"), float("nan")))
    return out


def _slice_ids(rows: int, n: int, device) -> dict:
    return {
        "q_ids": torch.arange(rows, device=device),
        "k_ids": torch.arange(n, device=device),
        "any_positive": True,
    }


def memory(args) -> list:
    image, text = _features(args.n, args.dim)
    t_image, t_text = _features(args.n, args.dim, seed=1)
    image.requires_grad_()
    text.requires_grad_()
    scale = torch.tensor(20.0, requires_grad=True)
    if args.method == "open_clip":
        from bench import open_clip_loss

        loss_fn = open_clip_loss.load().DistillClipLoss()
    else:
        from infcl import InfDistillClipLoss

        loss_fn = InfDistillClipLoss(backend=args.backend)
    before = _rss()
    _peak_rss_reset()
    start = time.perf_counter()
    contrastive, distill = loss_fn(image, text, scale, t_image, t_text, torch.tensor(30.0))
    (contrastive + distill).backward()
    wall = time.perf_counter() - start
    growth = _peak_rss() - before
    features = 4 * image.numel() * image.element_size()
    print(f"contrastive {float(contrastive.detach()):.6f} distill {float(distill.detach()):.6f}")
    return [(f"{args.method} DistillClipLoss fwd+bwd", wall, growth / 2**20, features / 2**20)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("ratio", "scale", "memory"))
    parser.add_argument("--method", choices=("open_clip", "infcl"), default="infcl", help="memory mode only")
    parser.add_argument("--n", type=int, default=8192, help="pairs (rows of image and of text)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rows", type=int, default=None, help="scale only: rank the first ROWS images against all n")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backends", default=None, help="ratio: comma-separated backends (default: every one here)")
    parser.add_argument("--backend", default="auto", help="scale and memory: the backend")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = _cpu_name(args.device)
    if args.mode == "ratio":
        header = ("what", "seconds", "x gemm-equivalent", "tile products (GEMMs)")
        rows = ratio(args)
    else:
        header = ("what", "seconds", "peak growth MiB", "features MiB")
        rows = scale(args) if args.mode == "scale" else memory(args)
    print(f"N={args.n} D={args.dim} fp32 threads={args.threads} on {cpu}")
    report(header, rows, args.csv, {"n": args.n, "dim": args.dim, "threads": args.threads, "cpu": cpu})


def report(header: tuple, rows: list, csv_path, settings: dict) -> None:
    """Print ``rows`` as a table under ``header``; with ``csv_path``, also write them there, each row led by the
    run's ``settings`` (column name -> value)."""
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(tuple(settings) + header)
            for row in rows:
                out.writerow(tuple(settings.values()) + tuple(row))


def _cpu_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return os.uname().machine
    name = fields.get("model name", os.uname().machine)
    return f"{name} family {fields.get('cpu family')} model {fields.get('model')}"


if __name__ == "__main__":
    main()
