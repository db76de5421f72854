"""The chunked route's backend object: the softmax and sigmoid losses on the route (:mod:`infcl.contract`; the
distillation loss and the ranks have none, and the resolver refuses them)."""

from .sigmoid import ChunkedSigmoid
from .softmax import ChunkedSoftmax


class ChunkedBackend(ChunkedSoftmax, ChunkedSigmoid):
    """The chunked cuBLAS route (``backend="chunked"``, or this object with its options from the call:
    ``backend=ChunkedBackend(budget_mb=512)``); options: :class:`.options.ChunkedOptions`."""

    name = "chunked"


BACKEND = ChunkedBackend()
