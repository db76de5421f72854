"""The guided Triton fault's case (tools/guided_fault_repro.py): bfloat16 features of width D = 64 (one feature
chunk, the q tile resident) beside a float32 guide of width D' = 384 (twelve whole guide chunks: EVEN_G),
under sm_90's masked tiling, on a batch no block divides and on one every block divides.

- interpreter (TRITON_INTERPRET=1, no GPU): loss, dq, dk against the float64 truth, with the exact
  tiles, flags and chunkings the GPU launch takes (pinned: the interpreter's own tiling is otherwise used);
- compile gate (TRITON_INTERPRET=0, compile-only for sm_90): every kernel of the public call compiles
  without spills, within shared memory, with the launcher's constexprs for this case.
"""

import concurrent.futures
import multiprocessing

import pytest
import torch
import torch.nn.functional as F

from helpers.support import TOLERANCE, assert_close_verbose, grads_of_inputs, masked_loss_truth
from infcl import cal_inf_loss
from infcl.backends import unavailable_reason

TRITON = unavailable_reason("triton", torch.device("cpu")) is None
DIM, GUIDE_DIM = 64, 384


def _case(b: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, DIM, generator=gen), dim=1)
    k = F.normalize(q + 0.3 * torch.randn(b, DIM, generator=gen), dim=1)
    gq = F.normalize(torch.randn(b, GUIDE_DIM, generator=gen), dim=1)
    gk = F.normalize(gq + torch.randn(b, GUIDE_DIM, generator=gen), dim=1)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), (gq, gk)


def _sm90_masked_tiling():
    from infcl.kernels.tiling import tiling_for

    return tiling_for(90, torch.bfloat16, "ieee", DIM, masked=True, guide=True)


@pytest.mark.skipif(not TRITON, reason="Triton unavailable")
@pytest.mark.parametrize("b, symmetric", [(80, True), pytest.param(128, False, marks=pytest.mark.slow)])
def test_interpreted_guided_bf16_narrow_features(b, symmetric, monkeypatch):
    from infcl.backends import triton as triton_backend

    tiling = _sm90_masked_tiling()
    assert tiling.block_d(DIM) == DIM  # one resident feature chunk, as on the GPU
    monkeypatch.setattr(triton_backend.BACKEND, "tiling", tiling)
    q, k, guide = _case(b)
    atol, rtol = TOLERANCE[torch.bfloat16]
    upstream = torch.linspace(0.5, 1.5, b)

    def loss(backend, cast):
        return lambda q_, k_: cal_inf_loss(
            cast(q_),
            cast(k_),
            None,
            10.0,
            symmetric=symmetric,
            reduction="none",
            guide=tuple(cast(g) for g in guide),
            backend=backend,
        )

    ours = grads_of_inputs(loss("triton", lambda t: t), (q, k), upstream)
    # the float64 truth of the rule, its guide scores exactly rounded (tests/helpers/exact_scores.py)
    ref = grads_of_inputs(
        lambda q_, k_: masked_loss_truth(q_, k_, None, 10.0, symmetric=symmetric, reduction="none", guide=guide),
        (q.double(), k.double()),
        upstream,
    )
    for name, got, want in zip(("loss", "dq", "dk"), ours, ref):
        assert_close_verbose(got, want, atol, rtol, f"{name} b={b} symmetric={symmetric}")


def _compile(b: int, symmetric: bool):
    """Compile-only (sm_90) of the public call; rows of (kernel, constexprs, resources)."""
    from helpers import triton_compile

    with triton_compile.compile_only(90) as (compiled, start):
        q, k, guide = _case(b)
        q.requires_grad_()
        k.requires_grad_()
        cal_inf_loss(q, k, None, 10.0, symmetric=symmetric, backend="triton", guide=guide).backward()
        launches = list(zip(compiled[start:], triton_compile._RECORDER.launches[start:]))
    return [
        (triton_compile._kernel_name(fn), launch, triton_compile._resources(fn, kernel, log, 90))
        for (fn, kernel, log), launch in launches
    ]


@pytest.mark.skipif(not TRITON, reason="Triton unavailable")
def test_guided_bf16_narrow_features_compile_for_sm90():
    from helpers import triton_compile

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, context, initializer=triton_compile.init_worker) as pool:
        rows = pool.submit(_compile, 1000, False).result()
    kernels = {name: (launch, usage) for name, launch, usage in rows}
    assert {"guide_label_scores", "forward", "dq", "dk"} <= set(kernels), sorted(kernels)
    for name, (launch, usage) in kernels.items():
        assert usage["spill_bytes"] == 0, (name, usage)
        assert usage["smem"] <= usage["smem_limit"], (name, usage)
        if name != "guide_label_scores":
            # The features' chunking from D, the guide's from D': never one for the other.
            assert (launch["D"], launch["BLOCK_D"], launch["ONE_CHUNK"]) == (DIM, 64, True), (name, launch)
        assert (launch["DG"], launch["BLOCK_G"], launch["EVEN_G"]) == (GUIDE_DIM, 32, True), (name, launch)
        assert launch["GUIDE_PRECISION"] == "tf32", (name, launch)
