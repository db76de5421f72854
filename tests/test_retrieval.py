"""retrieval_metrics against a float64 argsort truth of the whole score matrix, exactly rounded (and open_clip's
own get_clip_metrics), ties, ids, any_positive, NaN, bad input, and the ring of 2 gloo ranks."""

import ast
import importlib.util
import math
import os

import numpy as np
import pytest
import torch

from helpers.distributed import launch, results_by_ring
from helpers.exact_scores import truth_scores
from infcl.backends.torch_tiles import TorchTilesBackend
from infcl.metrics import retrieval_metrics
from workers.retrieval_ring_worker import CASES, MAIN_WORLD, RINGS, ROUTES, global_inputs

DIRECTIONS = ("image_to_text", "text_to_image")
# (tile_q, tile_k): the default tiles (one tile at these sizes) and tiles that cut every block unevenly.
TILES = ((None, None), (7, 13))


@pytest.fixture(params=TILES, ids=lambda t: f"tiles{t[0]}x{t[1]}")
def tiles(request):
    """The backend these tests pass: the torch tiles at these sizes ("auto" would run the native kernel)."""
    return TorchTilesBackend(*request.param)


def truth_ranks(scores, positive, excluded):
    """Per row, the 0-based position of its first positive in a stable descending sort of its scores over the
    columns not excluded (float64, materialized); NaN for a row without a positive."""
    s = scores.to(torch.float64).masked_fill(excluded, float("-inf"))  # excluded: sorted past every score
    order = torch.argsort(s, dim=1, descending=True, stable=True)
    hit = positive.gather(1, order)
    first = torch.where(hit.any(dim=1), hit.to(torch.int8).argmax(dim=1).to(torch.float64), float("nan"))
    return first


def truth(image, text, labels=None, q_ids=None, k_ids=None, any_positive=False):
    """(i2t ranks, t2i ranks) of S = image @ text.T, exactly rounded in float64 (equal texts tie wherever they
    sit), positives and exclusions as documented."""
    scores = truth_scores(image, text)
    n, m = scores.shape
    same = torch.zeros(n, m, dtype=torch.bool) if q_ids is None else q_ids[:, None] == k_ids[None, :]
    if any_positive:
        positive, excluded = same, torch.zeros_like(same)
    else:
        cols = torch.arange(n) if labels is None else labels
        positive = torch.zeros(n, m, dtype=torch.bool)
        positive[torch.arange(n), cols] = True
        excluded = same & ~positive
    return truth_ranks(scores, positive, excluded), truth_ranks(scores.T, positive.T, excluded.T)


def truth_metrics(ranks, ks=(1, 5, 10)):
    """open_clip's formulas (numpy) on the ranks of the rows that have a positive."""
    out = {}
    for name, r in zip(DIRECTIONS, ranks):
        preds = r[~torch.isnan(r)].numpy()
        out[f"{name}_mean_rank"] = preds.mean() + 1
        out[f"{name}_median_rank"] = np.floor(np.median(preds)) + 1
        for k in ks:
            out[f"{name}_R@{k}"] = np.mean(preds < k)
    return out


def assert_same(got, ranks, want_ranks, what=""):
    for name, want in zip(DIRECTIONS, want_ranks):
        assert torch.equal(torch.isnan(ranks[name]), torch.isnan(want)), f"{what} {name} NaN rows"
        diff = (ranks[name] != want) & ~torch.isnan(want)
        assert not bool(diff.any()), (
            f"{what} {name}: rows {diff.nonzero().flatten()[:8].tolist()} ranks "
            f"{ranks[name][diff][:8].tolist()} != {want[diff][:8].tolist()}"
        )
    want_metrics = truth_metrics(want_ranks)
    assert list(got) == list(want_metrics), what
    for key, value in want_metrics.items():
        assert got[key] == pytest.approx(float(value), rel=1e-12, abs=0), f"{what} {key}"


def _pairs(n, m, d, dtype, seed, noise=1.5):
    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(n, d, generator=gen, dtype=torch.float64)
    text = image[torch.arange(m) % n] + noise * torch.randn(m, d, generator=gen, dtype=torch.float64)
    return image.to(dtype), text.to(dtype)


