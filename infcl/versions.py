"""The one version floor infcl supports: torch >= 2.8 and, for ``backend="triton"``, Triton >= 3.4 (the Triton that
torch 2.8 ships). Nothing in infcl branches on an older version: ``import infcl`` raises ImportError on an older
torch, and the Triton backend reports itself unavailable, naming the floor, on an older Triton."""

import re
from typing import Optional, Tuple

TORCH_FLOOR = (2, 8)  # torch.mm(..., out_dtype=) (the chunked route), torch.library.triton_op / wrap_triton
TRITON_FLOOR = (3, 4)  # tuple arguments between jit functions, float64 tl.dot, the lazy autotuner benchmarker


def release(version: str) -> Tuple[int, int]:
    """(major, minor) of a version string such as "2.8.0", "2.10.0+cu128" or "3.4.0a0+git1234"."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a version string: {version!r}")
    return int(match.group(1)), int(match.group(2))


def floor_text(floor: Tuple[int, int]) -> str:
    return ".".join(str(part) for part in floor)


def too_old(package: str, version: str, floor: Tuple[int, int]) -> Optional[str]:
    """None when ``version`` of ``package`` meets ``floor``, else a sentence naming the floor and the fix."""
    if release(version) >= floor:
        return None
    need = floor_text(floor)
    return f"infcl needs {package} >= {need} (found {version}): pip install '{package}>={need}'"


def require_torch(version: Optional[str] = None) -> None:
    """Raise ImportError naming the floor when the installed torch (or ``version``) is older than 2.8."""
    if version is None:
        import torch

        version = torch.__version__
    why = too_old("torch", str(version), TORCH_FLOOR)
    if why is not None:
        raise ImportError(why)


def requirements() -> str:
    """The floor in words, for ``python -m infcl``'s report."""
    return f"torch >= {floor_text(TORCH_FLOOR)}, Triton >= {floor_text(TRITON_FLOOR)} for backend 'triton'"


require_torch()  # at import: ``import infcl`` imports this module first
