"""The custom ops of retrieval_metrics and cal_distill_loss pass torch.library.opcheck (schema, fake impl,
mutation declarations, FakeTensor and AOT tracing) at small shapes: the native kernel's rank ops, and the
Triton kernels' rank and distillation ops (the interpreter without a GPU). The native distillation ops'
opcheck: tests/test_distill_backends.py."""

import pytest
import torch

from infcl.backends import unavailable_reason

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NATIVE = unavailable_reason("cpu", torch.device("cpu")) is None
TRITON = unavailable_reason("triton", DEVICE) is None
BQ, BK, DIM, TEACHER_DIM = 12, 14, 5, 3  # more columns than rows: the columns' outputs have their own size


def _rank_inputs(with_ids: bool, device: torch.device):
    """(q, k, pos, row_index, col_index, q_ids, k_ids) on ``device``: every row's positive among the columns, a
    block whose global columns start at 40."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(BQ, DIM, generator=gen), torch.randn(BK, DIM, generator=gen)
    pos, row_index, col_index = torch.arange(BQ), torch.arange(BQ), torch.arange(40, 40 + BK)
    ids = (torch.randint(0, 4, (BQ,), generator=gen), torch.randint(0, 4, (BK,), generator=gen))
    tensors = (q, k, pos, row_index, col_index, *(ids if with_ids else (None, None)))
    return tuple(None if t is None else t.to(device) for t in tensors)


def _check_rank_ops(best_op, ahead_op, extra, symmetric, with_ids, device):
    """opcheck both passes; pass 2 takes pass 1's own thresholds. ``extra``: the arguments after the ids."""
    q, k, pos, row_index, col_index, q_ids, k_ids = _rank_inputs(with_ids, device)
    best_args = (q, k, pos, row_index, col_index, symmetric, q_ids, k_ids, *extra)
    torch.library.opcheck(best_op, best_args)
    row_score, row_best, _, col_score, col_best, _ = best_op(*best_args)
    cols = (col_score, col_best) if symmetric else (None, None)
    torch.library.opcheck(ahead_op, (q, k, row_score, row_best, *cols, row_index, col_index, q_ids, k_ids, *extra))


@pytest.mark.skipif(not NATIVE, reason="the native kernel is not built here")
@pytest.mark.parametrize("symmetric,with_ids", [(True, False), (False, True)])
def test_native_rank_ops_pass_opcheck(symmetric, with_ids):
    from infcl.backends.native.build import torch_ops

    ops = torch_ops()
    best, ahead = ops.rank_best_positives.default, ops.rank_ahead_counts.default
    _check_rank_ops(best, ahead, (), symmetric, with_ids, torch.device("cpu"))


@pytest.mark.interpreter
@pytest.mark.skipif(not TRITON, reason="the Triton backend does not run here")
@pytest.mark.parametrize("symmetric,with_ids", [(True, False), (False, True)])
def test_triton_rank_ops_pass_opcheck(symmetric, with_ids):
    import infcl.kernels.rank  # noqa: F401  (registers the ops)

    ops = torch.ops.infcl
    best, ahead = ops.triton_rank_best_positives.default, ops.triton_rank_ahead_counts.default
    _check_rank_ops(best, ahead, ("ieee",), symmetric, with_ids, DEVICE)


@pytest.mark.interpreter
@pytest.mark.skipif(not TRITON, reason="the Triton backend does not run here")
@pytest.mark.parametrize("symmetric", [True, False])
def test_triton_distill_ops_pass_opcheck(symmetric):
    """Forward, then the backward on the forward's own stats (standing in for the global ones): dq and dk
    mutated in place, dscale returned."""
    import infcl.kernels.distill  # noqa: F401  (registers the ops)

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(BQ, DIM, generator=gen), torch.randn(BK, DIM, generator=gen)
    tq, tk = torch.randn(BQ, TEACHER_DIM, generator=gen), torch.randn(BK, TEACHER_DIM, generator=gen)
    q, k, tq, tk = (x.to(DEVICE) for x in (q, k, tq, tk))
    scale, teacher_scale = torch.tensor(3.0, device=DEVICE), torch.tensor(4.0, device=DEVICE)
    ops = torch.ops.infcl
    forward = (q, k, scale, tq, tk, teacher_scale, symmetric, "ieee")
    torch.library.opcheck(ops.triton_distill_forward_block.default, forward)
    rows, cols = ops.triton_distill_forward_block(*forward)
    g_row, g_col = torch.full((BQ,), 1 / BQ, device=DEVICE), torch.full((BK,), 1 / BK, device=DEVICE)
    col_args = (cols[:4], g_col) if symmetric else (None, None)
    grads = (torch.zeros(BQ, DIM, device=DEVICE), torch.zeros(BK, DIM, device=DEVICE))
    backward = (q, k, scale, tq, tk, teacher_scale, rows[:4], g_row, *col_args, *grads, "ieee")
    torch.library.opcheck(ops.triton_distill_backward_block.default, backward)
