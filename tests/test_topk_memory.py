"""topk_scores' memory claim: O((Bq + Bk)·D + Bq·n), never the Bq x Bk scores.

Each measurement runs in a fresh subprocess (as tests/test_masks_memory.py): the embeddings, ids and labels
are allocated first, the resident set's high-water mark is reset, and its growth read over one call. At
Bq = 2048, Bk = 65536 the scores would take 512 MiB (float32); the call may take a sixteenth of that (its
lists are 2048 · 16 · 12 bytes = 384 KiB; measured: torch tiles ~15 MiB, native ~2 MiB). Nothing here is
timed.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.support import PEAK_PROBE
from infcl.backends import unavailable_reason

pytestmark = pytest.mark.slow  # a subprocess per backend, a 2048 x 65536 search each

_MEASURE = (
    PEAK_PROBE
    + r"""
import json, sys, torch
from infcl import topk_scores
bq, bk, d, backend = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
gen = torch.Generator().manual_seed(0)
q, k = torch.randn(bq, d, generator=gen), torch.randn(bk, d, generator=gen)
opts = dict(q_ids=torch.randint(0, 100, (bq,), generator=gen), k_ids=torch.randint(0, 100, (bk,), generator=gen),
            labels=torch.randint(0, bk, (bq,), generator=gen), exclude_labels=True)
topk_scores(q[:64], k[:256], 16, backend=backend)  # warm up thread pools and allocators on a small problem
print(json.dumps({"extra_bytes": peak_extra_bytes(lambda: topk_scores(q, k, 16, backend=backend, **opts))}))
"""
)
BQ, BK, DIM = 2048, 65536, 16
SCORES_BYTES = BQ * BK * 4
# The same fixed mmap threshold as tests/test_masks_memory.py: freed tiles go back to the OS, so the peak
# follows the live tensors.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


@pytest.mark.parametrize("backend", ("torch", "cpu"))
def test_peak_memory_is_a_small_fraction_of_the_scores(backend):
    if unavailable_reason(backend, torch.device("cpu")) is not None:
        pytest.skip(unavailable_reason(backend, torch.device("cpu")))
    env = dict(os.environ, OMP_NUM_THREADS="2", **MALLOC_ENV)
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(BQ), str(BK), str(DIM), backend],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    extra = json.loads(out.stdout.strip().splitlines()[-1])["extra_bytes"]
    # torch tiles: a few 512 x 1024 float32 / bool / int32 tiles (2-4 MiB each); native: a tile per thread.
    assert extra < SCORES_BYTES / 16, f"{backend}: {extra / 2**20:.1f} MiB (the scores: {SCORES_BYTES / 2**20:.0f} MiB)"
