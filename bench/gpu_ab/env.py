"""The ``env`` step: versions, the device, and whether ``mm`` / ``addmm`` with ``out_dtype`` run on this torch."""

import torch

from .plan import Sizes
from .rows import Rows
from .timing import device_for


def step_env(rows: Rows, sizes: Sizes, dry: bool) -> None:
    import triton

    rows.add("versions", "torch", torch.__version__)
    rows.add("versions", "triton", triton.__version__)
    rows.add("versions", "cuda", str(torch.version.cuda))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.add("device", props.name, props.multi_processor_count, "SMs", f"sm_{props.major}{props.minor}")
    device = device_for(dry)
    a = torch.ones(64, 64, dtype=torch.bfloat16, device=device)
    c = torch.zeros(64, 64, device=device)
    forms = {
        "mm out_dtype": lambda: torch.mm(a, a, out_dtype=torch.float32),
        "mm out_dtype out=": lambda: torch.mm(a, a, out_dtype=torch.float32, out=torch.empty_like(c)),
        "addmm out_dtype": lambda: torch.addmm(c, a, a, out_dtype=torch.float32),
        "addmm out_dtype out=c": lambda: torch.addmm(c, a, a, out_dtype=torch.float32, out=c),
    }
    for name, fn in forms.items():
        try:
            ok = bool(torch.equal(fn().float(), torch.full_like(c, 64.0)))
            rows.add("out_dtype", name, int(ok), "runs", "" if ok else "wrong result")
        except Exception as err:  # what this torch does without it is the finding
            rows.add("out_dtype", name, 0, "runs", f"{type(err).__name__}: {str(err)[:120]}")
