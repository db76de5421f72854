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

from typing import Callable, NamedTuple, Optional, Protocol, Tuple

import torch

from ..contract import Block, BlockBackend, Tensor, accum_dtype
from .comm import RingComm
from .layout import RingLayout

# A loss's per-row (or per-column) partials or backward inputs: a NamedTuple of tensors, one field per
# meaning, each with its rows (columns) on the last dim (e.g. stats [2, n], upstream gradient [n]). The
# driver moves and merges them field by field; it never looks inside.
Parts = Tuple[Tensor, ...]


class ParamGrads(NamedTuple):
    """A block's loss-parameter gradients ``[n_params]`` each: ``own`` from this rank's rows (its own
    loss), ``owner`` credited to the block's owner (it travels home with dk)."""

    own: Tensor
    owner: Tensor


class RingLoss(Protocol):
    """What one loss contributes to the ring loop (softmax: :mod:`infcl.losses.softmax`).

    Forward: a row accumulator (:data:`Parts`, from ``init_rows``) merged block by block and, when
    ``symmetric``, column partials per block (the same kind of :data:`Parts`) that travel home to the
    block's owner, merged on the way by the same ``merge``.
    Backward: ``rows`` (:data:`Parts` per local row: stats, upstream gradients) stay; when ``symmetric``,
    ``cols`` (per local k row) travel with k; each block returns its :class:`ParamGrads`.
    Both passes: each step gets the held block as a :class:`Block` with q, k, scale and pos set (the loss
    adds its own fields with ``dataclasses.replace``), and ``k_side``: the held block's rows of this loss's
    tensors with one row per k row (ids, guide features, column thresholds; empty for the plain losses),
    which travel with k in the same exchange.
    """

    symmetric: bool
    n_params: int
    k_side: Tuple[Tensor, ...]

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Parts: ...

    def merge(self, acc: Parts, part: Parts) -> None: ...

    def forward_step(self, backend: BlockBackend, block: Block, k_side=()) -> Tuple[Parts, Optional[Parts]]: ...

    def backward_step(
        self, backend: BlockBackend, block: Block, rows: Parts, cols: Optional[Parts], dq: Tensor, dk: Tensor, k_side=()
    ) -> ParamGrads: ...


def add_parts(acc: Parts, part: Parts) -> None:
    """Add ``part`` into ``acc`` field by field, in place: the merge of partials that are plain sums."""
    for total, term in zip(acc, part):
        total.add_(term)


class SummedParts:
    """A base for a :class:`RingLoss` whose partials are plain sums of one NamedTuple type (``parts``, its
    fields ``[n]`` each): zeros to start, merged by :func:`add_parts`."""

    parts: type

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Parts:
        return self.parts(*(torch.zeros(n, dtype=dtype, device=device) for _ in self.parts._fields))

    merge = staticmethod(add_parts)


class MergedParts:
    """A base for a :class:`RingLoss` whose partials type (``parts``) makes its own empty partials
    (``parts.empty(n, dtype, device)``) and merges another into itself (``acc.merge_(part)``)."""

    parts: type

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> Parts:
        return self.parts.empty(n, dtype, device)

    @staticmethod
    def merge(acc: Parts, part: Parts) -> None:
        acc.merge_(part)


def _resized(parts: Parts, n: int) -> Parts:
    """Uninitialized :data:`Parts` like ``parts`` for ``n`` rows (their last dim)."""
    return type(parts)(*(t.new_empty(*t.shape[:-1], n) for t in parts))


def _contiguous(parts: Parts) -> Parts:
    """P2P buffers must be contiguous (a no-op for the parts that are)."""
    return type(parts)(*(t.contiguous() for t in parts))


def block_positions(labels: Tensor, offset: int, size: int) -> Tensor:
    """[Bq] int64: the column within the block [offset, offset + size) of each row's positive, else -1."""
    inside = (labels >= offset) & (labels < offset + size)
    return torch.where(inside, labels - offset, -1)


class _KBlock(NamedTuple):
    """What travels with a k block: k [n, D], the loss's per-column backward inputs (``cols``, or None)
    and its ``k_side`` tensors (rows first)."""

    k: Tensor
    cols: Optional[Parts]
    side: Tuple[Tensor, ...]

    def tensors(self) -> list:
        return [self.k, *(() if self.cols is None else self.cols), *self.side]

    def resized(self, n: int) -> "_KBlock":
        """Uninitialized buffers for a block of ``n`` k rows."""
        cols = None if self.cols is None else _resized(self.cols, n)
        side = tuple(t.new_empty(n, *t.shape[1:]) for t in self.side)
        return _KBlock(self.k.new_empty(n, *self.k.shape[1:]), cols, side)


class _KBlockRelay:
    """Read-only block tensors that travel ahead of the compute, double buffered.

    :meth:`post` sends what this rank holds to rank + 1 and posts the receive of the next step's
    block *before* the compute on the current one; :meth:`advance` waits and swaps the buffers.
    """

    def __init__(self, layout: RingLayout, comm: Optional[RingComm], phase: str, block: _KBlock):
        self.layout, self.comm, self.phase = layout, comm, phase
        if comm is not None:
            cols = None if block.cols is None else _contiguous(block.cols)
            block = _KBlock(block.k.contiguous(), cols, tuple(t.contiguous() for t in block.side))
        self.current: _KBlock = block
        self.next: Optional[_KBlock] = None

    def post(self, step: int) -> None:
        if step + 1 >= self.layout.world:
            return
        self.next = self.current.resized(self.layout.k_sizes[self.layout.block_at_step(step + 1)])
        for mine, incoming in zip(self.current.tensors(), self.next.tensors()):
            self.comm.send_recv(mine, incoming)
        self.comm.commit(f"{self.phase} step {step} (k block of rank {self.layout.block_at_step(step)})")

    def advance(self, step: int) -> None:
        if step + 1 < self.layout.world:
            self.comm.wait()
            self.current = self.next


