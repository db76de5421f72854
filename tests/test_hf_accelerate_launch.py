"""examples/hf_trainer_clip.py under ``accelerate launch --multi_gpu --num_processes 2``: two ranks, GradCache.

Accelerate's ``--cpu`` launch starts one process (it routes every ``--cpu`` launch to its single-process
launcher, expecting mpirun to start the ranks) and refuses ``--cpu`` with ``--multi_gpu``; ``--multi_gpu`` is
its torchrun launcher, which on a machine without GPUs starts gloo CPU ranks (the example's TrainingArguments:
``use_cpu=True``, ``ddp_backend="gloo"``). The gradients are checked under the tests' own launcher
(tests/test_hf_trainer.py); this checks that Accelerate's launch gives the example its two ranks.
"""

import os
import re
import socket
import subprocess
import sys

import pytest

from helpers.distributed import REPO_ROOT

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two fresh transformers processes behind Accelerate's launcher: ~30 s on 2 quiet cores
def test_accelerate_launch_trains_on_two_ranks_with_gradcache(tmp_path):
    script = os.path.join(REPO_ROOT, "examples", "hf_trainer_clip.py")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        script,
        "--steps",
        "1",
        "--per-device-batch",
        "6",
        "--gradcache-chunk",
        "4",
        "--output-dir",
        str(tmp_path),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"world size (\d+), losses: \[([0-9.eE+-]+)\]", done.stdout)
    assert found, done.stdout[-3000:]
    assert int(found.group(1)) == 2
    assert 0.0 < float(found.group(2)) < 100.0  # the symmetric CLIP loss of 12 pairs, near log(12) at init
