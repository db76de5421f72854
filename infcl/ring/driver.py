"""The one ring loop: every backend, every world size (a single process is the ring of one rank).

Rank r holds its q rows for the whole call; the k blocks travel to rank+1 at every step, so at step t
rank r holds the block of rank (r - t) mod W. For each block the driver asks the backend for the
block's log-sum-exps (forward) or gradient contributions (backward), and handles the positive logits
itself (they are O(B * D) row dot products, the same for every backend).

Overlap: the exchange of the next k block is posted before the compute on the current one (double
buffering). Whatever must be *accumulated* by every rank for a block (its column log-sum-exps and
positive logits in the forward, its dk and column scale-gradient in the backward) travels one step
behind the block, on a second stream: each rank merges its part after its compute, passes it on, and
after W steps the sum arrives back at the block's owner.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..backends.base import BlockBackend, Tensor, accum_dtype
from ..lse import empty_lse, lse_merge
from .comm import RingComm
from .layout import RingLayout


@dataclass
class ForwardResult:
    row_lse: Tensor  # [Bq] log-sum-exp of each local row over all global columns
    row_pos: Tensor  # [Bq] positive logit of each local row
    col_lse: Optional[Tensor]  # [Bk] log-sum-exp of each local column over all global rows (symmetric)
    col_pos: Optional[Tensor]  # [Bk] positive logit of each local column (symmetric)


def _positive_pairs(labels: Tensor, offset: int, size: int) -> Tuple[Tensor, Tensor]:
    """Local rows whose positive column lies in the block [offset, offset + size), and that column."""
    rows = ((labels >= offset) & (labels < offset + size)).nonzero().squeeze(1)
    return rows, labels[rows] - offset


# The positive pairs are gathered POSITIVE_CHUNK rows at a time, so their temporaries stay a few MiB
# (1024 x D) instead of several [B, D] copies.
POSITIVE_CHUNK = 1024


def _rowdot(q: Tensor, rows: Tensor, k: Tensor, cols: Tensor, acc: torch.dtype) -> Tensor:
    """raw[p] = q[rows[p]] . k[cols[p]] in the accumulation dtype, chunk by chunk."""
    out = torch.empty(rows.shape[0], dtype=acc, device=q.device)
    for start in range(0, rows.shape[0], POSITIVE_CHUNK):
        r, c = rows[start : start + POSITIVE_CHUNK], cols[start : start + POSITIVE_CHUNK]
        out[start : start + r.shape[0]] = torch.linalg.vecdot(q[r].to(acc), k[c].to(acc))
    return out


def _add_positive_grads(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, rows: Tensor, cols: Tensor, coef: Tensor) -> None:
    """dq[rows] += coef * k[cols] and dk[cols] += coef * q[rows] (repeated cols add up), chunk by chunk."""
    acc = dq.dtype
    for start in range(0, rows.shape[0], POSITIVE_CHUNK):
        r, c = rows[start : start + POSITIVE_CHUNK], cols[start : start + POSITIVE_CHUNK]
        w = coef[start : start + r.shape[0], None]
        dq.index_add_(0, r, k[c].to(acc) * w)
        dk.index_add_(0, c, q[r].to(acc) * w)


class _Leading:
    """Read-only block tensors that travel ahead of the compute, double buffered.

    :meth:`post` sends what this rank holds to rank + 1 and posts the receive of the next step's
    block *before* the compute on the current one; :meth:`advance` waits and swaps the buffers.
    """

    def __init__(self, layout: RingLayout, comm: Optional[RingComm], phase: str, tensors, shapes_of):
        self.layout, self.comm, self.phase, self.shapes_of = layout, comm, phase, shapes_of
        self.current = [t if comm is None else t.contiguous() for t in tensors]
        self.next = None

    def post(self, step: int) -> None:
        if step + 1 >= self.layout.world:
            return
        size = self.layout.k_sizes[self.layout.block_at_step(step + 1)]
        self.next = [t.new_empty(shape) for t, shape in zip(self.current, self.shapes_of(size))]
        for mine, incoming in zip(self.current, self.next):
            self.comm.send_recv(mine, incoming)
        self.comm.commit(f"{self.phase} step {step} (k block of rank {self.layout.block_at_step(step)})")

    def advance(self, step: int) -> None:
        if step + 1 < self.layout.world:
            self.comm.wait()
            self.current = self.next


class _Trailing:
    """Per-block partial sums that travel one step behind their block, on their own stream.

    At every step each rank merges its part for the block it holds into what arrived from rank - 1,
    and passes the sum on to rank + 1 while it computes the next block. After W steps the total for a
    block is back at its owner: :meth:`home`.
    """

    def __init__(self, layout: RingLayout, comm: Optional[RingComm], shape_of, merge, phase: str, kind: str):
        self.layout, self.comm, self.shape_of, self.merge = layout, comm, shape_of, merge
        self.phase, self.kind = phase, kind  # for error messages: "backward step 1 (dk of rank 2)"
        self.incoming: Optional[Tensor] = None

    def pass_on(self, step: int, mine: Tensor) -> None:
        if step > 0:
            self.comm.wait()
            self.merge(mine, self.incoming)
        if self.comm is None:
            self.incoming = mine
            return
        # After the last step the partials go home: rank + 1 owns the block held last.
        self.incoming = mine.new_empty(self.shape_of(self.layout.k_sizes[self.layout.block_at_step(step + 1)]))
        self.comm.send_recv(mine, self.incoming)
        self.comm.commit(f"{self.phase} step {step} ({self.kind} of rank {self.layout.block_at_step(step)})")

    def home(self) -> Tensor:
        if self.comm is not None:
            self.comm.wait()
        return self.incoming


def _merge_columns(mine: Tensor, incoming: Tensor) -> None:
    lse_merge(mine[0], incoming[0])
    mine[1] += incoming[1]


def _comms(layout: RingLayout, *names: str):
    if layout.world == 1:
        return (None,) * len(names)
    return tuple(RingComm(layout.group, name) for name in names)


def ring_forward(
    q: Tensor, k: Tensor, scale: float, labels: Tensor, symmetric: bool, backend: BlockBackend, layout: RingLayout
) -> ForwardResult:
    acc = accum_dtype(q.dtype)
    dev, dim = q.device, q.shape[1]
    row_lse = empty_lse(q.shape[0], acc, dev)
    row_pos = torch.zeros(q.shape[0], dtype=acc, device=dev)
    k_comm, col_comm = _comms(layout, "k-forward", "column-lse")
    blocks = _Leading(layout, k_comm, "forward", [k], lambda n: [(n, dim)])
    # Column partials [2, n] (log-sum-exp, positive logit) of each block.
    columns = _Trailing(layout, col_comm, lambda n: (2, n), _merge_columns, "forward", "column log-sum-exp")
    for step in range(layout.world):
        src = layout.block_at_step(step)
        offset, size = layout.k_offsets[src], layout.k_sizes[src]
        blocks.post(step)
        (k_cur,) = blocks.current

        r_lse, c_lse = backend.forward_block(q, k_cur, scale, symmetric)
        lse_merge(row_lse, r_lse)
        rows, cols = _positive_pairs(labels, offset, size)
        pos = scale * _rowdot(q, rows, k_cur, cols, acc)
        row_pos[rows] = pos

        if symmetric:
            col = torch.empty(2, size, dtype=acc, device=dev)
            col[0] = c_lse
            col[1] = 0
            col[1, cols] = pos  # labels are a permutation: each column's positive is set on one rank
            columns.pass_on(step, col)
        blocks.advance(step)
    col_in = columns.home() if symmetric else None
    return ForwardResult(
        row_lse=row_lse,
        row_pos=row_pos,
        col_lse=col_in[0] if symmetric else None,
        col_pos=col_in[1] if symmetric else None,
    )


def ring_backward(
    q: Tensor,
    k: Tensor,
    scale: float,
    labels: Tensor,
    backend: BlockBackend,
    layout: RingLayout,
    row_lse: Tensor,
    g_row: Tensor,
    col_lse: Optional[Tensor],
    g_col: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Return (dq, dk, dscale) in the accumulation dtype.

    dq and dk hold the gradient of every rank's loss with respect to this rank's q and k; dscale is
    the derivative of this rank's own loss (rows, and for the symmetric loss, columns) with respect
    to the scale.
    """
    acc = accum_dtype(q.dtype)
    dev, dim = q.device, q.shape[1]
    symmetric = col_lse is not None
    dq = torch.zeros(q.shape[0], dim, dtype=acc, device=dev)
    dscale_row = torch.zeros((), dtype=acc, device=dev)
    k_comm, acc_comm = _comms(layout, "k-backward", "dk")
    # What each block carries ahead, read-only: k and, for the symmetric loss, its column (lse, upstream grad).
    ahead = [k, torch.stack([col_lse, g_col])] if symmetric else [k]
    blocks = _Leading(layout, k_comm, "backward", ahead, lambda n: [(n, dim), (2, n)][: len(ahead)])
    # [size * D + 1] per block: its dk partial sum and its column scale-gradient.
    grads = _Trailing(layout, acc_comm, lambda n: (n * dim + 1,), Tensor.add_, "backward", "dk")
    for step in range(layout.world):
        src = layout.block_at_step(step)
        offset, size = layout.k_offsets[src], layout.k_sizes[src]
        blocks.post(step)
        k_cur = blocks.current[0]
        col_cur = blocks.current[1] if symmetric else None

        packed = torch.zeros(size * dim + 1, dtype=acc, device=dev)
        dk_part = packed[:-1].view(size, dim)
        col_lse_cur = col_cur[0] if symmetric else None
        g_col_cur = col_cur[1] if symmetric else None
        ds_row, ds_col = backend.backward_block(q, k_cur, scale, row_lse, g_row, col_lse_cur, g_col_cur, dq, dk_part)

        # The positive logit S[i, c] enters the loss with coefficient -(g_row[i] + g_col[c]).
        rows, cols = _positive_pairs(labels, offset, size)
        raw = _rowdot(q, rows, k_cur, cols, acc)
        coef_row = g_row[rows]
        coef = coef_row + g_col_cur[cols] if symmetric else coef_row
        _add_positive_grads(dq, dk_part, q, k_cur, rows, cols, -scale * coef)
        dscale_row += ds_row - torch.dot(coef_row, raw)
        packed[-1] = ds_col - (torch.dot(g_col_cur[cols], raw) if symmetric else 0)

        grads.pass_on(step, packed)
        blocks.advance(step)
    own = grads.home()
    return dq, own[:-1].view(k.shape[0], dim), dscale_row + own[-1]
