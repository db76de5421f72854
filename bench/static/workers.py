"""Every (target, dtype, D) of the report compiled in spawned worker processes, one process per job, and the
no-positive pass's figures set beside each softmax kernel's."""

import concurrent.futures
import multiprocessing
from typing import Dict, List, Optional, Tuple

from .compile import report_target
from .driver import triton_compile
from .inf_cl_kernels import report_inf_cl
from .matrix import BATCHES, BF16, DIM, ENTRIES, TARGETS

# Worker processes compiling at once (run(workers=...)); each compile job is one process.
WORKERS = 2

# The figures of the softmax kernels' tiles without a positive (:func:`without_positives`), beside each row's.
NO_POSITIVE_FIGURES = ("instr_per_entry", "mufu_per_entry", "shfl_per_entry", "instr_per_entry_all_slices")


def run(
    targets=TARGETS,
    dtypes=(BF16,),
    dims=(DIM,),
    batches=BATCHES,
    entries=ENTRIES,
    workers: int = WORKERS,
    tiles: Optional[Dict[str, Tuple[int, ...]]] = None,
    no_positive: bool = True,
    inf_cl: bool = False,
    sms: Optional[int] = None,
    options: Optional[Dict] = None,
) -> List[Dict]:
    """Every (target, dtype) of the report in spawned workers (which import infcl with TRITON_INTERPRET=0), one
    process per job; targets whose ptxas the wheel lacks are skipped. ``no_positive``: the softmax kernels
    also compiled as :func:`without_positives`, their figures in the ``*_no_pos`` columns. ``inf_cl``: also
    Inf-CL's kernels (:func:`report_inf_cl`) at each D. ``sms``: the stand-in GPU's SM count (default: each
    target's flagship), which the launch plans read. ``options``: more of cal_inf_loss's options
    (:func:`report_target`); with mask options the no-positive pass is left out (the masked kernels form their
    positives in every tile)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        workers, context, initializer=triton_compile.init_worker, max_tasks_per_child=1
    ) as pool:
        known = [arch for arch in targets if pool.submit(triton_compile.ptxas_knows, arch).result()]
        cases = [(arch, dtype, precision, dim) for arch in known for dtype, precision in dtypes for dim in dims]
        jobs = [pool.submit(report_target, *case, batches, entries, tiles, False, sms, options) for case in cases]
        masked = bool((options or {}).get("masks"))
        plain = ("cal_inf_loss",) if "cal_inf_loss" in entries and no_positive and not masked else ()
        extra = [
            pool.submit(report_target, *case, batches, plain, tiles, True, sms, options) for case in cases if plain
        ]
        theirs = [pool.submit(report_inf_cl, arch, dim, batches, sms) for arch in known for dim in dims if inf_cl]
        rows = [row for job in jobs for row in job.result()]
        key = ("target", "dtype", "D", "kernel")
        skipped = {tuple(row[k] for k in key): row for job in extra for row in job.result()}
        for row in rows:
            other = skipped.get(tuple(row[k] for k in key))
            if other is not None:
                row.update({f"{name}_no_pos": other[name] for name in NO_POSITIVE_FIGURES})
        return rows + [row for job in theirs for row in job.result()]
