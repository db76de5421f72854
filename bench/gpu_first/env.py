"""The ``env`` step: device, SM count, clocks, driver, torch / Triton / Inf-CL versions (env.csv)."""

import subprocess
from pathlib import Path
from typing import List

from .files import append_row
from .plan import REPO


def step_env(out: Path) -> None:
    import importlib.metadata

    import torch

    props = torch.cuda.get_device_properties(0)
    rows = {
        "device": props.name,
        "capability": f"{props.major}{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": f"{props.total_memory / 2**30:.1f}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for package in ("triton", "inf_cl"):
        try:
            rows[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            rows[package] = "not installed"
    rows["infcl_commit"] = _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"])
    rows["driver, max SM clock, power limit"] = smi or "nvidia-smi failed"
    for key, value in rows.items():
        append_row(out / "env.csv", {"key": key, "value": value})


def _run(cmd: List[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
