"""infcl.topk_scores around the ring: 1, 2 and 3 gloo ranks with uneven shards of the rows and the corpus,
on the torch tiles, the native kernel and the Triton kernel (interpreted without a GPU); each rank's rows
get their global top-n: the indices of the float64 truth of the whole set at every world size, and where
the products are exact (quarter features) the same score bits too (random float64 scores may differ in the
last bits: BLAS blocks a product by its shape, and the shards cut the corpus into other tiles)."""

import pytest
import torch

from helpers.distributed import launch, results_by_ring
from helpers.topk_truth import topk_truth
from workers.topk_ring_worker import BACKENDS, CASES, MAIN_WORLD, RINGS, global_inputs


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    outcomes = launch(
        MAIN_WORLD,
        "workers.topk_ring_worker",
        str(tmp_path_factory.mktemp("topk")),
        pg_timeout_s=60.0,
        deadline_s=240.0,
    )
    return results_by_ring(outcomes, RINGS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_world_size_gives_the_global_top_n(spawned, case, backend):
    q, k, labels, q_ids, k_ids = global_inputs(case)
    want_scores, want_index = topk_truth(q, k, case.n, labels, q_ids, k_ids, case.largest)
    alone = None
    for world in sorted(RINGS):
        per_rank = [r[(case.name, backend)] for r in spawned(world)]
        scores = torch.cat([r["scores"] for r in per_rank])
        indices = torch.cat([r["indices"] for r in per_rank])
        assert torch.equal(indices, want_index), f"world {world}"
        if case.ties:
            assert torch.equal(scores.double().nan_to_num(0.0), want_scores.nan_to_num(0.0)), f"world {world}"
        else:
            torch.testing.assert_close(scores, want_scores, atol=1e-12, rtol=0)
        assert torch.equal(scores.isnan(), want_scores.isnan())
        if alone is None:
            alone = scores
        if case.ties:
            assert torch.equal(scores.nan_to_num(0.0), alone.nan_to_num(0.0)), f"world {world}: other scores"
    if case.nan:
        nan_rows = want_scores.isnan().all(dim=1)
        assert not bool(nan_rows[0]) and bool(nan_rows[1:].any())
