"""The Triton backend object: every API's block operations (:mod:`infcl.contract`) on the fused kernels."""

from .distill import TritonDistill
from .matryoshka import TritonMatryoshka
from .maxsim import TritonMaxSim
from .rank import TritonRanks
from .sigmoid import TritonSigmoid
from .softmax import TritonSoftmax
from .topk import TritonTopK


class TritonBackend(
    TritonSoftmax, TritonMatryoshka, TritonSigmoid, TritonDistill, TritonRanks, TritonTopK, TritonMaxSim
):
    """The fused Triton kernels (``backend="triton"``); options: :class:`.options.TritonOptions`."""

    name = "triton"


BACKEND = TritonBackend()
