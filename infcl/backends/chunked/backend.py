"""The chunked route's backend object: the softmax loss on the route, the sigmoid loss handed to the fused kernels
(:mod:`infcl.contract`; the distillation loss and the ranks have none, and the resolver refuses them)."""

from .sigmoid import ChunkedSigmoid
from .softmax import ChunkedSoftmax


class ChunkedBackend(ChunkedSoftmax, ChunkedSigmoid):
    """The chunked cuBLAS route (``backend="chunked"``); options: :class:`.options.ChunkedOptions`."""

    name = "chunked"


BACKEND = ChunkedBackend()
