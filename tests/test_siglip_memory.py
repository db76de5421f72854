"""The sigmoid loss's memory claim: at B = 16384 the tiled backends' peak extra memory for forward +
backward is at most a tenth of the materialized loss's (measured the same way, tests/test_memory.py:
the RSS high-water mark in a fresh process). Nothing here is timed.
"""

import pytest

from test_memory import peak_extra_bytes

BATCH = 16384
DIM = 32  # small on purpose: the flops (and the test's time) scale with D, a B x B matrix does not
# At most this share of the materialized loss's peak extra memory.
MAX_SHARE = 0.1


@pytest.fixture(scope="module")
def materialized():
    extra = peak_extra_bytes(BATCH, DIM, "reference", "siglip")
    # Control: the measurement must see the B x B float32 logits, or the comparison below means nothing.
    assert extra > BATCH * BATCH * 4, extra
    return extra


def test_peak_memory_is_a_tenth_of_the_materialized_loss(materialized, tiled_backend):
    backend = tiled_backend
    # The torch tiles on one thread: their memory does not depend on it, and on a busy machine the
    # OpenMP barriers of thousands of small tile ops make two threads several times slower.
    extra = peak_extra_bytes(BATCH, DIM, backend, "siglip", threads=1 if backend == "torch" else 2)
    assert extra <= MAX_SHARE * materialized, (backend, extra, materialized)
