"""cal_maxsim_loss's memory claim: a few token tiles, never the [Bq, Bk, Lq, Lk] token scores.

One measurement in a fresh subprocess (as tests/test_topk_memory.py): the tokens and masks are allocated first, the
resident set's high-water mark is reset, and its growth read over one forward and backward. At Bq = 512,
Bk = 4096, Lq = 4, Lk = 8 the token scores would take 256 MiB (float32); the torch tiles hold two 8 MiB token tiles,
a copy of the queries' tokens, one document tile's and the gradients (1.1 MiB); the native kernel a tile's winners
(8 MiB), its [Bq, nd] scores and its packed documents. Nothing here is timed.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.support import PEAK_PROBE
from infcl.backends import unavailable_reason

NATIVE_REASON = unavailable_reason("cpu", torch.device("cpu"))
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"native kernel unavailable: {NATIVE_REASON}")

pytestmark = pytest.mark.slow  # a subprocess, a 512 x 4096-document loss

_MEASURE = (
    PEAK_PROBE
    + r"""
import json, torch
from infcl import cal_maxsim_loss
gen = torch.Generator().manual_seed(0)
bq, bk, lq, lk, d = 512, 4096, 4, 8, 8
q = torch.randn(bq, lq, d, generator=gen).requires_grad_()
docs = torch.randn(bk, lk, d, generator=gen).requires_grad_()
q_mask, docs_mask = torch.rand(bq, lq, generator=gen) > 0.2, torch.rand(bk, lk, generator=gen) > 0.2
labels = torch.randint(0, bk, (bq,), generator=gen)
cal_maxsim_loss(q[:8], docs[:16], labels[:8] % 16, backend=BACKEND).backward()  # warm up thread pools and allocators
q.grad = docs.grad = None
step = lambda: cal_maxsim_loss(q, docs, labels, q_mask=q_mask, docs_mask=docs_mask, backend=BACKEND).backward()
print(json.dumps({"extra_bytes": peak_extra_bytes(step)}))
"""
)
TOKEN_SCORES_BYTES = 512 * 4096 * 4 * 8 * 4


@pytest.mark.parametrize("backend", ("torch", pytest.param("cpu", marks=needs_native)))
def test_peak_memory_is_a_few_tiles(backend):
    env = dict(os.environ, OMP_NUM_THREADS="2", MALLOC_MMAP_THRESHOLD_=str(64 * 1024))
    script = _MEASURE.replace("BACKEND", repr(backend))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    extra = json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]
    assert extra < TOKEN_SCORES_BYTES / 8, (
        f"{extra / 2**20:.1f} MiB (the token scores: {TOKEN_SCORES_BYTES / 2**20:.0f} MiB)"
    )
