"""Issue 31: ids as users hold them (a column of a metadata tensor, a strided slice, an expanded id) give
the loss of the same ids made contiguous, on every backend (the Triton kernels read ids with stride 1:
the launcher copies views)."""

import pytest
import torch
import torch.nn.functional as F

from helpers.support import TOLERANCE, assert_close_verbose, grads_of_inputs
from infcl import cal_inf_loss
from infcl.backends import unavailable_reason

NATIVE = unavailable_reason("cpu", torch.device("cpu")) is None
TRITON = unavailable_reason("triton", torch.device("cpu")) is None
BACKENDS = ("reference", "torch") + (("cpu",) if NATIVE else ()) + (("triton",) if TRITON else ())
B = 8


def _features(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, 16, generator=gen), dim=1)
    return q, F.normalize(q + 0.5 * torch.randn(B, 16, generator=gen), dim=1)


def _views():
    """(name, ids view): each a non-contiguous int64 tensor [B] with the values CLASSES."""
    classes = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    meta = torch.zeros(B, 3, dtype=torch.long)
    meta[:, 1] = classes
    strided = torch.zeros(2 * B, dtype=torch.long)
    strided[::2] = classes
    return classes, {
        "meta[:, 1]": meta[:, 1],
        "ids[::2]": strided[::2],
        "expand": torch.tensor([5]).expand(B),
    }


@pytest.mark.parametrize("mode", (None, "mean"))
@pytest.mark.parametrize("backend", BACKENDS)
def test_id_views_give_the_contiguous_ids_loss(backend, mode):
    q, k = _features()
    _, views = _views()
    atol, rtol = TOLERANCE[torch.float32]
    for name, ids in views.items():
        assert not ids.is_contiguous(), name

        def loss(ids_):
            return lambda q_, k_: cal_inf_loss(
                q_, k_, None, 10.0, q_ids=ids_, k_ids=ids_, multi_positive=mode, reduction="none", backend=backend
            )

        ours = grads_of_inputs(loss(ids), (q, k))
        plain = grads_of_inputs(loss(ids.contiguous()), (q, k))
        for what, a, b in zip(("loss", "dq", "dk"), ours, plain):
            assert_close_verbose(a, b, atol, rtol, f"{backend} {name} {what}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_id_views_with_a_guide_and_int32_ids(backend):
    q, k = _features(1)
    classes, views = _views()
    gen = torch.Generator().manual_seed(2)
    guide = (torch.randn(B, 4, generator=gen), torch.randn(B, 4, generator=gen))
    ids = views["meta[:, 1]"]
    expected = cal_inf_loss(q, k, q_ids=classes, k_ids=classes, guide=guide, guide_margin=0.1, backend=backend)
    for given in (ids, ids.to(torch.int32), classes.to(torch.uint8)):
        got = cal_inf_loss(q, k, q_ids=given, k_ids=given, guide=guide, guide_margin=0.1, backend=backend)
        assert_close_verbose(got, expected, *TOLERANCE[torch.float32], f"{backend} {given.dtype}")
