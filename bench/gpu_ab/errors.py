"""The ``errors`` step (loss and gradients against float64: chunked, fused and vanilla in bf16 / fp16 / TF32, with
labels, ids + guide and SigLIP; reruns bit-identical) and the ``bits`` step (S of the forward against the
backward's recomputation, bit for bit)."""

import torch

from .plan import Sizes
from .rows import Rows
from .speed import chunk_plan
from .timing import device_for


def grads(fn, q, k, scale):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, scale)]
    loss = fn(*leaves)
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves]


def cases(device: torch.device, n: int, dim: int):
    """(name, dtype, tf32, loss kwargs builder, siglip) of the error step."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.randperm(n, generator=gen).to(device)
    ids = (torch.arange(n) // 4).to(device)
    guide = torch.nn.functional.normalize(torch.randn(n, dim, generator=gen), dim=-1).to(device)
    return (
        ("bf16 symmetric", torch.bfloat16, False, {"symmetric": True}, False),
        ("bf16 labels", torch.bfloat16, False, {"labels": labels}, False),
        ("fp16 symmetric", torch.float16, False, {"symmetric": True}, False),
        ("fp32 tf32 symmetric", torch.float32, True, {"symmetric": True}, False),
        ("bf16 siglip", torch.bfloat16, False, {}, True),
        # Last: the guided Triton kernel faulted once on an H200 (tools/guided_fault_repro.py); a fault ends the step.
        ("bf16 ids+guide", torch.bfloat16, False, {"q_ids": ids, "k_ids": ids, "guide": (guide, guide)}, False),
    )


def case_losses(kw: dict, siglip: bool, dtype: torch.dtype):
    """(loss by backend name, torch's own loss in that dtype or None) of one error case."""
    from bench.methods import siglip_vanilla_loss, vanilla_loss
    from infcl import cal_inf_loss, cal_siglip_loss

    if siglip:
        return (
            lambda backend: lambda q, k, s: cal_siglip_loss(q, k, s, -10.0, backend=backend),
            lambda q, k, s: siglip_vanilla_loss(q, k, s, False),
        )
    symmetric = kw.get("symmetric", False)
    vanilla = None
    if "guide" not in kw and "labels" not in kw:
        vanilla = lambda q, k, s: vanilla_loss(q, k, s, symmetric)  # noqa: E731
    return (lambda backend: lambda q, k, s: cal_inf_loss(q, k, scale=s, backend=backend, **kw)), vanilla


def step_errors(rows: Rows, sizes: Sizes, dry: bool) -> None:
    from bench.methods import make_inputs

    device, n = device_for(dry), sizes.check
    fused = "triton" if device.type == "cuda" else "torch"
    for name, dtype, tf32, kw, siglip in cases(device, n, sizes.dim):
        q, k, scale = make_inputs(n, sizes.dim, dtype, device, seed=1)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        loss, vanilla = case_losses(kw, siglip, dtype)
        rows.add(name, "chunk plan", "fused (siglip)" if siglip else chunk_plan(q, k, masked="guide" in kw))
        truth = grads(loss("torch"), q.double(), k.double(), scale.double())
        runs = {"chunked": loss("chunked"), f"fused ({fused})": loss(fused)}
        if vanilla is not None:
            runs[f"vanilla {dtype}".replace("torch.", "")] = vanilla
        for method, fn in runs.items():
            got = grads(fn, q, k, scale)
            for part, g, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
                err = float((g.double() - t).abs().max() / t.abs().max().clamp_min(1e-30))
                rows.add(f"{name} {method}", f"{part} rel err", err, "max|err|/max|truth|")
            if method == "chunked":
                again = grads(fn, q, k, scale)
                same = all(torch.equal(a, b) for a, b in zip(got, again))
                rows.add(f"{name} {method}", "rerun identical", int(same))
    torch.backends.cuda.matmul.allow_tf32 = False


def step_bits(rows: Rows, sizes: Sizes, dry: bool) -> None:
    from bench.methods import make_inputs
    from infcl import cal_inf_loss
    from infcl.backends import chunked
    from infcl.backends.chunked.products import Products
    from infcl.contract import Block

    device, n = device_for(dry), sizes.bits
    q, k, scale = make_inputs(n, sizes.dim, torch.bfloat16, device)
    block = Block(q=q.detach(), k=k.detach(), scale=scale.detach(), pos=torch.arange(n, device=device))
    plan = chunked.BACKEND.plan(block)
    if not hasattr(plan, "rows"):
        rows.add(f"B={n}", "S bits", "-", "", plan.reason)
    else:
        products, same = Products(block, plan), True
        for c in plan.chunks(n):
            buf = torch.empty(c.stop - c.start, n, device=device)
            first = products.scores(c, buf).clone()
            dq_dk = torch.zeros(n, sizes.dim, device=device), torch.zeros(n, sizes.dim, device=device)
            products.accumulate(torch.zeros_like(buf, dtype=plan.ds_dtype), c, block, None, *dq_dk)
            same &= bool(torch.equal(first, products.scores(c, buf)))
        rows.add(f"B={n} C={plan.rows}", "S fwd == bwd bits", int(same))
    fn = lambda q_, k_, s_: cal_inf_loss(q_, k_, scale=s_, symmetric=True, backend="chunked")  # noqa: E731
    first, again = grads(fn, q, k, scale), grads(fn, q, k, scale)
    rows.add(f"B={n}", "rerun identical", int(all(torch.equal(a, b) for a, b in zip(first, again))))
