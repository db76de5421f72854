"""cal_maxsim_loss around the ring: 1, 2 and 3 gloo ranks, uneven shards of queries and documents, each shard at
its own padded lengths; every rank's loss, its queries' and documents' gradients and its scale's gradient against
the float64 truth of the whole set (tests/workers/maxsim_ring_worker.py)."""

import pytest
import torch

from helpers.distributed import launch, results_by_ring
from helpers.maxsim_truth import maxsim_loss
from workers.maxsim_ring_worker import (
    CASES,
    LENGTHS,
    MAIN_WORLD,
    NATIVE_REASON,
    RINGS,
    SCALE,
    SHARDS,
    global_inputs,
    st_inputs,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1e-2}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    outcomes = launch(
        MAIN_WORLD, "workers.maxsim_ring_worker", str(tmp_path_factory.mktemp("maxsim")), deadline_s=240.0
    )
    return results_by_ring(outcomes, RINGS)


def _truth(case, world):
    """Per rank: (loss, dq, dd, dscale) of the truth, where every rank's loss is the mean over its own queries."""
    q, docs, q_mask, docs_mask, labels, q_ids, k_ids = global_inputs(case)
    rows, cols = SHARDS[world]
    qq = q.double().requires_grad_()
    dd = docs.double().requires_grad_()
    scales = [torch.tensor(SCALE, dtype=torch.float64, requires_grad=True) for _ in range(world)]
    losses, start = [], 0
    for rank, n in enumerate(rows):
        part = slice(start, start + n)
        start += n
        per_row = maxsim_loss(
            qq, dd, labels, scales[rank], q_mask, docs_mask, case.length_normalize, q_ids, k_ids, reduction="none"
        )
        losses.append(per_row[part].mean())
    sum(losses).backward()
    out, q_start, d_start = [], 0, 0
    lq, lk = LENGTHS[world]
    for rank in range(world):
        q_part, d_part = slice(q_start, q_start + rows[rank]), slice(d_start, d_start + cols[rank])
        q_start, d_start = q_start + rows[rank], d_start + cols[rank]
        out.append((losses[rank].detach(), qq.grad[q_part, : lq[rank]], dd.grad[d_part, : lk[rank]], scales[rank].grad))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_world_size_matches_the_whole_set(spawned, case):
    if case.backend == "cpu" and NATIVE_REASON is not None:
        pytest.skip(f"native kernel unavailable: {NATIVE_REASON}")
    tol = TOLERANCE[case.dtype]
    for world in sorted(RINGS):
        for rank, (results, want) in enumerate(zip(spawned(world), _truth(case, world))):
            got = results[case.name]
            for name, value in zip(("loss", "dq", "dd", "dscale"), want):
                ours = got[name].double()
                assert ours.shape == value.shape, f"world {world} rank {rank} {name}"
                bound = tol * max(1.0, value.abs().max().item())
                err = (ours - value).abs().max().item()
                assert err <= bound, f"world {world} rank {rank} {name}: {err:.3g} > {bound:.3g}"


def test_st_gather_across_devices_labels_every_rank(spawned):
    """The multi-vector drop-in's ``gather_across_devices=True`` over the ring: each rank's queries against every
    rank's documents (query-major, two columns), labels offset by the documents of the lower ranks (uneven shards)."""
    q, columns, q_mask, masks = st_inputs()
    for world in sorted(RINGS):
        rows = SHARDS[world][0]
        qq = q.clone().requires_grad_()
        cols = [c.clone().requires_grad_() for c in columns]
        # Every rank's documents in rank order, each rank's own query-major: [d0_pos, d0_neg, d1_pos, ...].
        docs = torch.stack(cols, dim=1).flatten(0, 1)
        docs_mask = torch.stack(masks, dim=1).flatten(0, 1)
        losses, start = [], 0
        for n in rows:
            part = slice(start, start + n)
            labels = 2 * torch.arange(start, start + n)
            per_row = maxsim_loss(qq[part], docs, labels, SCALE, q_mask[part], docs_mask, reduction="none")
            losses.append(per_row.mean())
            start += n
        sum(losses).backward()
        start = 0
        for rank, (results, want) in enumerate(zip(spawned(world), losses)):
            got = results["st-gather"]
            part = slice(start, start + rows[rank])
            start += rows[rank]
            pairs = [("loss", got["loss"], want.detach()), ("dq", got["dq"], qq.grad[part])]
            pairs += [(f"dcol{c}", got["dcols"][c], cols[c].grad[part]) for c in range(2)]
            for name, ours, value in pairs:
                err = (ours.double() - value).abs().max().item()
                assert err <= 1e-10 * max(1.0, value.abs().max().item()), f"world {world} rank {rank} {name}: {err:.3g}"
