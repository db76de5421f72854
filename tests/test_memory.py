"""The memory claim: peak extra memory of forward + backward grows linearly, not quadratically, in B.

Each measurement runs in a fresh subprocess: the inputs are allocated first, the resident set's high-water
mark (VmHWM) is reset to the current resident set, and it is read after one forward + backward. Nothing here
is timed.
"""

import json
import os
import subprocess
import sys

from helpers.support import PEAK_PROBE

_MEASURE = (
    PEAK_PROBE
    + r"""
import json, sys, torch
from infcl import cal_inf_loss, cal_siglip_loss
b, d, backend, loss_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
LOSSES = {  # the symmetric CLIP loss; the sigmoid loss with SigLIP's initial scale and bias
    "clip": lambda q, k, s: cal_inf_loss(q, k, scale=s, symmetric=True, backend=backend),
    "siglip": lambda q, k, s: cal_siglip_loss(q, k, s, -10.0, backend=backend),
}
loss_fn = LOSSES[loss_name]
torch.manual_seed(0)
q = torch.randn(b, d, requires_grad=True)
k = torch.randn(b, d, requires_grad=True)
scale = torch.tensor(10.0, requires_grad=True)
# Warm up thread pools and kernels on a small problem so they are not counted.
loss_fn(q[:64], k[:64], scale).backward()
q.grad = k.grad = scale.grad = None
print(json.dumps({"extra_bytes": peak_extra_bytes(lambda: loss_fn(q, k, scale).backward())}))
"""
)

# D is small on purpose: the flops (and the test's time) scale with D, a B x B matrix does not.
BATCHES = (2048, 4096, 8192)
DIM = 32


def peak_extra_bytes(b, d, backend, loss="clip", threads=2):
    """Peak extra RSS of one forward + backward of ``loss`` ("clip" or "siglip") in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(b), str(d), backend, loss],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]


def test_extra_memory_grows_linearly(tiled_backend):
    backend = tiled_backend
    extra = {b: peak_extra_bytes(b, DIM, backend) for b in BATCHES}
    inputs = {b: 2 * b * DIM * 4 for b in BATCHES}  # q and k in float32
    one_logits_matrix = {b: b * b * 4 for b in BATCHES}
    for b in BATCHES:
        # Linear budget: a small multiple of the inputs (gradients, float32 copies) plus tiles; far
        # below even one B x B float32 matrix (vanilla holds several).
        assert extra[b] < 8 * inputs[b] + 64 * 2**20, (backend, b, extra)
    assert extra[BATCHES[-1]] < one_logits_matrix[BATCHES[-1]] / 8, extra
    # Doubling B at most ~doubles the extra memory (quadratic growth would quadruple it).
    growth = (extra[BATCHES[-1]] + 2**20) / (extra[BATCHES[-2]] + 2**20)
    assert growth < 2.8, (backend, extra)


def test_measurement_sees_the_quadratic_reference():
    # Control: the same measurement on the materializing reference must break the budget above,
    # otherwise the linear-growth test could not fail.
    b = BATCHES[-1]
    extra = peak_extra_bytes(b, DIM, "reference")
    assert extra > b * b * 4 / 8, extra
