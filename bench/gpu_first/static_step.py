"""The ``static`` step: ``python -m bench.static`` for this device's target, compile-only, its time model fed
with this device's SM count, GEMM rate and clock, and compared with kernels.csv (static-model.csv; the
report's table, the chunked passes' included, is in logs.txt). A dry run reruns the model on the stored report
(``--from-csv``), no compile."""

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Tuple

from .. import static
from .files import read_rows
from .plan import REPO, Sizes


def static_command(out: Path, report: Path, dry: bool = False) -> Tuple[str, ...]:
    """``python -m bench.static`` for this device's target (env.csv), writing to ``report``, its model fed
    with the device's SM count, the GEMM rate and the SM clock under load the speed step measured, compared
    with kernels.csv."""
    env = dict(read_rows(out / "env.csv", ("key", "value")))
    cmd = [sys.executable, "-m", "bench.static", "--targets", env.get("capability", "90"), "--losses", "clip",
           "--no-plot", "--out", str(report), "--name", "static", "--measured", str(out / "kernels.csv")]  # fmt: skip
    if dry:
        cmd += ["--from-csv", str(static.DEFAULT_OUT / "static.csv")]
    if env.get("sms"):
        cmd += ["--sms", env["sms"]]
    speed = read_rows(out / "speed.csv")
    rates = [float(r["gemm_tflops"]) for r in speed if r["method"].startswith("torch.mm") and r["gemm_tflops"]]
    clocks = [float(r["sm_clock_mhz"]) for r in speed if r["method"] == "triton" and r["sm_clock_mhz"]]
    if rates:
        cmd += ["--tflops", f"{rates[0]:.1f}"]
    if clocks:
        cmd += ["--clock-ghz", f"{clocks[-1] / 1e3:.3f}"]
    return tuple(cmd)


def step_static(out: Path, sizes: Sizes, dry: bool, part: str = "") -> int:
    """The static report (its table on stdout: logs.txt), its model copied to out/static-model.csv."""
    import shutil

    with tempfile.TemporaryDirectory(prefix="gpu-first-static-") as report:
        rc = subprocess.run(static_command(out, Path(report), dry), cwd=REPO).returncode
        if (Path(report) / "static-model.csv").exists():
            shutil.copy(Path(report) / "static-model.csv", out / "static-model.csv")
    return rc
