"""The one ring loop: every backend, every loss, every world size (a single process is the ring of one).

Rank r holds its q rows for the whole call; the k blocks travel to rank+1 at every step, so at step t
rank r holds the block of rank (r - t) mod W. For each block the driver builds the positives' block
columns from the labels and hands the block to the loss's per-block step (a :class:`RingLoss`), which
calls the backend; the driver itself does no arithmetic on features.

Overlap: the exchange of the next k block is posted before the compute on the current one (double
buffering). Whatever must be *accumulated* by every rank for a block (its column partials in the
forward, its dk and column-credited parameter gradients in the backward) travels one step behind the
block, on a second stream: each rank merges its part after its compute, passes it on, and after W
steps the sum arrives back at the block's owner.

No host synchronization happens inside the loop on CUDA: the scale is a device tensor and the
positives are found with ``torch.where``, never ``nonzero`` or ``.item()``.
"""

from typing import Optional, Protocol, Tuple

import torch

from ..backends.base import BlockBackend, Tensor, accum_dtype
from .comm import RingComm
from .layout import RingLayout


class RingLoss(Protocol):
    """What one loss contributes to the ring loop (softmax: :mod:`infcl.losses.softmax`).

    Forward: a ``[R, Bq]`` row accumulator merged block by block, and optionally a ``[C, Bk]`` column
    partial per block (``col_rows = C``, 0 for none) that travels home to the block's owner.
    Backward: ``ahead`` (``[A, Bk]`` per block, e.g. column stats and upstream gradients) travels with
    k; each block returns ``[2, n_params]`` parameter gradients: row 0 for this rank's own loss, row 1
    credited to the block's owner (it travels home with dk).
    Both passes: ``k_side`` are this rank's tensors with one row per k row (ids, guide features, column
    thresholds; empty for the plain losses) that travel with k, in the same exchange; each step gets the
    held block's as ``k_side``.
    """

    col_rows: int
    n_params: int
    k_side: Tuple[Tensor, ...]

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Tensor: ...

    def merge_rows(self, acc: Tensor, part: Tensor) -> None: ...

    def merge_cols(self, acc: Tensor, part: Tensor) -> None: ...

    def forward_step(self, backend: BlockBackend, q: Tensor, k: Tensor, scale: Tensor, pos: Tensor, k_side=()): ...

    def backward_step(
        self,
        backend: BlockBackend,
        q: Tensor,
        k: Tensor,
        scale: Tensor,
        pos: Tensor,
        rows: Tensor,
        ahead: Optional[Tensor],
        dq: Tensor,
        dk: Tensor,
        k_side=(),
    ) -> Tensor: ...


def _row_shapes(tensors, n: int) -> list:
    """The shapes of ``tensors`` (rows on dim 0) for a block of ``n`` rows."""
    return [(n, *t.shape[1:]) for t in tensors]


def block_positions(labels: Tensor, offset: int, size: int) -> Tensor:
    """[Bq] int64: the column within the block [offset, offset + size) of each row's positive, else -1."""
    inside = (labels >= offset) & (labels < offset + size)
    return torch.where(inside, labels - offset, -1)


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


def _comms(layout: RingLayout, *names: str):
    if layout.world == 1:
        return (None,) * len(names)
    return tuple(RingComm(layout.group, name) for name in names)


def _block_span(layout: RingLayout, step: int) -> Tuple[int, int]:
    src = layout.block_at_step(step)
    return layout.k_offsets[src], layout.k_sizes[src]


def ring_forward(
    q: Tensor, k: Tensor, scale: Tensor, labels: Tensor, loss: RingLoss, backend: BlockBackend, layout: RingLayout
) -> Tuple[Tensor, Optional[Tensor]]:
    """Return (rows [R, Bq], cols [C, Bk] or None): this rank's row accumulator over the global
    columns and, if the loss has column partials, its own k rows' totals over every rank's rows."""
    acc = accum_dtype(q.dtype)
    dev, dim = q.device, q.shape[1]
    rows = loss.init_rows(q.shape[0], acc, dev)
    k_comm, col_comm = _comms(layout, "k-forward", "columns")
    k_side = tuple(loss.k_side)
    blocks = _Leading(layout, k_comm, "forward", [k, *k_side], lambda n: [(n, dim)] + _row_shapes(k_side, n))
    columns = None
    if loss.col_rows:
        columns = _Trailing(
            layout, col_comm, lambda n: (loss.col_rows, n), loss.merge_cols, "forward", "column partials"
        )
    for step in range(layout.world):
        offset, size = _block_span(layout, step)
        blocks.post(step)
        k_cur, *side_cur = blocks.current
        pos = block_positions(labels, offset, size)
        row_part, col_part = loss.forward_step(backend, q, k_cur, scale, pos, tuple(side_cur))
        loss.merge_rows(rows, row_part)
        if columns is not None:
            columns.pass_on(step, col_part)
        blocks.advance(step)
    return rows, (columns.home() if columns is not None else None)


def ring_backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    labels: Tensor,
    loss: RingLoss,
    backend: BlockBackend,
    layout: RingLayout,
    rows: Tensor,
    ahead: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Return (dq, dk, dparams [n_params]) in the accumulation dtype.

    ``rows`` [*, Bq] is what the loss's backward step needs per local row (stats, upstream gradient);
    ``ahead`` [A, Bk] (or None) per local k row, sent around with k. dq and dk hold the gradient of
    every rank's loss with respect to this rank's q and k; dparams is the derivative of this rank's own
    loss (rows, plus the column-credited parts of its own k block) with respect to the loss parameters.
    """
    acc = accum_dtype(q.dtype)
    dev, dim = q.device, q.shape[1]
    n_params = loss.n_params
    dq = torch.zeros(q.shape[0], dim, dtype=acc, device=dev)
    own = torch.zeros(n_params, dtype=acc, device=dev)
    k_comm, acc_comm = _comms(layout, "k-backward", "dk")
    k_side = tuple(loss.k_side)
    travelling = ([k] if ahead is None else [k, ahead]) + list(k_side)
    shapes = lambda n: [(n, dim)] + ([] if ahead is None else [(ahead.shape[0], n)]) + _row_shapes(k_side, n)  # noqa: E731
    blocks = _Leading(layout, k_comm, "backward", travelling, shapes)
    n_lead = len(travelling) - len(k_side)
    # [size * D + n_params] per block: its dk partial sum and its column-credited parameter gradients.
    grads = _Trailing(layout, acc_comm, lambda n: (n * dim + n_params,), Tensor.add_, "backward", "dk")
    for step in range(layout.world):
        offset, size = _block_span(layout, step)
        blocks.post(step)
        k_cur, side_cur = blocks.current[0], tuple(blocks.current[n_lead:])
        ahead_cur = blocks.current[1] if ahead is not None else None
        packed = torch.zeros(size * dim + n_params, dtype=acc, device=dev)
        dk_part = packed[:-n_params].view(size, dim)
        pos = block_positions(labels, offset, size)
        dparams = loss.backward_step(backend, q, k_cur, scale, pos, rows, ahead_cur, dq, dk_part, side_cur)
        own += dparams[0]
        packed[-n_params:] = dparams[1]
        grads.pass_on(step, packed)
        blocks.advance(step)
    home = grads.home()
    return dq, home[:-n_params].view(k.shape[0], dim), own + home[-n_params:]
