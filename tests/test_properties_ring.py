"""The property suite's ring part: seeded random masked cases on 1, 2 and 3 gloo ranks with uneven shards.

One launch per world size (tests/workers/properties_ring_worker.py) runs every case on every CPU backend;
each rank's loss, dq, dk and own dscale are compared here with the float64 truth written without infcl
(tests/helpers/truth.py, the property suite's), cut into the ranks' shards: rank r's loss is its rows' (and,
symmetric, its columns') losses reduced locally; its gradients are those of sum_s <upstream_s, L_s>.
INFCL_HYPOTHESIS_PROFILE=deep draws many more cases.
"""

import os

import pytest
import torch

from helpers.distributed import describe, launch
from helpers.support import assert_close_verbose, reduce_masked_truth
from workers.properties_ring_worker import BACKENDS, draw_case

CASES = 150 if os.environ.get("INFCL_HYPOTHESIS_PROFILE") == "deep" else 12
ATOL, RTOL = 2e-5, 2e-5  # float32 inputs against the float64 truth, as tests/test_properties.py


@pytest.fixture(scope="module", params=(1, 2, 3), ids=lambda w: f"world{w}")
def spawned(request, tmp_path_factory):
    """(world, every rank's results) of one launch of ``world`` ranks."""
    world = request.param
    outcomes = launch(
        world,
        "workers.properties_ring_worker",
        str(tmp_path_factory.mktemp(f"props{world}")),
        [str(CASES)],
        pg_timeout_s=60.0,
        deadline_s=240.0,
    )
    if not all(o.returncode == 0 and o.results is not None for o in outcomes):
        pytest.fail(f"ring workers failed:\n{describe(outcomes)}")
    return world, [o.results for o in outcomes]


def _truth(case, world, float64_truth):
    """Per rank: (loss, dq, dk, dscale) in float64."""
    q, k = case.q.double().requires_grad_(True), case.k.double().requires_grad_(True)
    scale = torch.tensor(case.scale, dtype=torch.float64, requires_grad=True)
    o = case.options
    rows, cols = float64_truth.truth_directions(
        q,
        k,
        case.labels,
        scale,
        case.symmetric,
        o["q_ids"],
        o["k_ids"],
        o["multi_positive"],
        o["guide"],
        o.get("guide_margin", 0.0),
        o.get("guide_margin_strategy", "absolute"),
    )
    losses, weighted = [], []
    for r in range(world):
        qs = slice(case.q_offsets[r], case.q_offsets[r] + case.q_sizes[r])
        ks = slice(case.k_offsets[r], case.k_offsets[r] + case.k_sizes[r])
        local = reduce_masked_truth(rows[qs], None if cols is None else cols[ks], case.reduction)
        losses.append(local)
        up = case.upstream[qs] if case.reduction == "none" else case.upstream[qs].sum()
        weighted.append((local * up).nan_to_num(0.0).sum())
    dq, dk = torch.autograd.grad(sum(weighted), (q, k), retain_graph=True)
    out = []
    for r in range(world):
        (dscale,) = torch.autograd.grad(weighted[r], scale, retain_graph=True)
        qs = slice(case.q_offsets[r], case.q_offsets[r] + case.q_sizes[r])
        ks = slice(case.k_offsets[r], case.k_offsets[r] + case.k_sizes[r])
        out.append((losses[r].detach(), dq[qs], dk[ks], dscale))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_cases_match_float64_truth(spawned, backend, float64_truth):
    world, ranks = spawned
    for index in range(CASES):
        case = draw_case(world, index)
        what = (
            f"case {index} world={world} {backend} sizes q={case.q_sizes} k={case.k_sizes} "
            f"sym={case.symmetric} {case.reduction} layouts={case.layouts} mp={case.options['multi_positive']}"
        )
        truth = _truth(case, world, float64_truth)
        for r, results in enumerate(ranks):
            got = results[index, backend]
            assert "error" not in got, f"{what} rank={r}: {got.get('error')}"
            assert_close_verbose(got["loss"], truth[r][0], ATOL, RTOL, f"{what} rank={r} loss")
        if any(torch.isnan(t[0]).any() for t in truth):
            continue  # NaN in, NaN out: the losses' pattern is checked; NaN gradient entries are not specified
        for r, results in enumerate(ranks):
            got = results[index, backend]
            for name, want in zip(("dq", "dk", "dscale"), truth[r][1:]):
                assert_close_verbose(got[name], want, ATOL, RTOL, f"{what} rank={r} {name}")