@pytest.mark.parametrize("permuted", (False, True), ids=("diagonal", "labels"))
def test_matches_argsort_truth(tiles, permuted):
    image, text = _pairs(41, 41, 9, torch.float64, 1)
    labels = None
    if permuted:
        labels = torch.randperm(41, generator=torch.Generator().manual_seed(2))
        text = torch.empty_like(text).index_copy_(0, labels, text)  # image i's partner is text labels[i]
    got, ranks = retrieval_metrics(image, text, labels, return_ranks=True, backend=tiles)
    assert_same(got, ranks, truth(image, text, labels), "float64")
    assert 0 < got["image_to_text_R@1"] < 1 and got["image_to_text_mean_rank"] > 2  # neither trivial case


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16, torch.float64))
def test_ties_follow_the_stable_order(tiles, dtype):
    """Small integer features: every product is exact in every dtype, so scores tie everywhere (and
    texts repeat); a tie counts as ahead only for a lower column (row) index."""
    gen = torch.Generator().manual_seed(3)
    image = torch.randint(-1, 2, (37, 4), generator=gen).to(dtype)
    text = torch.randint(-1, 2, (37, 4), generator=gen).to(dtype)
    text[5] = text[20]
    got, ranks = retrieval_metrics(image, text, return_ranks=True, backend=tiles)
    want = truth(image, text)
    assert_same(got, ranks, want, str(dtype))
    scores = truth_scores(image, text)
    assert int((scores == scores.diagonal()[:, None]).sum()) > 3 * 37, "the case must hold ties beside the diagonal"


@pytest.mark.parametrize("tile_q, tile_k", ((4, 4), (3, 5), (7, 10)))
def test_rounded_duplicates_tie_across_ragged_tiles(tile_q, tile_k):
    """Random unit features (rounded float32 scores) with a text repeated in another tile, ragged ones
    included: the copy's score equals the original's whatever the tile's shape (a BLAS may sum a ragged
    tile's dot products in another order), so it is ahead of the original only when its index is lower."""
    tiles = TorchTilesBackend(tile_q, tile_k)
    gen = torch.Generator().manual_seed(7)
    n = 21  # every block ends in a ragged tile of one row and one column (MKL's sgemm sums those otherwise)
    image = torch.nn.functional.normalize(torch.randn(n, 32, generator=gen), dim=1)
    text = torch.nn.functional.normalize(image + 0.8 * torch.randn(n, 32, generator=gen), dim=1)
    for original, copy in ((0, n - 1), (9, n - 1), (n - 2, 1), (3, 12)):
        repeated = text.clone()
        repeated[copy] = repeated[original]
        got, ranks = retrieval_metrics(image, repeated, return_ranks=True, backend=tiles)
        assert_same(got, ranks, truth(image, repeated), f"text {original} repeated at {copy}")


def test_ids_leave_duplicates_out(tiles):
    """A column with the row's id other than its positive is not counted against it, either direction."""
    image, text = _pairs(30, 30, 5, torch.float64, 4)
    text[7] = text[3]  # an exact duplicate caption
    gen = torch.Generator().manual_seed(5)
    q_ids = torch.randint(0, 8, (30,), generator=gen)
    k_ids = q_ids.clone()
    got, ranks = retrieval_metrics(image, text, q_ids=q_ids, k_ids=k_ids, return_ranks=True, backend=tiles)
    assert_same(got, ranks, truth(image, text, None, q_ids, k_ids), "ids")
    plain = retrieval_metrics(image, text, return_ranks=True, backend=tiles)[1]
    assert bool((ranks["image_to_text"] < plain["image_to_text"]).any()), "ids must change some rank"


def test_any_positive_coco(tiles):
    """Five captions per image (N != M), some captions and images without a partner: the best-ranked
    positive counts; rows without a positive are NaN and left out."""
    gen = torch.Generator().manual_seed(6)
    image, _ = _pairs(12, 12, 7, torch.float64, 7)
    k_ids = torch.arange(60) // 5
    text = image[k_ids] + 1.2 * torch.randn(60, 7, generator=gen, dtype=torch.float64)
    k_ids = torch.where(k_ids == 4, 99, k_ids)  # image 4 has no caption, captions 20..24 no image
    q_ids = torch.arange(12)
    got, ranks = retrieval_metrics(
        image, text, q_ids=q_ids, k_ids=k_ids, any_positive=True, return_ranks=True, backend=tiles
    )
    want = truth(image, text, None, q_ids, k_ids, any_positive=True)
    assert_same(got, ranks, want, "any_positive")
    assert math.isnan(float(ranks["image_to_text"][4])) and int(torch.isnan(ranks["text_to_image"]).sum()) == 5


