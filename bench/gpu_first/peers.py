"""The ``peers`` step: the other exact tiled losses at the speed step's B, D and dtype (bf16, forward + backward),
timed the same way, into speed.csv beside ours: Inf-CL (CLIP, its two directions), memeff (CLIP; a fixed
temperature, so no scale gradient) and siglip-kernel (SigLIP, its ``auto`` kernel for the device).

The GPU has no network: their wheels are downloaded beforehand (``pip download --no-deps siglip-kernel memeff
inf-cl -d .peers``, an ignored folder carried with the checkout) and installed here, without dependencies and
without an index, into a temporary folder beside the run (put on ``sys.path``; not under ``<out>``, whose files a
device run copies back, a few at a time). A peer that does not install,
import or run gets a row saying why; on CPU (a dry run) each gets a "skipped" row (they are CUDA-only)."""

import importlib
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from .files import append_row, route_row
from .plan import PEERS_DIR, Sizes
from .speed import speed_row
from .timing import device_for

# (method name, loss, distribution name as pip spells it, the module it imports)
PEERS = (("inf-cl", "clip", "inf-cl", "inf_cl"), ("memeff", "clip", "memeff", "memeff"),
         ("siglip-kernel", "siglip", "siglip-kernel", "siglip_kernel"))  # fmt: skip
TEMPERATURE = 0.07  # memeff's fixed temperature: the scale 1 / 0.07 of the others


def install(out: Path, wheels: Path = PEERS_DIR) -> Tuple[Path, Dict[str, str]]:
    """pip-install every wheel in ``wheels`` into a temporary folder (no dependencies, no index); (the folder,
    {distribution: "installed" or why not}). ``out``: the run's folder, kept free of the installed packages."""
    site = Path(tempfile.mkdtemp(prefix="infcl-peers-site-"))
    status = {}
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    for _, _, dist, _ in PEERS:
        match = [w for w in found if w.name.split("-")[0].replace("_", "-") == dist]
        if not match:
            status[dist] = f"no wheel in {wheels} (pip download --no-deps {dist} -d {wheels.name})"
            continue
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target", str(site),
               str(match[-1])]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        tail = (done.stdout + done.stderr).strip().splitlines()
        status[dist] = "installed" if done.returncode == 0 else f"pip: {tail[-1][:160] if tail else done.returncode}"
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    return site, status


def peer_loss(name: str) -> Callable:
    """``fn(q, k, scale)`` -> the peer's loss (0-d), for unit-norm bf16 rows (memeff: ``fn(q, k)``)."""
    if name == "inf-cl":
        from ..methods import inf_cl_loss

        return lambda q, k, s: inf_cl_loss(q, k, s, True)
    if name == "memeff":
        from memeff import MemoryEfficientCLIPLoss

        module = MemoryEfficientCLIPLoss(temperature=TEMPERATURE, normalized_inputs=True, stable=False)
        return lambda q, k: module(q, k)  # no scale: memeff's temperature is fixed
    from siglip_kernel import fused_siglip_loss

    log_t = None
    bias = None

    def siglip(q, k, s):
        nonlocal log_t, bias
        if log_t is None:
            log_t = torch.tensor(math.log(float(s)), device=q.device, requires_grad=True)
            bias = torch.tensor(-10.0, device=q.device, requires_grad=True)
        log_t.grad = bias.grad = None
        return fused_siglip_loss(q, k, log_t, bias)

    return siglip


def step_peers(out: Path, sizes: Sizes, dry: bool, part: str = "") -> None:
    from ..methods import make_inputs

    device = device_for(dry)
    status: Dict[str, str] = {}
    if dry:
        status = {dist: "skipped: CUDA-only (a dry run)" for _, _, dist, _ in PEERS}
    else:
        _, status = install(out)
    for dist, what in status.items():
        route_row(out, "peers", dist, "install", what)
    for name, loss, dist, module in PEERS:
        why: Optional[str] = None if status[dist] == "installed" else status[dist]
        if why is None:
            try:
                importlib.import_module(module)
            except Exception as err:  # the finding: why this peer does not run here
                why = f"import {module}: {type(err).__name__}: {str(err)[:160]}"
        for batch in sizes.speed:
            row = {"method": name, "loss": loss, "batch": batch, "dim": sizes.dim, "dtype": "bfloat16"}
            if why:
                append_row(out / "speed.csv", {**row, "status": "skipped", "note": why})
                continue
            q, k, scale = make_inputs(batch, sizes.dim, torch.bfloat16, device)
            leaves = (q, k) if name == "memeff" else (q, k, scale)
            speed_row(out, row, peer_loss(name), batch, sizes, device, leaves)
