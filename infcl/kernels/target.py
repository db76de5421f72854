"""The GPU a launch compiles for: the architecture families infcl has configs for and what Triton's active
driver says about its target (:func:`target_facts`)."""

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

from .env import INTERPRETED

# The architecture families with their own default configs, each named by its first member, and the
# compute capabilities they cover. Every family's configs are compiled by tests/test_triton_api_compile.py;
# a GPU outside them (sm_75, a ROCm GPU) has no compiled configs, so "auto" runs it on the torch tiles.
ARCH_FAMILIES = {
    80: ((8, 0),),  # A100: 163 KiB of shared memory per block
    86: ((8, 6), (8, 7), (8, 9)),  # consumer Ampere / Ada: 99 KiB, fewer registers per SM than sm_80
    90: ((9, 0),),  # H100 / H200: wgmma, 227 KiB
    100: ((10, 0), (10, 3)),  # B200 / B300: tcgen05, 227 KiB
    120: ((12, 0), (12, 1)),  # RTX 50xx / DGX Spark: mma.sync like sm_89, 99 KiB
}
_FAMILY_OF = {capability: family for family, caps in ARCH_FAMILIES.items() for capability in caps}


def arch_key(capability: Tuple[int, int]) -> Optional[int]:
    """The default-config family (a key of :data:`ARCH_FAMILIES`) of a CUDA compute capability, or None
    for an architecture infcl has no compiled configs for."""
    return _FAMILY_OF.get(tuple(capability))


@dataclass(frozen=True)
class TargetFacts:
    """What Triton's active driver says about the GPU it compiles for and launches on."""

    backend: str  # "cuda" or "hip" (Triton's GPUTarget.backend)
    arch: object  # the compute capability as an int (90 for sm_90), or a gfx name on ROCm
    sms: int  # streaming multiprocessors, for the split plans
    device_type: str  # the torch device type of the tensors it launches on ("cuda")

    @property
    def capability(self) -> Optional[Tuple[int, int]]:
        return divmod(self.arch, 10) if self.backend == "cuda" and isinstance(self.arch, int) else None

    @property
    def family(self) -> Optional[int]:
        return arch_key(self.capability) if self.capability is not None else None


# Under the interpreter: sm_90's configs (unused: the interpreter takes its own tiling) and one "SM".
INTERPRETER_FACTS = TargetFacts("cuda", 90, 1, "cpu")


@functools.lru_cache(maxsize=None)
def _driver_facts(active, device: int) -> TargetFacts:
    target = active.get_current_target()
    sms = active.utils.get_device_properties(device)["multiprocessor_count"]
    return TargetFacts(target.backend, target.arch, sms, active.get_active_torch_device().type)


def target_facts() -> TargetFacts:
    """The target of Triton's active driver: the device a launch compiles for (its current device).
    Raises whatever the driver raises where there is no GPU."""
    if INTERPRETED:
        return INTERPRETER_FACTS
    from triton.runtime import driver

    active = driver.active
    return _driver_facts(active, active.get_current_device())


def unsupported_reason(facts: TargetFacts) -> Optional[str]:
    """None if infcl has compiled configs for ``facts``' target, else a sentence saying why not."""
    if facts.backend != "cuda":
        return (
            f"infcl's Triton configs are compiled for NVIDIA GPUs only; Triton's target is {facts.backend} {facts.arch}"
        )
    if facts.family is None:
        known = ", ".join(f"sm_{a}{b}" for caps in ARCH_FAMILIES.values() for a, b in caps)
        return f"infcl has no compiled Triton configs for sm_{facts.arch} (it has them for {known})"
    return None


def target_family() -> int:
    """The default-config family of the active target; a clear error (never a KeyError mid-launch)
    where there is none."""
    facts = target_facts()
    why = unsupported_reason(facts)
    if why is not None:
        raise RuntimeError(f"backend 'triton': {why}")
    return facts.family
