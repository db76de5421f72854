"""Mixed precision for GradCache: where autocast applies and how the backward passes are run.

* fp16 (``fp16=True`` + a ``GradScaler``): models and the loss run under ``autocast(float16)``; the
  loss backward that builds the cache is scaled by the scaler, so the cached gradients, the surrogate
  backward and therefore every parameter gradient (encoders and the loss's own, e.g. a temperature)
  carry the same scale. Overflow shows up as inf/NaN in those gradients, which the scaler detects.
  The caller unscales and steps (``scaler.step(optimizer); scaler.update()``).
* bf16 (``bf16=True``): the same autocast with bfloat16, no scaler (bf16 has fp32's exponent range).
* An outer ``torch.autocast`` (HF Trainer) simply stays active around both forward passes, which
  therefore match. Both backward passes run with autocast disabled, as PyTorch recommends, and the
  surrogate dot product is taken in float32.
"""

from contextlib import ExitStack, contextmanager, nullcontext
from typing import Iterable, Optional

import torch


class Precision:
    """The autocast policy of one GradCache: ``forward_context(device_type)`` and ``backward(loss)``."""

    def __init__(self, fp16: bool, bf16: bool, scaler):
        if fp16 and bf16:
            raise ValueError("fp16 and bf16 are exclusive; pick one")
        if fp16 and scaler is None:
            raise ValueError("fp16=True needs a GradScaler (scaler=torch.amp.GradScaler(device_type))")
        if scaler is not None and not fp16:
            raise ValueError("scaler is only used with fp16=True (bf16 and fp32 need no loss scaling)")
        self.dtype: Optional[torch.dtype] = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
        self.scaler = scaler

    def forward_context(self, device_type: str):
        """autocast(device_type, dtype) for fp16/bf16; otherwise leave any outer autocast alone."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, device_types: Iterable[str]) -> None:
        """``loss.backward()``, scaled by the scaler in fp16 mode, with autocast off."""
        with autocast_disabled(device_types):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()


@contextmanager
def autocast_disabled(device_types: Iterable[str]):
    """Turn autocast off for the CPU and each of ``device_types`` (an outer autocast may be active)."""
    with ExitStack() as stack:
        for device_type in sorted({"cpu", *device_types}):
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
