"""What every test file shares: the interpreter switch, the markers by kind, and the common fixtures.

Markers (registered in pyproject.toml): ``interpreter`` (Triton kernels run by TRITON_INTERPRET=1),
``compile`` (kernels compiled for a GPU target, no launch), ``distributed`` (spawned gloo ranks) and
``slow`` (every test of those three kinds, plus the few heavy ones marked where they are defined).
``python -m pytest tests -q -m "not slow"`` is the inner loop; the plain command runs everything.
"""

import os

# Idle OpenMP threads sleep instead of spinning (libgomp reads this when torch loads it, so before the import;
# spawned ranks and subprocesses inherit it). With a test process per core, the 2-thread tests' spinning
# threads take the core the other process needs: test_memory's torch-tiles case took 3x the time under load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, test the Triton kernels through Triton's interpreter (CPU tensors). Triton 3.9 reads
# TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. when infcl.kernels is first imported, so
# it must be set here, before any test module is collected. An explicit value is left alone.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread per test process: the tests use small shapes, where torch's OpenMP pool on shared cores
# mostly waits at its barriers (and CI's `-n 2` already runs a process per core). Tests of threading set their
# own count and restore it; the spawned gloo ranks get OMP_NUM_THREADS=1 from helpers.distributed.
torch.set_num_threads(1)

from helpers import truth  # noqa: E402
from helpers.support import DTYPE_TOLERANCES, tiled_backends  # noqa: E402  (after TRITON_INTERPRET)
from helpers.torch_settings import float32_matmul as float32_matmul_settings  # noqa: E402

# Whole files of one kind. Tests of these kinds elsewhere carry the marker themselves, or are found below:
# a parameter naming the "triton" backend (interpreted here) or the module fixture ``spawned`` (gloo ranks).
FILE_KINDS = {
    "test_triton.py": "interpreter",
    "test_siglip_triton.py": "interpreter",
    "test_triton_api_compile.py": "compile",
    "test_triton_compile.py": "compile",
    "test_static_report.py": "compile",
    "test_rank_distill_compile.py": "compile",
    "test_triton_guided_narrow.py": "compile",
    "test_ring.py": "distributed",
    "test_siglip_ring.py": "distributed",
    "test_masks_ring.py": "distributed",
    "test_hf_trainer.py": "distributed",
    "test_hf_accelerate_launch.py": "distributed",
    "test_open_clip_distill_flags.py": "distributed",
}
# Whole files that are slow for what they measure, build or run (peak memory at B in the thousands, wheels,
# the benchmark's CLI, sentence-transformers' own models and trainer, training runs in subprocesses), without
# being one of the kinds above.
SLOW_FILES = {
    "test_memory.py",
    "test_masks_memory.py",
    "test_siglip_memory.py",
    "test_packaging.py",
    "test_open_clip_train.py",
    "test_st_loss_bench.py",
    "test_bench_masks.py",
    "test_bench_smoke.py",
    "test_sentence_transformers.py",
}
SLOW_KINDS = ("interpreter", "compile", "distributed")


def _interpreted(item) -> bool:
    params = getattr(item, "callspec", None)
    return (
        os.environ.get("TRITON_INTERPRET") == "1"
        and params is not None
        and any(isinstance(v, str) and v.startswith("triton") for v in params.params.values())
    )


# The longest files first, so that README's `-n 2 --dist loadfile` starts them first and the short ones fill in
# beside them (in collection order the interpreter's test_triton.py came last and ran alone for minutes).
LONGEST_FIRST = (
    "test_triton.py",
    "test_masks.py",
    "test_triton_api_compile.py",
    "test_properties.py",
    "test_loss.py",
    "test_static_report.py",
    "test_siglip_triton.py",
    "test_sentence_transformers.py",
)


def _file_rank(item) -> int:
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_file_rank)  # stable: every file's tests stay together and in their order
    for item in items:
        kind = FILE_KINDS.get(item.path.name)
        if kind:
            item.add_marker(kind)
        if _interpreted(item):
            item.add_marker("interpreter")
        if "spawned" in getattr(item, "fixturenames", ()):
            item.add_marker("distributed")
        if item.path.name in SLOW_FILES or any(item.get_closest_marker(k) for k in SLOW_KINDS):
            item.add_marker("slow")


# ---- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(params=[d for d, _, _ in DTYPE_TOLERANCES], ids=lambda d: str(d).replace("torch.", ""))
def dtype_tolerance(request):
    """(dtype, atol, rtol) of every dtype, with its tolerance against the float64 truth."""
    return next(t for t in DTYPE_TOLERANCES if t[0] == request.param)


@pytest.fixture(params=tiled_backends())
def tiled_backend(request):
    """Every non-reference backend that runs natively on CPU tensors here (torch tiles; native where built)."""
    return request.param


@pytest.fixture
def float32_matmul():
    """Sets torch's TF32 flag for the test (``float32_matmul(True)``) and restores torch's float32 matmul
    precision afterwards (``helpers.torch_settings``: never ``monkeypatch.setattr`` on torch's settings)."""
    with float32_matmul_settings() as matmul:

        def set_tf32(allow: bool):
            matmul.allow_tf32 = allow
            return matmul

        yield set_tf32


@pytest.fixture
def float64_truth():
    """The float64 truth written without infcl: tests/helpers/truth.py (``losses``, ``directions``)."""
    return truth
