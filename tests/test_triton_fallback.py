"""Where the Triton kernels cannot run on a CUDA device (no triton, a ROCm GPU, an architecture with no
compiled configs), backend="auto" falls back to the torch tiles with one warning naming why, and
backend="triton" raises that reason before any launch. The device facts come from Triton's active driver
(``infcl.kernels.target.target_facts``), so these tests replace that answer."""

import warnings

import pytest
import torch

from infcl.backends import resolve as backends
from infcl.backends import resolve_backend

pytest.importorskip("triton")
from infcl.backends.triton import available as triton_backend  # noqa: E402
from infcl.kernels import target as kernel_target  # noqa: E402
from infcl.kernels.target import TargetFacts

CUDA = torch.device("cuda", 0)
SUPPORTED = TargetFacts("cuda", 90, 132, "cuda")
CASES = {
    "turing": (TargetFacts("cuda", 75, 40, "cuda"), "no compiled Triton configs for sm_75"),
    "rocm": (TargetFacts("hip", "gfx942", 304, "cuda"), "NVIDIA GPUs only; Triton's target is hip gfx942"),
}


@pytest.fixture
def target(monkeypatch):
    """Pretend the kernels are compiled (not interpreted) for a target that ``use`` names."""
    monkeypatch.setattr(triton_backend, "INTERPRETED", False)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_WARNED", set())

    def use(facts):
        monkeypatch.setattr(triton_backend, "target_facts", lambda: facts)
        monkeypatch.setattr(kernel_target, "target_facts", lambda: facts)  # configs re-exports it

    return use


def _resolve(backend):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        name = resolve_backend(backend, CUDA)
    return name, [str(w.message) for w in caught]


@pytest.mark.parametrize("case", sorted(CASES))
def test_auto_falls_back_to_torch_with_one_warning(target, case):
    facts, why = CASES[case]
    target(facts)
    name, messages = _resolve("auto")
    assert name == "torch"
    assert len(messages) == 1 and why in messages[0] and "torch tiles" in messages[0]
    assert _resolve("auto") == ("torch", [])  # the same reason warns once per process


@pytest.mark.parametrize("case", sorted(CASES))
def test_explicit_triton_raises_the_reason(target, case):
    facts, why = CASES[case]
    target(facts)
    with pytest.raises(RuntimeError, match=why.split(";")[0].replace("(", r"\(").replace(")", r"\)")):
        resolve_backend("triton", CUDA)


def test_supported_target_picks_triton_silently(target):
    target(SUPPORTED)
    assert _resolve("auto") == ("triton", [])
    assert resolve_backend("triton", CUDA) == "triton"


def test_no_triton_falls_back_with_its_import_error(target, monkeypatch):
    monkeypatch.setattr(triton_backend, "IMPORT_ERROR", ImportError("No module named 'triton'"))
    name, messages = _resolve("auto")
    assert name == "torch" and len(messages) == 1 and "No module named 'triton'" in messages[0]
    with pytest.raises(RuntimeError, match="needs the triton package"):
        resolve_backend("triton", CUDA)


def test_no_gpu_driver_is_a_reason_not_a_crash(target, monkeypatch):
    def no_driver():
        raise RuntimeError("0 active drivers ([]). There should only be one.")

    monkeypatch.setattr(triton_backend, "target_facts", no_driver)
    name, messages = _resolve("auto")
    assert name == "torch" and len(messages) == 1 and "0 active drivers" in messages[0]


def test_kernel_configs_of_an_unsupported_target_raise_clearly(target):
    """Below the backend choice too: asking for the family's configs raises the reason, never a KeyError."""
    target(CASES["turing"][0])
    with pytest.raises(RuntimeError, match="no compiled Triton configs for sm_75"):
        kernel_target.target_family()


@pytest.mark.parametrize(
    "capability, family",
    [
        ((8, 0), 80),
        ((8, 6), 86),
        ((8, 9), 86),
        ((9, 0), 90),
        ((10, 0), 100),
        ((12, 0), 120),
        ((7, 5), None),
        ((11, 0), None),
    ],
)
def test_arch_families(capability, family):
    assert kernel_target.arch_key(capability) == family
