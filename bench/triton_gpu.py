"""GPU benchmark of backend="triton": forward + backward time, peak memory and error, against the vanilla
loss (materialized logits + F.cross_entropy) and, when installed, Inf-CL's ``inf_cl.cal_inf_loss``.

    python bench/triton_gpu.py [--batches 4096 16384 65536] [--dim 512] [--dtype bfloat16] [--symmetric]

Per provider and batch size: median milliseconds of one forward + backward (CUDA events, after warm-up),
peak memory above the inputs (torch.cuda.max_memory_allocated), and the max abs error of the loss and of
dq / dk against a float64 vanilla reference (computed only while B*B*8 bytes fits, see MAX_REF_LOGITS).
Writes a table to stdout and bench/results/triton_gpu.csv (+ .png when matplotlib is present).
Without CUDA it says so and exits with status 0.
"""

import argparse
import csv
import importlib.util
import os
import sys

import torch

# Float64 reference only up to this many logits (8 bytes each: 2**28 logits = 2 GiB, twice for grads).
MAX_REF_LOGITS = 2**28
WARMUP, REPEATS = 2, 5
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _vanilla(q, k, labels, scale, symmetric):
    logits = scale * q @ k.T
    rows = torch.nn.functional.cross_entropy(logits, labels)
    if not symmetric:
        return rows
    return (rows + torch.nn.functional.cross_entropy(logits.T, torch.argsort(labels))) / 2


def _providers(symmetric):
    from infcl import cal_inf_loss

    providers = {
        "vanilla": lambda q, k, labels, scale: _vanilla(q, k, labels, scale, symmetric),
        "infcl-triton": lambda q, k, labels, scale: cal_inf_loss(
            q, k, labels, scale, symmetric=symmetric, backend="triton"
        ),
    }
    if importlib.util.find_spec("inf_cl") is not None and not symmetric:
        from inf_cl import cal_inf_loss as inf_cl_loss

        # Inf-CL's head_dim must be 16..256 and equal to D; it returns the mean row loss.
        providers["inf_cl"] = lambda q, k, labels, scale: inf_cl_loss(q, k, labels, scale, head_dim=q.shape[1])
    return providers


def _step(fn, q, k, labels, scale):
    q.grad = k.grad = None
    loss = fn(q, k, labels, scale)
    loss.backward()
    return loss.detach(), q.grad, k.grad


def _measure(fn, q, k, labels, scale):
    """(median ms, peak MiB above the inputs, (loss, dq, dk)) or None on out-of-memory."""
    try:
        for _ in range(WARMUP):
            _step(fn, q, k, labels, scale)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = _step(fn, q, k, labels, scale)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = []
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(fn, q, k, labels, scale)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2], peak, out
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def _reference(q, k, labels, scale, symmetric):
    if q.shape[0] * k.shape[0] > MAX_REF_LOGITS:
        return None
    qd, kd = (t.detach().double().requires_grad_(True) for t in (q, k))
    loss = _vanilla(qd, kd, labels, float(scale), symmetric)
    loss.backward()
    return loss.detach(), qd.grad, kd.grad


def _max_err(out, ref):
    if out is None or ref is None:
        return float("nan")
    return max(float((a.double() - b).abs().max()) for a, b in zip(out, ref))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--symmetric", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/triton_gpu.py: no CUDA device here; nothing to measure.")
        return 0

    dtype = getattr(torch, args.dtype)
    rows = []
    for batch in args.batches:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        q = torch.nn.functional.normalize(torch.randn(batch, args.dim, device="cuda", generator=gen), dim=1)
        k = torch.nn.functional.normalize(torch.randn(batch, args.dim, device="cuda", generator=gen), dim=1)
        q, k = (t.to(dtype).requires_grad_(True) for t in (q, k))
        labels = torch.arange(batch, device="cuda")
        scale = torch.tensor(14.3, device="cuda")
        ref = _reference(q, k, labels, scale, args.symmetric)
        for name, fn in _providers(args.symmetric).items():
            result = _measure(fn, q, k, labels, scale)
            ms, peak, out = result if result is not None else (float("nan"), float("nan"), None)
            rows.append({"provider": name, "batch": batch, "dim": args.dim, "dtype": args.dtype,
                         "symmetric": args.symmetric, "ms": ms, "peak_mib": peak,
                         "max_abs_err": _max_err(out, ref), "oom": result is None})
            del out
        del q, k, ref
        torch.cuda.empty_cache()

    print(f"{'provider':<14}{'batch':>8}{'ms':>10}{'peak MiB':>12}{'max abs err':>14}")
    for r in rows:
        note = "  (out of memory)" if r["oom"] else ""
        print(f"{r['provider']:<14}{r['batch']:>8}{r['ms']:>10.2f}{r['peak_mib']:>12.1f}{r['max_abs_err']:>14.3g}{note}")
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "triton_gpu.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    if importlib.util.find_spec("matplotlib") is not None:
        _plot(rows, path[:-4] + ".png")
    return 0


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["provider"] for r in rows):
        mine = [r for r in rows if r["provider"] == name and not r["oom"]]
        for ax, key in zip(axes, ("ms", "peak_mib")):
            ax.plot([r["batch"] for r in mine], [r[key] for r in mine], marker="o", label=name)
    for ax, label in zip(axes, ("forward + backward (ms)", "peak memory above inputs (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
