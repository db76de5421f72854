"""Quick demo: the symmetric CLIP loss with every available infcl backend, checked against vanilla.

    python examples/quickstart.py              # B=4096, D=256 (embedded default)
    python examples/quickstart.py --batch 8192 --dim 512

For each backend ("reference" and whichever of "torch", "cpu", "triton" run here) it computes the loss
and the gradients of q, k and the logit scale, compares them with the vanilla loss (F.cross_entropy on
materialized float64 logits), and prints the worst relative error, the median fwd+bwd time and the
peak extra memory. Exits with status 1 if any backend is off by more than MAX_REL_ERR.
Memory here is measured in this one process; ``python -m bench`` measures each configuration in a
fresh process, the cleaner figure.
"""

import argparse
import sys
from pathlib import Path

import torch

# Run from a checkout: the timing and memory helpers live in the benchmark suite next to this folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measure import MIB, loss_step, median, peak_extra_bytes, time_step  # noqa: E402
from bench.methods import make_inputs, vanilla_loss  # noqa: E402
from infcl import cal_inf_loss  # noqa: E402
from infcl.backends import unavailable_reason  # noqa: E402

BACKENDS = ("reference", "torch", "cpu", "triton")
# Agreement demanded of every backend, relative to the largest magnitude of each float64 quantity.
MAX_REL_ERR = 1e-4
REPEATS = 3


def vanilla_clip_loss(q, k, scale):
    """open_clip's ClipLoss: materialized [B, B] logits, cross-entropy both ways."""
    return vanilla_loss(q, k, scale, symmetric=True)


def loss_and_grads(loss_fn, q, k, scale):
    """(loss, dq, dk, dscale) of one fwd+bwd; the inputs are fresh leaves each call."""
    q, k, scale = (t.detach().requires_grad_(True) for t in (q, k, scale))
    loss = loss_fn(q, k, scale)
    loss.backward()
    return loss.detach(), q.grad, k.grad, scale.grad


def max_rel_error(got, truth) -> float:
    """Worst of max|got - truth| / max|truth| over (loss, dq, dk, dscale)."""
    return max(
        float((g.double() - t).abs().max() / t.abs().max().clamp_min(torch.finfo(torch.float64).tiny))
        for g, t in zip(got, truth)
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, scale = make_inputs(args.batch, args.dim, torch.float32, device)
    truth = loss_and_grads(vanilla_clip_loss, q.double(), k.double(), scale.double())
    print(f"symmetric CLIP loss, B={args.batch}, D={args.dim}, float32 on {device}: loss {truth[0].item():.6f}")

    methods = {"vanilla": vanilla_clip_loss}
    for name in BACKENDS:
        why = unavailable_reason(name, device)
        if why is not None:
            print(f"  {name:>9}: skipped ({why})")
            continue
        methods[name] = lambda q, k, s, name=name: cal_inf_loss(q, k, scale=s, symmetric=True, backend=name)

    print(f"  {'method':>9}  {'max rel err':>11}  {'fwd+bwd [s]':>11}  {'peak extra [MiB]':>16}")
    failed = []
    for name, loss_fn in methods.items():
        err = max_rel_error(loss_and_grads(loss_fn, q, k, scale), truth)
        step = loss_step(loss_fn, q, k, scale, "forward+backward")
        mib = peak_extra_bytes(step, device) / MIB
        seconds = median(time_step(step, device, warmup=1, repeats=REPEATS))
        flag = "" if err <= MAX_REL_ERR else f"  FAIL (> {MAX_REL_ERR:g})"
        print(f"  {name:>9}  {err:>11.2e}  {seconds:>11.3f}  {mib:>16.1f}{flag}")
        if flag:
            failed.append(name)
    if failed:
        print(f"loss or gradients off by more than {MAX_REL_ERR:g} relative: {', '.join(failed)}")
        return 1
    print(f"all methods agree with the float64 vanilla loss to {MAX_REL_ERR:g} relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())
