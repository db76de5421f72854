"""Whether the Triton backend can run, and why not: importable without triton (the resolver asks before the
kernels are imported)."""

from typing import Optional

import torch

from ...versions import TRITON_FLOOR, too_old

try:
    import triton

    OLD_TRITON = too_old("Triton", triton.__version__, TRITON_FLOOR)
    if OLD_TRITON is not None:
        raise ImportError(OLD_TRITON)
    from ...kernels import INTERPRETED, interpret_requested
    from ...kernels.target import target_facts, unsupported_reason
except Exception as err:  # triton missing, too old or broken (or a driver error): the backend reports why instead
    IMPORT_ERROR: Optional[Exception] = err
else:
    IMPORT_ERROR = None


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the Triton kernels can run on ``device``, else a sentence saying why not: triton missing, a
    device Triton's active driver does not launch on, or a GPU infcl has no compiled configs for."""
    if IMPORT_ERROR is not None:
        return (
            f"backend 'triton' needs the triton package (pip install 'infcl[triton]'), which failed to import: "
            f"{IMPORT_ERROR}"
        )
    if INTERPRETED:
        return None if device.type in ("cpu", "cuda") else _wrong_device(device)
    try:
        facts = target_facts()
    except Exception as err:  # no GPU, or no driver for it: Triton's own message says which
        facts, driver_error = None, err
    if facts is not None and device.type == facts.device_type:
        why = unsupported_reason(facts)
        return None if why is None else f"backend 'triton': {why}"
    if device.type == "cpu":
        if interpret_requested():
            return (
                "backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before infcl's Triton kernels are "
                "imported; it was set later, so the kernels were built for a GPU"
            )
        return (
            "backend 'triton' runs on CUDA tensors, or on CPU tensors only under TRITON_INTERPRET=1 "
            "(Triton's interpreter)"
        )
    if device.type == "cuda" and facts is None:
        return f"backend 'triton' found no GPU driver for Triton: {type(driver_error).__name__}: {driver_error}"
    return _wrong_device(device)


def _wrong_device(device: torch.device) -> str:
    return f"backend 'triton' runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), not on {device.type}"
