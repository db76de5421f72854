"""retrieval_metrics on the native kernel and the Triton kernels (the interpreter without a GPU): the same
ranks as the torch tiles (integers, exactly equal) and as a float64 argsort truth, with ties, ids,
any_positive, NaN; the shapes cut every block into several ragged tiles of each backend."""

import math

import pytest
import torch

from infcl.backends import unavailable_reason
from infcl.metrics import retrieval_metrics
from test_retrieval import DIRECTIONS, _pairs, assert_same, truth

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = [name for name in ("cpu", "triton") if unavailable_reason(name, DEVICE) is None]
# Rows (and columns) per case: the native kernel's tiles are up to 256 x 512 (more rows than 512 cross a
# key tile; RowTiles cuts 600 rows into 96-row tiles); the interpreter's 32 x 32 (70: three ragged blocks).
SIZE = {"cpu": 600, "triton": 70}

pytestmark = pytest.mark.skipif(not BACKENDS, reason="neither the native nor the Triton backend runs here")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _on_device(*tensors):
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def _ranks(backend, image, text, labels=None, **kwargs):
    image, text, labels = _on_device(image, text, labels)
    for key in ("q_ids", "k_ids"):
        if key in kwargs:
            kwargs[key] = kwargs[key].to(DEVICE)
    got, ranks = retrieval_metrics(image, text, labels, return_ranks=True, backend=backend, **kwargs)
    return got, {name: r.cpu() for name, r in ranks.items()}


def _same_as_torch_tiles(backend, image, text, labels=None, **kwargs):
    got, ranks = _ranks(backend, image, text, labels, **kwargs)
    want_got, want = _ranks("torch", image, text, labels, **kwargs)
    for name in DIRECTIONS:
        assert torch.equal(ranks[name].isnan(), want[name].isnan()), name
        assert torch.equal(ranks[name].nan_to_num(-1), want[name].nan_to_num(-1)), name
    assert list(got) == list(want_got)
    for key, value in want_got.items():
        assert got[key] == value or (math.isnan(got[key]) and math.isnan(value)), key
    return got, ranks


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("permuted", (False, True), ids=("diagonal", "labels"))
def test_matches_torch_tiles_and_truth(backend, dtype, permuted):
    n = SIZE[backend]
    image, text = _pairs(n, n, 9, torch.float64, 1)
    labels = None
    if permuted:
        labels = torch.randperm(n, generator=torch.Generator().manual_seed(2))
        text = torch.empty_like(text).index_copy_(0, labels, text)
    image, text = image.to(dtype), text.to(dtype)
    got, ranks = _same_as_torch_tiles(backend, image, text, labels)
    assert_same(got, ranks, truth(image, text, labels), f"{backend} {dtype}")
    assert 0 < got["image_to_text_R@1"] < 1


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
def test_ties_follow_the_stable_order(backend, dtype):
    """Small integer features: exact products in every dtype, ties everywhere, a repeated text."""
    n = SIZE[backend]
    gen = torch.Generator().manual_seed(3)
    image = torch.randint(-1, 2, (n, 4), generator=gen).to(dtype)
    text = torch.randint(-1, 2, (n, 4), generator=gen).to(dtype)
    text[5] = text[n - 3]
    got, ranks = _same_as_torch_tiles(backend, image, text)
    assert_same(got, ranks, truth(image, text), f"{backend} {dtype}")


def test_ids_leave_duplicates_out(backend):
    n = SIZE[backend]
    gen = torch.Generator().manual_seed(4)
    image = torch.randint(-1, 2, (n, 5), generator=gen).float()
    text = torch.randint(-1, 2, (n, 5), generator=gen).float()
    q_ids = torch.randint(0, n // 6, (n,), generator=gen)
    got, ranks = _same_as_torch_tiles(backend, image, text, q_ids=q_ids, k_ids=q_ids)
    assert_same(got, ranks, truth(image, text, None, q_ids, q_ids), backend)


def test_any_positive_coco(backend):
    """Two captions per image (N != M), an image without a caption and captions without an image."""
    n = SIZE[backend]
    gen = torch.Generator().manual_seed(6)
    image, _ = _pairs(n, n, 7, torch.float64, 7)
    k_ids = torch.arange(2 * n) // 2
    text = image[k_ids] + 1.2 * torch.randn(2 * n, 7, generator=gen, dtype=torch.float64)
    k_ids = torch.where(k_ids == 4, -5, k_ids)  # image 4 has no caption; captions 8, 9 no image
    q_ids = torch.arange(n)
    got, ranks = _same_as_torch_tiles(backend, image, text, q_ids=q_ids, k_ids=k_ids, any_positive=True)
    assert_same(got, ranks, truth(image, text, None, q_ids, k_ids, any_positive=True), backend)
    assert math.isnan(float(ranks["image_to_text"][4])) and int(torch.isnan(ranks["text_to_image"]).sum()) == 2


def test_nan_in_nan_out(backend):
    n = SIZE[backend]
    image, text = _pairs(n, n, 4, torch.float32, 9)
    image[3, 1] = float("nan")
    image[5, 0] = float("inf")
    got, ranks = _same_as_torch_tiles(backend, image, text)
    assert all(math.isnan(v) for v in got.values())
    bad = ranks["image_to_text"].isnan()
    assert bool(bad[3]) and bool(bad[5]) and int(bad.sum()) == 2


def test_reference_is_not_a_backend_of_the_ranks():
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        retrieval_metrics(torch.randn(4, 3), torch.randn(4, 3), backend="reference")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64))
def test_triton_on_a_gpu_at_size(dtype):
    """The Triton kernels on a GPU with their own tiles, 3000 rows: exact ties (integer features; every tile
    must be the same bits in both passes and walks) and random features, against the torch tiles and the truth."""
    gen = torch.Generator().manual_seed(10)
    image = torch.randint(-1, 2, (3000, 8), generator=gen).to(dtype)
    text = torch.randint(-1, 2, (3000, 8), generator=gen).to(dtype)
    got, ranks = _same_as_torch_tiles("triton", image, text)
    assert_same(got, ranks, truth(image, text), f"ties {dtype}")
    if dtype == torch.float64:  # lower precisions round near-ties differently from cuBLAS and the truth
        image, text = _pairs(3000, 3000, 64, torch.float64, 11)
        got, ranks = _same_as_torch_tiles("triton", image.to(dtype), text.to(dtype))
        assert_same(got, ranks, truth(image.to(dtype), text.to(dtype)), f"random {dtype}")
