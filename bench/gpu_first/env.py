"""The ``env`` step: device, SM count, clocks, driver, torch / Triton / peers' versions, the commit (env.csv); and
which of torch's float32-output products run for bf16 operands here (route.csv, step "probes": the route needs
``mm.dtype_out`` for its scores and accumulates dq / dk in the GEMM where ``addmm.dtype_out`` runs in place), from
:func:`infcl.backends.chunked.probes.probe_out_dtype`, or the forms below where this infcl has no such probe."""

import subprocess
from pathlib import Path
from typing import Dict, List

import torch

from .files import append_row, route_row
from .plan import PEERS_DIR, REPO, Sizes
from .timing import device_for


def _local_probes(device: torch.device) -> Dict[str, str]:
    """What runs, for a checkout without infcl's probe: mm / addmm with out_dtype, allocating and into out=."""
    a = torch.ones(64, 64, dtype=torch.bfloat16, device=device)
    c = torch.zeros(64, 64, device=device)
    forms = {
        "mm.dtype": lambda: torch.mm(a, a, out_dtype=torch.float32),
        "mm.dtype_out": lambda: torch.mm(a, a, out_dtype=torch.float32, out=torch.empty_like(c)),
        "addmm.dtype": lambda: torch.addmm(c, a, a, out_dtype=torch.float32),
        "addmm.dtype_out in place": lambda: torch.addmm(c, a, a, out_dtype=torch.float32, out=c),
    }
    answers = {}
    for name, fn in forms.items():
        try:
            answers[name] = "runs" if torch.equal(fn().float(), torch.full_like(c, 64.0)) else "wrong result"
        except (TypeError, RuntimeError, NotImplementedError) as err:  # what this torch lacks is the finding
            answers[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return answers


def probe_out_dtype(device: torch.device) -> Dict[str, str]:
    try:
        from infcl.backends.chunked.probes import probe_out_dtype as probe
    except ImportError:
        return _local_probes(device)
    return probe(device)


def step_env(out: Path, sizes: Sizes, dry: bool, part: str = "") -> None:
    import importlib.metadata

    device = device_for(dry)
    rows = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        rows.update(device=props.name, capability=f"{props.major}{props.minor}", sms=props.multi_processor_count,
                    memory_gib=f"{props.total_memory / 2**30:.1f}")  # fmt: skip
    else:
        rows["device"] = "cpu (dry run)"
    for package in ("triton", "inf_cl", "memeff", "siglip_kernel"):
        try:
            rows[package] = importlib.metadata.version(package.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:  # a peer the peers step installs from its carried wheel
            wheel = sorted(PEERS_DIR.glob(f"{package}-*.whl")) if PEERS_DIR.is_dir() else []
            rows[package] = f"{wheel[-1].name.split('-')[1]} (wheel in .peers)" if wheel else "not installed"
    rows["infcl_commit"] = _run(["git", "rev-parse", "--short", "HEAD"]) or "unknown"
    if device.type == "cuda":
        smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"])
        rows["driver, max SM clock, power limit"] = smi or "nvidia-smi failed"
    for key, value in rows.items():
        append_row(out / "env.csv", {"key": key, "value": value})
    for form, answer in probe_out_dtype(device).items():
        route_row(out, "probes", "bf16 operands, float32 result", form, answer)


def _run(cmd: List[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
