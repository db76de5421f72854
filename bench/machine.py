"""The machine a benchmark ran on, named in every table, CSV row and plot: ratios mean little without it.

A CPU is named by its model string (``/proc/cpuinfo``), its vendor family and model numbers (a VM may
report only "AMD EPYC"), and the vector and matrix extensions the kernels' speed depends on; a GPU by
``torch.cuda.get_device_name``.
"""

import platform
from pathlib import Path
from typing import Dict

import torch

CPUINFO = Path("/proc/cpuinfo")
# The instruction-set extensions that decide which GEMM and exp paths run (in the order printed).
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _cpuinfo() -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none: macOS, Windows)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_name() -> str:
    """e.g. ``AMD EPYC (AuthenticAMD family 25 model 17; avx2 avx512f avx512_bf16)``."""
    info = _cpuinfo()
    model = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    ids = " ".join(f"{k} {info[k]}" for k in ("cpu family", "model") if k in info).replace("cpu family", "family")
    flags = set(info.get("flags", "").split())
    features = " ".join(f for f in CPU_FEATURES if f in flags)
    details = "; ".join(part for part in (" ".join(filter(None, (info.get("vendor_id"), ids))), features) if part)
    return f"{model} ({details})" if details else model


def device_name(device: torch.device) -> str:
    """The CPU or GPU model behind ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()
