"""Launcher-level resource table of the softmax kernels for sm_90, sm_80 and sm_86 — no GPU needed.

Not the gate (tests/test_triton_api_compile.py checks what the public API launches, through the real
registration); kept for its per-variant table and run only with INFCL_COMPILE_FULL=1, which also runs
the API check's full matrix.

The kernels are compiled by Triton's real JIT (not the interpreter: the worker processes import
infcl.kernels with TRITON_INTERPRET=0) through the real launchers, for GPU targets named to Triton by
a compile-only driver (tests/helpers/triton_compile.py). ptxas (the one bundled with the triton wheel, with
Triton's own allocation flags) reports registers and spills; Triton reports the shared memory. The
checks: no compile error, no register spills, shared memory within the target's per-block limit, and
no floating-point atomic in the PTX (the backward is atomic-free by design).

The matrix (``triton_compile.variants``): sm_90 and sm_80 x fp32 (ieee, tf32) / bf16 / fp16 / fp64 x
D = 1, the largest one-chunk D (e.g. 123 for bf16), 768 and 1000 (with the loss direction and ragged
/ block-multiple batches spread over them) x forward / backward with the default configs; every
autotune config at D = 1000; and sm_86's small-memory defaults on the two heaviest shapes. Results are
cached in pytest's cache, keyed by the kernel sources and the Triton version; ``pytest -s`` prints the
table, which is also written to ``.pytest_cache/d/infcl-triton-compile/report.txt``.
"""

import concurrent.futures
import hashlib
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from helpers import triton_compile

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    os.environ.get("INFCL_COMPILE_FULL", "0") != "1", reason="launcher-level table: INFCL_COMPILE_FULL=1"
)

WORKERS = 2
KERNEL_DIR = Path(__file__).resolve().parent.parent / "infcl" / "kernels"


def _sources_key() -> str:
    digest = hashlib.sha256(triton.__version__.encode())
    for path in sorted(KERNEL_DIR.glob("*.py")) + [Path(triton_compile.__file__)]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def _compile(variant):
    try:
        return triton_compile.compile_variant(variant)
    except Exception as err:  # reported per variant: one failure must not hide the others
        return [{"variant": variant.label(), "kernel": "?", "error": f"{type(err).__name__}: {str(err)[-2000:]}"}]


def _format(rows) -> str:
    heads = ("variant", "kernel", "warps", "regs", "spill bytes", "smem KiB", "limit KiB")
    cells = [heads] + [
        (
            r["variant"],
            r["kernel"],
            str(r.get("num_warps", "")),
            str(r.get("regs", "")),
            str(r.get("spill_bytes", "")),
            f"{r['smem'] / 1024:.1f}" if "smem" in r else "",
            f"{r['smem_limit'] / 1024:.0f}" if "smem" in r else "",
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(heads))]
    lines = [
        "  ".join(c[i].ljust(widths[i]) if i < 2 else c[i].rjust(widths[i]) for i in range(len(heads))) for c in cells
    ]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def report(request):
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    key = f"infcl/triton-compile/{_sources_key()}"
    rows = cache.get(key, None) if cache is not None else None
    start = time.perf_counter()
    if rows is None:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(WORKERS, context, initializer=triton_compile.init_worker) as pool:
            variants = pool.submit(triton_compile.variants).result()
            rows = [row for result in pool.map(_compile, variants) for row in result]
        if cache is not None:
            cache.set(key, rows)
    elapsed = time.perf_counter() - start
    table = _format(rows)
    out = Path(cache.mkdir("infcl-triton-compile") if cache is not None else os.getcwd()) / "triton_compile_report.txt"
    out.write_text(table + "\n")
    print(f"\n{table}\n{len(rows)} kernels in {elapsed:.0f} s; table: {out}")
    return rows


def test_every_variant_compiles(report):
    errors = [f"{r['variant']}: {r['error']}" for r in report if "error" in r]
    assert not errors, "\n".join(errors)


def test_no_register_spills(report):
    spills = [
        f"{r['variant']} {r['kernel']}: {r['spill_bytes']} bytes ({r['regs']} registers)"
        for r in report
        if r.get("spill_bytes")
    ]
    assert not spills, "\n".join(spills)


def test_shared_memory_within_target_limit(report):
    over = [
        f"{r['variant']} {r['kernel']}: {r['smem']} > {r['smem_limit']} bytes"
        for r in report
        if "smem" in r and r["smem"] > r["smem_limit"]
    ]
    assert not over, "\n".join(over)


def test_no_float_atomics(report):
    atomics = [f"{r['variant']} {r['kernel']}: {r['float_atomics']}" for r in report if r.get("float_atomics")]
    assert not atomics, "\n".join(atomics)


def test_matrix_covers_the_public_api(report):
    """Every (target, dtype, phase, kernel) the defaults can launch is in the table."""
    from infcl.kernels.configs import FLOAT64_DOT

    seen = {(r["variant"].split()[0], r["variant"].split()[2], r["kernel"]) for r in report if "error" not in r}
    for arch in ("sm_90", "sm_80", "sm_86"):
        for dtype in ("fp32-ieee", "fp32-tf32", "bf16", "fp16") + (("fp64",) if FLOAT64_DOT else ()):
            for kernel in ("forward", "dq", "dk"):
                assert (arch, dtype, kernel) in seen, (arch, dtype, kernel)
