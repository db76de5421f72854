"""The ``open-items`` step: the open GPU items (the guided fault's bisection, the Triton rank / distillation /
guide-tie tests), their output in logs.txt; listed, not run, in a dry run."""

import subprocess
import sys

from .plan import REPO, Sizes
from .rows import Rows

OPEN_ITEMS = (
    ("guided fault bisect", [sys.executable, "tools/guided_fault_repro.py", "bisect"], 100),
    (
        "triton rank/distill/guide tie tests",
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "tests/test_retrieval_backends.py",
            "tests/test_distill_backends.py",
            "tests/test_masks_ties_gpu.py",
            "-k",
            "triton or gpu",
        ],  # fmt: skip
        120,
    ),
)


def step_open_items(rows: Rows, sizes: Sizes, dry: bool) -> None:
    for name, cmd, timeout in OPEN_ITEMS:
        if dry:
            rows.add(name, "planned", " ".join(cmd[1:]), "", f"timeout {timeout} s")
            continue
        try:
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
            rc, tail = done.returncode, (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as err:
            rc, tail = "timeout", str(err.stdout or "")[-3000:]
        print(tail, flush=True)
        last = tail.strip().splitlines()[-1] if tail.strip() else ""
        rows.add(name, "exit", rc, "", last[:160])
