"""Property-based: random shapes, labels, scales and tile sizes against the float64 vanilla loss."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infcl import cal_inf_loss
from infcl.backends.torch_tiles import TORCH_TILES
from support import assert_close_verbose, grads_of, tiled_backends, vanilla_loss


@st.composite
def problems(draw):
    symmetric = draw(st.booleans())
    bq = draw(st.integers(1, 70))
    bk = bq if symmetric else draw(st.integers(bq, 90))
    d = draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if bq == bk and draw(st.booleans()):
        labels = None  # the diagonal
    elif symmetric:
        labels = torch.randperm(bq, generator=gen)
    else:
        labels = torch.randint(0, bk, (bq,), generator=gen)
    q = torch.randn(bq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(bk, d, generator=gen, dtype=torch.float64)
    scale = torch.tensor(draw(st.floats(0.0, 30.0)), dtype=torch.float64)
    reduction = draw(st.sampled_from(("mean", "sum", "none")))
    tiles = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    return q, k, labels, scale, symmetric, reduction, tiles


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=problems(), backend=st.sampled_from(tiled_backends()))
def test_random_problems_match_vanilla(problem, backend, monkeypatch):
    q, k, labels, scale, symmetric, reduction, (tile_q, tile_k) = problem
    monkeypatch.setattr(TORCH_TILES, "tile_q", tile_q)
    monkeypatch.setattr(TORCH_TILES, "tile_k", tile_k)
    upstream = torch.rand(q.shape[0], dtype=torch.float64) + 0.5 if reduction == "none" else None

    def ours(q_, k_, s_):
        return cal_inf_loss(q_, k_, labels, s_, symmetric=symmetric, reduction=reduction, backend=backend)

    def truth(q_, k_, s_):
        return vanilla_loss(q_, k_, labels, s_, symmetric, reduction)

    for name, g, w in zip(
        ("loss", "dq", "dk", "dscale"), grads_of(ours, q, k, scale, upstream), grads_of(truth, q, k, scale, upstream)
    ):
        assert_close_verbose(g, w, 1e-9, 1e-9, name)
