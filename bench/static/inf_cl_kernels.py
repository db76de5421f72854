"""Inf-CL's kernels, compiled and counted the same way as infcl's (:mod:`.compile`), and the names both meet
on: the report's kernel labels, which the profiler's rows (bench.gpu_first) take too."""

import importlib.util
from typing import Dict, List, Optional

from .counts import compiled_figures
from .driver import triton_compile
from .matrix import BATCHES, DIM
from .resources import LIMITS, add_launch
from .traffic import inf_cl_bytes_flops, per_entry_model

# inf_cl.flash's kernels by their names (triton_compile._kernel_name), as the rows name them.
INF_CL_KERNELS = {"prob_fwd": "inf-cl forward", "dq_prob_bwd": "inf-cl dq", "dk_prob_bwd": "inf-cl dk"}
# Inf-CL's symmetric loss is two calls, one per direction (bench.methods.inf_cl_loss): each kernel runs twice.
INF_CL_CALLS = 2


def kernel_label(name: str) -> str:
    """The report's name of a kernel from its function name (``_dq_kernel`` -> ``dq``, Inf-CL's
    ``_dq_prob_bwd_kernel`` -> ``inf-cl dq``): profiler rows and compiled rows meet on it."""
    name = name.strip("_").replace("_kernel", "")
    return INF_CL_KERNELS.get(name, name)


def report_inf_cl(arch: int, dim: int = DIM, batches=BATCHES, sms: Optional[int] = None) -> List[Dict]:
    """Inf-CL's forward, dq and dk kernels as its own launchers (``inf_cl.flash._flash_prob_forward`` /
    ``_backward``) launch them for one direction at D = ``dim`` (q and k upcast to fp32 in heads of the
    first of bench.methods' INF_CL_HEAD_DIMS dividing D, so tl.dot runs tf32), compile-only for ``arch``;
    one row per kernel. The launchers assert CUDA tensors: CPU tensors that say they are (nothing is read)."""
    import torch
    from inf_cl import flash

    from bench.methods import INF_CL_HEAD_DIMS

    class OnCuda(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    sms = sms or LIMITS[arch].sms
    head = next((h for h in INF_CL_HEAD_DIMS if dim % h == 0), None)
    if head is None:  # Inf-CL takes no such D (bench.methods lists it as unavailable)
        return []
    rows: Dict[str, Dict] = {}
    for batch in batches:
        q, k = (torch.Tensor._make_subclass(OnCuda, torch.zeros(batch, dim // head, head)) for _ in "qk")
        with triton_compile.compile_only(arch, sms=sms) as (compiled, start):
            lse = flash._flash_prob_forward(q, k)
            flash._flash_prob_backward(q, k, lse, torch.ones_like(lse))
            launches = list(zip(compiled[start:], triton_compile._RECORDER.launches[start:]))
        for (fn, kernel, log), launch in launches:
            name = kernel_label(triton_compile._kernel_name(fn))
            if name not in rows:
                bm, bn = launch["BLOCK_M"], launch["BLOCK_N"]
                usage = triton_compile._resources(fn, kernel, log, arch)
                figures = compiled_figures(arch, kernel, usage, dim // head, bm * bn, peeled=False)
                row = {
                    "target": f"sm_{arch}",
                    "dtype": "fp32-tf32",
                    "D": dim,
                    "kernel": name,
                    "config": f"{bm}x{bn} d{head}",
                    "min_mma_m": min(bm, bn),
                    "calls": INF_CL_CALLS,
                    "s_mma": "-",
                    "s_layouts": 0,
                    "s_layout": "-",
                    **figures,
                }
                rows[name] = {**row, **per_entry_model(row, *inf_cl_bytes_flops(name, bm, bn, dim, 4), bm * bn, 1)}
            add_launch(rows[name], batch, launch, sms)
    return list(rows.values())


def inf_cl_installed() -> bool:
    return importlib.util.find_spec("inf_cl") is not None
