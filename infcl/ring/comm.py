"""Ring communicator: send to rank+1, receive from rank-1, over ``torch.distributed`` P2P.

Kept apart from the math. One :class:`RingComm` carries one stream of blocks with at most one batch in
flight: queue sends and receives with :meth:`send_recv`, launch them with :meth:`commit` (one
``dist.batch_isend_irecv``), and :meth:`wait` before touching the buffers. Misuse (committing nothing,
committing twice, waiting with nothing in flight) raises. A peer that died or hangs surfaces as a
``RuntimeError`` naming the ring step, raised once the process group's timeout expires.
"""

from typing import List, Optional

import torch
import torch.distributed as dist


class RingError(RuntimeError):
    """A ring exchange failed (a peer died, hung past the group's timeout, or the transport broke)."""


class RingComm:
    def __init__(self, group, name: str):
        self.group = group
        self.name = name
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # P2P ops take global ranks.
        self.send_rank = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.recv_rank = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self._ops: List[dist.P2POp] = []
        self._reqs: Optional[list] = None
        self._what = ""

    @property
    def in_flight(self) -> bool:
        return self._reqs is not None

    def send_recv(self, to_send: torch.Tensor, recv_into: torch.Tensor) -> torch.Tensor:
        """Queue sending ``to_send`` to rank+1 and receiving into ``recv_into`` from rank-1."""
        if self._reqs is not None:
            raise RuntimeError(f"ring {self.name}: send_recv while a batch is in flight; wait() first")
        if not to_send.is_contiguous() or not recv_into.is_contiguous():
            raise RuntimeError(f"ring {self.name}: P2P buffers must be contiguous")
        self._ops.append(dist.P2POp(dist.isend, to_send, self.send_rank, self.group))
        self._ops.append(dist.P2POp(dist.irecv, recv_into, self.recv_rank, self.group))
        return recv_into

    def commit(self, what: str) -> None:
        """Launch every queued op as one batch; ``what`` names the step in error messages."""
        if not self._ops:
            raise RuntimeError(f"ring {self.name}: commit() with nothing queued")
        if self._reqs is not None:
            raise RuntimeError(f"ring {self.name}: commit() while a batch is in flight")
        self._what = what
        try:
            self._reqs = dist.batch_isend_irecv(self._ops)
        except RuntimeError as err:
            raise RingError(self._describe(err)) from err
        finally:
            self._ops = []

    def wait(self) -> None:
        """Block until the batch in flight completes; raise :class:`RingError` naming the step if it fails."""
        if self._reqs is None:
            raise RuntimeError(f"ring {self.name}: wait() with nothing in flight")
        reqs, self._reqs = self._reqs, None
        try:
            for req in reqs:
                req.wait()
        except RuntimeError as err:
            raise RingError(self._describe(err)) from err

    def _describe(self, err: Exception) -> str:
        return (
            f"infcl ring exchange failed at {self._what} ({self.name} stream, rank {self.rank} of "
            f"{self.world}: sending to global rank {self.send_rank}, receiving from {self.recv_rank}): {err}"
        )
