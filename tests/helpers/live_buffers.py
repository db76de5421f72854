"""A count of the tensors alive at once: every tensor an op allocates (its storage shares none of its inputs')
is followed by a weak reference until it is freed, under a TorchDispatchMode. The peak bytes, and the peak number
of buffers of given sizes (the [C, Bk] ones), are recorded while :attr:`LiveBuffers.recording` is set;
:meth:`LiveBuffers.paused` leaves a stand-in's own temporaries out (what the GPU op it stands for would not
allocate)."""

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class LiveBuffers(TorchDispatchMode):
    """``sizes``: the byte counts of the buffers :attr:`peak_sized` counts (a [C, Bk] buffer's in each dtype)."""

    def __init__(self, sizes=()):
        super().__init__()
        self.sizes = set(sizes)
        self.live = {}  # storage pointer -> bytes
        self.peak = self.peak_sized = 0
        self.recording = False
        self._paused = False

    @contextlib.contextmanager
    def paused(self):
        self._paused, saved = True, self._paused
        try:
            yield
        finally:
            self._paused = saved

    def live_bytes(self) -> int:
        return sum(self.live.values())

    def _record(self):
        if self.recording:
            self.peak = max(self.peak, self.live_bytes())
            self.peak_sized = max(self.peak_sized, sum(1 for n in self.live.values() if n in self.sizes))

    def _forget(self, key: int):
        self.live.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        inputs = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            key = _storage_key(t)
            if key in inputs or key in self.live:
                continue
            self.live[key] = t.untyped_storage().nbytes()
            weakref.finalize(t, self._forget, key)
        self._record()
        return out


def recording_inside(backend_cls):
    """``backend_cls`` whose block operations switch the innermost :class:`LiveBuffers` to recording while they
    run: its peak is the route's, with everything allocated since the call began alive beside it."""

    class Recorded(backend_cls):
        def _inside(self, op, *args):
            tracker = _get_current_dispatch_mode_stack()[-1]
            tracker.recording = True
            try:
                return op(*args)
            finally:
                tracker.recording = False

        def forward_block(self, block, symmetric):
            return self._inside(super().forward_block, block, symmetric)

        def backward_block(self, block, dq, dk):
            return self._inside(super().backward_block, block, dq, dk)

        def sigmoid_forward_block(self, block):
            return self._inside(super().sigmoid_forward_block, block)

        def sigmoid_backward_block(self, block, dq, dk):
            return self._inside(super().sigmoid_backward_block, block, dq, dk)

        def sigmoid_loss_and_grad_block(self, block, dq, dk):
            return self._inside(super().sigmoid_loss_and_grad_block, block, dq, dk)

    return Recorded
