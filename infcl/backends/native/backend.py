"""The native backend object: every API's block operations (:mod:`infcl.contract`) on the C++ kernel's ops."""

from typing import Optional

import torch

from .build import load_error
from .distill import NativeDistill
from .matryoshka import NativeMatryoshka
from .maxsim import NativeMaxSim
from .rank import NativeRanks
from .sigmoid import NativeSigmoid
from .softmax import NativeSoftmax
from .topk import NativeTopK


class NativeBackend(
    NativeSoftmax, NativeMatryoshka, NativeSigmoid, NativeDistill, NativeRanks, NativeTopK, NativeMaxSim
):
    """The native CPU kernel (``backend="cpu"``)."""

    name = "cpu"


BACKEND = NativeBackend()


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the native kernel can run on ``device`` (CPU, extension built), else a sentence saying why."""
    if torch.device(device).type != "cpu":
        return f"backend 'cpu' runs on CPU tensors only, got a tensor on {device}"
    return load_error()
