"""On a GPU: cal_maxsim_loss(backend="triton") (issue 55) against the float64 truth beside the torch tiles' own
error on the same GPU, the tie rule on exact copies, run-to-run determinism, and time / peak memory at the ColBERT
shape (B = 1024 and 4096, Lq = 32, Ld = 180, D = 128) against the torch tiles. No GPU has run the MaxSim kernels
yet: this is the one prepared check, a few minutes on an H100 with Triton's compiles.

    PYTHONUNBUFFERED=1 python tools/maxsim_gpu_check.py      # from the repository root

Prints one line per check (``ok`` / ``FAIL``) and per timing, and exits 1 if a check failed. A check passes when
every error of the kernels (loss, dq, dd, dscale; relative to the truth's largest entry) is within 3x the torch
tiles' on the same inputs or the dtype's tolerance of tests/test_maxsim.py, and two runs give the same bits.
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import infcl  # noqa: E402
from helpers.maxsim_truth import maxsim_loss  # noqa: E402

DEVICE = "cuda"
# tests/test_maxsim.py's tolerances, relative to the truth's largest entry.
TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-10}


def _grads(backend, q, docs, labels, scale, upstream, **kwargs):
    """(loss, dq, dd, dscale) in float64 of infcl by ``backend`` (``backend=None``: the float64 truth)."""
    dtype = torch.float64 if backend is None or q.dtype == torch.float64 else torch.float32
    qq = (q.double() if backend is None else q).detach().clone().requires_grad_()
    dd = (docs.double() if backend is None else docs).detach().clone().requires_grad_()
    ss = torch.tensor(scale, dtype=dtype, device=q.device, requires_grad=True)
    if backend is None:
        loss = maxsim_loss(qq, dd, labels, ss, reduction="none", **kwargs)
    else:
        loss = infcl.cal_maxsim_loss(qq, dd, labels, ss, reduction="none", backend=backend, **kwargs)
    (loss * upstream.to(loss.dtype)).sum().backward()
    return tuple(t.detach().double() for t in (loss, qq.grad, dd.grad, ss.grad))


def _error(ours, truth) -> float:
    finite = torch.isfinite(truth)
    if not finite.any():
        return 0.0
    return float((ours[finite] - truth[finite]).abs().max() / truth[finite].abs().max().clamp(min=1e-30))


def check(name, bq, bk, lq, lk, d, dtype, scale=1.7, masks=True, ids=False, length_normalize=False) -> bool:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(bq, lq, d, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    docs = torch.randn(bk, lk, d, generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)
    kwargs = {"length_normalize": length_normalize}
    if masks:
        q_mask, docs_mask = torch.rand(bq, lq, generator=gen) > 0.3, torch.rand(bk, lk, generator=gen) > 0.3
        q_mask[:, 0] = docs_mask[:, -1] = True
        kwargs.update(q_mask=q_mask.to(DEVICE), docs_mask=docs_mask.to(DEVICE))
    if ids:
        kwargs.update(
            q_ids=torch.randint(0, 4, (bq,), generator=gen).to(DEVICE),
            k_ids=torch.randint(0, 4, (bk,), generator=gen).to(DEVICE),
        )
    labels = torch.randperm(bk, generator=gen)[:bq].to(DEVICE)
    upstream = (2 * torch.randn(bq, generator=gen, dtype=torch.float64)).to(DEVICE)
    truth = _grads(None, q, docs, labels, scale, upstream, **kwargs)
    ours = _grads("triton", q, docs, labels, scale, upstream, **kwargs)
    again = _grads("triton", q, docs, labels, scale, upstream, **kwargs)
    tiles = _grads("torch", q, docs, labels, scale, upstream, **kwargs)
    same = all(torch.equal(a, b) for a, b in zip(ours, again))
    errors = [_error(a, b) for a, b in zip(ours, truth)]
    theirs = [_error(a, b) for a, b in zip(tiles, truth)]
    ok = same and all(e <= max(3 * t, TOLERANCES[dtype]) for e, t in zip(errors, theirs))
    shown = " ".join(f"{e:.1e}/{t:.1e}" for e, t in zip(errors, theirs))
    verdict = "ok  " if ok else "FAIL"
    print(f"{verdict} {name:26s} {str(dtype)[6:]:8s} ours/tiles (loss dq dd dscale): {shown} same={same}")
    return ok


def check_ties(dtype) -> bool:
    """Exact copies of random document tokens in the first, middle and last of 3 document chunks get no gradient."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(6, 5, 64, generator=gen).to(dtype).to(DEVICE).requires_grad_()
    docs = torch.randn(7, 150, 64, generator=gen)
    docs[:, 2] *= 4.0
    copies = (17, 70, 149)
    for c in copies:
        docs[:, c] = docs[:, 2]
    docs = docs.to(dtype).to(DEVICE).requires_grad_()
    infcl.cal_maxsim_loss(q, docs, torch.arange(6, device=DEVICE), 0.5, backend="triton").backward()
    ok = all(torch.equal(docs.grad[:, c], torch.zeros_like(docs.grad[:, c])) for c in copies)
    ok = ok and bool((docs.grad[:, 2].abs().sum(dim=1) > 0).all())
    print(f"{'ok  ' if ok else 'FAIL'} ties: only the first copy  {str(dtype)[6:]}")
    return ok


def timing(batch, dtype, backends=("triton", "torch"), repeats=3):
    """Forward and backward ms (CUDA events, mean of ``repeats`` after a warm-up) and peak MiB beyond the inputs."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(batch, 32, 128, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    docs = torch.randn(batch, 180, 128, device=DEVICE, generator=gen).to(dtype).requires_grad_()
    flops = 2 * batch * batch * 32 * 180 * 128  # one GEMM-equivalent
    for backend in backends:
        infcl.cal_maxsim_loss(q, docs, scale=20.0, backend=backend).backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
        fwd = bwd = 0.0
        for _ in range(repeats):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
            loss = infcl.cal_maxsim_loss(q, docs, scale=20.0, backend=backend)
            events[1].record()
            loss.backward()
            events[2].record()
            torch.cuda.synchronize()
            fwd += events[0].elapsed_time(events[1]) / repeats
            bwd += events[1].elapsed_time(events[2]) / repeats
        peak = (torch.cuda.max_memory_allocated() - start_bytes) / 2**20
        print(
            f"B={batch} {str(dtype)[6:]:8s} {backend:6s} forward {fwd:8.1f} ms ({flops / fwd / 1e9:6.1f} TFLOP/s) "
            f"backward {bwd:8.1f} ms ({3 * flops / bwd / 1e9:6.1f} TFLOP/s)  peak +{peak:.0f} MiB"
        )


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        ok &= check("small, masks", 7, 9, 5, 11, 13, dtype)
        ok &= check("ColBERT-like, ids, mean", 33, 70, 32, 180, 128, dtype, ids=True, length_normalize=True)
        ok &= check("long query, ragged D", 9, 13, 100, 70, 200, dtype, ids=True)
        ok &= check_ties(dtype)
    ok &= check("ColBERT-like, ids, mean", 33, 70, 32, 180, 128, torch.float16, ids=True, length_normalize=True)
    ok &= check("ColBERT-like, ids, mean", 33, 70, 32, 180, 128, torch.float64, ids=True, length_normalize=True)
    ok &= check("confident rows", 40, 40, 8, 33, 64, torch.float32, scale=30.0)
    ok &= check("no masks", 40, 40, 8, 33, 64, torch.bfloat16, masks=False)
    timing(1024, torch.bfloat16)
    timing(1024, torch.float32)
    timing(4096, torch.bfloat16)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
