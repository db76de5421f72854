"""Each target's per-SM resources and what they allow: CTAs per SM (occupancy) and the waves of a launch."""

import math
from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class SMLimits:
    """Per-SM resources of one target (the CUDA occupancy calculator's figures for the flagship part)."""

    sms: int  # SMs of the flagship part: A100 108, H100 SXM 132, B200 148
    smem: int  # shared memory per SM usable by CTAs, bytes
    regs: int = 65536
    warps: int = 64
    ctas: int = 32
    reg_unit: int = 256  # registers are allocated per warp in units of this many
    smem_reserved: int = 1024  # per CTA, taken by the system from sm_80 on


LIMITS = {80: SMLimits(108, 164 * 1024), 90: SMLimits(132, 228 * 1024), 100: SMLimits(148, 228 * 1024)}


def occupancy(regs: int, warps: int, smem: int, arch: int) -> Tuple[int, str]:
    """(CTAs per SM, the resource that limits it) for a kernel of ``regs`` registers per thread, ``warps``
    warps and ``smem`` bytes of shared memory."""
    lim = LIMITS[arch]
    regs_per_warp = math.ceil(regs * 32 / lim.reg_unit) * lim.reg_unit
    by = {
        "regs": (lim.regs // regs_per_warp) // warps,
        "smem": lim.smem // (smem + lim.smem_reserved),
        "warps": lim.warps // warps,
        "ctas": lim.ctas,
    }
    limiter = min(by, key=by.get)
    return by[limiter], limiter


def add_launch(row: Dict, batch: int, launch: Dict, sms: int) -> None:
    """``row``'s launch plan at ``batch``: its programs, and the waves they take on ``sms`` SMs at the row's CTAs
    per SM."""
    programs = math.prod(launch["grid"])
    row[f"programs@{batch}"] = programs
    row[f"waves@{batch}"] = programs / (sms * max(row["ctas_per_sm"], 1))
