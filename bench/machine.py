"""The machine a benchmark ran on, named in every table, CSV row and plot: ratios mean little without it.

A CPU is named by its model string (``/proc/cpuinfo``), its vendor family and model numbers (a VM may
report only "AMD EPYC"), and the vector and matrix extensions the kernels' speed depends on; a GPU by
``torch.cuda.get_device_name``. A run under the AVX2 proxy (:data:`AVX2_PROXY_ENV`, ``python -m bench
--avx2-proxy``) says so in the CPU's name.
"""

import os
import platform
from pathlib import Path
from typing import Dict

import torch

CPUINFO = Path("/proc/cpuinfo")
# The instruction-set extensions that decide which GEMM and exp paths run (in the order printed).
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
# What an AVX2-only x86 CPU (AVX2 + FMA; e.g. AMD Zen 3) runs, on any x86 CPU: the native kernel built for
# x86-64-v3, torch's vectorized ops, oneDNN and MKL held to AVX2 (docs/install.md). Each is read when a
# process starts: set before the benchmark's workers start.
AVX2_PROXY_ENV = {
    "INFCL_NATIVE_ARCH": "x86-64-v3",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


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
    name = f"{model} ({details})" if details else model
    return f"{name} [AVX2 proxy]" if is_avx2_proxy() else name


def is_avx2_proxy() -> bool:
    """Whether every variable of :data:`AVX2_PROXY_ENV` is set as the proxy sets it."""
    return all(os.environ.get(var) == value for var, value in AVX2_PROXY_ENV.items())


def device_name(device: torch.device) -> str:
    """The CPU or GPU model behind ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()