class _PartialSumRelay:
    """Per-block partial sums that travel one step behind their block, on their own stream.

    At every step each rank merges its part for the block it holds into what arrived from rank - 1,
    and passes the sum on to rank + 1 while it computes the next block. After W steps the total for a
    block is back at its owner: :meth:`home`. A part is a NamedTuple of tensors, sent field by field;
    ``resized(part, n)`` makes the receive buffers for a block of n k rows.
    """

    def __init__(self, layout: RingLayout, comm: Optional[RingComm], resized: Callable, merge, phase: str, kind: str):
        self.layout, self.comm, self.resized, self.merge = layout, comm, resized, merge
        self.phase, self.kind = phase, kind  # for error messages: "backward step 1 (dk of rank 2)"
        self.incoming = None

    def pass_on(self, step: int, mine) -> None:
        if step > 0:
            self.comm.wait()
            self.merge(mine, self.incoming)
        if self.comm is None:
            self.incoming = mine
            return
        mine = _contiguous(mine)
        # After the last step the partials go home: rank + 1 owns the block held last.
        self.incoming = self.resized(mine, self.layout.k_sizes[self.layout.block_at_step(step + 1)])
        for sent, received in zip(mine, self.incoming):
            self.comm.send_recv(sent, received)
        self.comm.commit(f"{self.phase} step {step} ({self.kind} of rank {self.layout.block_at_step(step)})")

    def home(self):
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
) -> Tuple[Parts, Optional[Parts]]:
    """Return (rows, cols or None), the loss's :data:`Parts`: this rank's row accumulator over the global
    columns and, for a symmetric loss, its own k rows' totals over every rank's rows."""
    rows = loss.init_rows(q.shape[0], accum_dtype(q.dtype), q.device)
    k_comm, col_comm = _comms(layout, "k-forward", "columns")
    blocks = _KBlockRelay(layout, k_comm, "forward", _KBlock(k, None, tuple(loss.k_side)))
    columns = None
    if loss.symmetric:
        columns = _PartialSumRelay(layout, col_comm, _resized, loss.merge, "forward", "column partials")
    for step in range(layout.world):
        offset, size = _block_span(layout, step)
        blocks.post(step)
        block = Block(q=q, k=blocks.current.k, scale=scale, pos=block_positions(labels, offset, size))
        row_part, col_part = loss.forward_step(backend, block, blocks.current.side)
        loss.merge(rows, row_part)
        if columns is not None:
            columns.pass_on(step, col_part)
        blocks.advance(step)
    return rows, (columns.home() if columns is not None else None)


class _BlockGrads(NamedTuple):
    """What the backward accumulates for a block over every rank: its dk [n, D] (MaxSim: [n, Lk, D]) and its
    column-credited parameter gradients [n_params]."""

    dk: Tensor
    params: Tensor


def _resized_grads(grads: _BlockGrads, n: int) -> _BlockGrads:
    return _BlockGrads(grads.dk.new_empty(n, *grads.dk.shape[1:]), torch.empty_like(grads.params))


def ring_backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    labels: Tensor,
    loss: RingLoss,
    backend: BlockBackend,
    layout: RingLayout,
    rows: Parts,
    cols: Optional[Parts],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Return (dq, dk, dparams [n_params]) in the accumulation dtype.

    ``rows`` (:data:`Parts`) is what the loss's backward step needs per local row (stats, upstream
    gradient); ``cols`` (or None) the same per local k row, sent around with k. dq and dk hold the gradient
    of every rank's loss with respect to this rank's q and k; dparams is the derivative of this rank's own
    loss (rows, plus the column-credited parts of its own k block) with respect to the loss parameters.
    """
    acc = accum_dtype(q.dtype)
    dev = q.device
    dq = torch.zeros(q.shape, dtype=acc, device=dev)  # [Bq, D], or [Bq, Lq, D] token embeddings (MaxSim)
    own = torch.zeros(loss.n_params, dtype=acc, device=dev)
    k_comm, acc_comm = _comms(layout, "k-backward", "dk")
    blocks = _KBlockRelay(layout, k_comm, "backward", _KBlock(k, cols, tuple(loss.k_side)))
    grads = _PartialSumRelay(layout, acc_comm, _resized_grads, add_parts, "backward", "dk")
    for step in range(layout.world):
        offset, size = _block_span(layout, step)
        blocks.post(step)
        held = blocks.current
        dk_part = torch.zeros(size, *held.k.shape[1:], dtype=acc, device=dev)
        block = Block(q=q, k=held.k, scale=scale, pos=block_positions(labels, offset, size))
        dparams = loss.backward_step(backend, block, rows, held.cols, dq, dk_part, held.side)
        own += dparams.own
        grads.pass_on(step, _BlockGrads(dk_part, dparams.owner))
        blocks.advance(step)
    home = grads.home()
    return dq, home.dk, own + home.params