def _open_clip_get_clip_metrics():
    """open_clip's own get_clip_metrics, taken from open_clip_train/train.py by its syntax tree (the module
    itself imports torchvision, which does not import beside this CPU torch)."""
    spec = importlib.util.find_spec("open_clip_train")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("open_clip_train is not installed")
    path = os.path.join(spec.submodule_search_locations[0], "train.py")
    tree = ast.parse(open(path).read())
    fn = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "get_clip_metrics"]
    if not fn:
        pytest.skip("this open_clip_train has no get_clip_metrics")
    namespace = {"torch": torch, "np": np}
    exec(compile(ast.Module(body=fn, type_ignores=[]), path, "exec"), namespace)
    return namespace["get_clip_metrics"]


def test_matches_open_clip_get_clip_metrics():
    image, text = _pairs(64, 64, 16, torch.float32, 8)
    want = _open_clip_get_clip_metrics()(image, text, 1.0)
    got = retrieval_metrics(image, text)
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(float(value), rel=1e-12, abs=0), key


def test_nan_in_nan_out():
    image, text = _pairs(20, 20, 4, torch.float32, 9)
    image[3, 1] = float("nan")
    got, ranks = retrieval_metrics(image, text, return_ranks=True)
    assert all(math.isnan(v) for v in got.values())
    assert math.isnan(float(ranks["image_to_text"][3])) and not math.isnan(float(ranks["image_to_text"][2]))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"image": torch.randn(4, 3), "text": torch.randn(4, 5)}, ValueError, "image and text must have the same"),
        ({"text": torch.randn(4, 3).double()}, TypeError, "same dtype"),
        ({"ks": (1, 0)}, ValueError, "ks must be"),
        ({"ks": ()}, ValueError, "ks must be"),
        ({"any_positive": True}, ValueError, "any_positive=True needs q_ids"),
        ({"any_positive": 1}, TypeError, "any_positive must be a bool"),
        ({"labels": torch.tensor([0, 0, 1, 2])}, ValueError, "permutation"),
        ({"q_ids": torch.arange(4)}, ValueError, "q_ids was given without k_ids"),
        ({"backend": "reference"}, NotImplementedError, "backend='reference'"),
        ({"backend": "gpu"}, ValueError, "backend must be one of"),
        ({"text": torch.randn(5, 3)}, ValueError, "as many image rows as text rows"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = {"image": torch.randn(4, 3), "text": torch.randn(4, 3), **kwargs}
    with pytest.raises(error, match=match):
        retrieval_metrics(args.pop("image"), args.pop("text"), **args)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    outcomes = launch(
        MAIN_WORLD,
        "workers.retrieval_ring_worker",
        str(tmp_path_factory.mktemp("retrieval")),
        pg_timeout_s=60.0,
        deadline_s=170.0,
    )
    return results_by_ring(outcomes, RINGS)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ring_of_two_gives_the_global_metrics_on_every_rank(spawned, case, route):
    image, text, labels, q_ids, k_ids = global_inputs(case)
    want = truth(image, text, labels, q_ids, k_ids, case.any_positive)
    per_rank = spawned(2)
    key = f"{case.name}/{route}"
    for results in per_rank:
        assert results[key]["metrics"] == per_rank[0][key]["metrics"], "the same dict on every rank"
    ranks = {name: torch.cat([r[key]["ranks"][name] for r in per_rank]) for name in DIRECTIONS}
    assert_same(per_rank[0][key]["metrics"], ranks, want, key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_cuda_matches_truth(dtype):
    """The torch tiles on a GPU (its own tile sizes): ties (exact integer scores) and random features."""
    gen = torch.Generator().manual_seed(10)
    image = torch.randint(-1, 2, (3000, 8), generator=gen).to(dtype)
    text = torch.randint(-1, 2, (3000, 8), generator=gen).to(dtype)
    got, ranks = retrieval_metrics(image.cuda(), text.cuda(), return_ranks=True)
    assert_same(got, {k: v.cpu() for k, v in ranks.items()}, truth(image, text), "cuda ties")
    image, text = _pairs(5000, 5000, 32, torch.float64, 11)
    got, ranks = retrieval_metrics(image.cuda(), text.cuda(), return_ranks=True)
    assert_same(got, {k: v.cpu() for k, v in ranks.items()}, truth(image, text), "cuda float64")
