"""The sentence-transformers objectives (infcl.sentence_transformers.objective) on random embeddings.

sentence-transformers' own classes compute the loss of given embeddings (MultipleNegativesRankingLoss's
``compute_loss_from_embeddings``, CachedGISTEmbedLoss's ``calculate_loss``): in float64 they are an exact
truth, so every option is checked here to float64 round-off, on embeddings far from the tiny models'
(unit-norm, spread in every direction, guide positives of both signs for GIST's relative margin).
The model-level comparisons (fp32, 1e-4) are in tests/test_sentence_transformers.py.
"""

import itertools
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("sentence_transformers")

from sentence_transformers import util  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

import infcl.sentence_transformers as infcl_losses  # noqa: E402
from helpers.st_models import tiny_model  # noqa: E402
from helpers.support import assert_close_verbose, assert_no_worse, tiled_backends  # noqa: E402
from infcl.backends.torch_tiles import TorchTilesBackend  # noqa: E402

BATCH = 11
DIM = 6
REL_TOL = 1e-10  # float64 against float64: round-off only
EXTRA_DIRECTIONS = ("query_to_query", "doc_to_query", "doc_to_doc")
DIRECTION_SETS = [("query_to_doc",) + extra for r in range(4) for extra in itertools.combinations(EXTRA_DIRECTIONS, r)]
HARDNESS = {
    "none": (None, 0.0),
    "in_batch": ("in_batch_negatives", 9.0),
    "hard": ("hard_negatives", 5.0),
    "all": ("all_negatives", 3.0),
}
NEGATIVES = (0, 1, 3)
# Tiles smaller than the padded calls' blocks, so masks and positives cut across tile edges.
SMALL_TILES = (4, 9)


@pytest.fixture(scope="module")
def model():
    return tiny_model()  # the classes need a model with a tokenizer; the embeddings here are random


def embeddings(columns, seed, dim=DIM, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, dim, generator=gen, dtype=dtype) for _ in range(columns)]


def loss_and_grads(fn, inputs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    loss = fn(leaves)
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), grads


def assert_same(ours, theirs, what):
    assert_close_verbose(ours[0], theirs[0], 0.0, REL_TOL, what=f"{what} loss")
    for i, (g, ref) in enumerate(zip(ours[1], theirs[1])):
        assert_close_verbose(g, ref, REL_TOL * float(ref.abs().max()), REL_TOL, what=f"{what} grad of column {i}")


def mnrl(module, model, tiles=SMALL_TILES, **kwargs):
    if module is infcl_losses:
        kwargs["backend"] = TorchTilesBackend(*tiles)
    logging.disable(logging.WARNING)  # sentence-transformers warns about hardness_mode without strength
    try:
        return module.MultipleNegativesRankingLoss(model, **kwargs)
    finally:
        logging.disable(logging.NOTSET)


def compare_mnrl(model, columns, seed, **kwargs):
    inputs = embeddings(columns, seed)
    theirs = loss_and_grads(lambda e: mnrl(st_losses, model, **kwargs).compute_loss_from_embeddings(e, None), inputs)
    ours = loss_and_grads(lambda e: mnrl(infcl_losses, model, **kwargs).compute_loss_from_embeddings(e, None), inputs)
    assert_same(ours, theirs, what=str(kwargs))


@pytest.mark.parametrize("hardness", HARDNESS)
@pytest.mark.parametrize("directions", DIRECTION_SETS, ids=lambda d: "+".join(x.replace("_to_", "2") for x in d))
@pytest.mark.parametrize("negatives", NEGATIVES)
def test_joint_directions_and_hardness(model, negatives, directions, hardness):
    mode, strength = HARDNESS[hardness]
    compare_mnrl(
        model, 2 + negatives, seed=negatives, directions=directions, hardness_mode=mode, hardness_strength=strength
    )


@pytest.mark.parametrize("hardness", HARDNESS)
@pytest.mark.parametrize("negatives", NEGATIVES)
def test_per_direction_with_hardness(model, negatives, hardness):
    mode, strength = HARDNESS[hardness]
    compare_mnrl(
        model,
        2 + negatives,
        seed=10 + negatives,
        directions=("query_to_doc", "doc_to_query"),
        partition_mode="per_direction",
        hardness_mode=mode,
        hardness_strength=strength,
    )


@pytest.mark.parametrize("hardness", ["in_batch", "all"])
def test_dot_product_and_another_scale(model, hardness):
    """The hardness penalty is alpha * stop_grad(similarity), whatever the similarity and the scale."""
    mode, strength = HARDNESS[hardness]
    compare_mnrl(
        model,
        4,
        seed=20,
        similarity_fct=util.dot_score,
        scale=0.7,
        directions=DIRECTION_SETS[-1],
        hardness_mode=mode,
        hardness_strength=strength,
    )


# ---- GIST ------------------------------------------------------------------------------------------

MARGINS = {
    "absolute-0": ("absolute", 0.0),
    "absolute-0.3": ("absolute", 0.3),
    "relative-0.4": ("relative", 0.4),
    "relative-neg": ("relative", -0.3),
}
CONTRAST = {"both": (True, True), "anchors": (True, False), "positives": (False, True), "neither": (False, False)}
GUIDE_DIM = 5


def gist(module, model, tiles=SMALL_TILES, **kwargs):
    if module is infcl_losses:
        kwargs["backend"] = TorchTilesBackend(*tiles)
    # One mini-batch: sentence-transformers' calculate_loss then scores the whole batch at once.
    return module.CachedGISTEmbedLoss(model, model, mini_batch_size=BATCH, **kwargs)


@pytest.mark.parametrize("contrast", CONTRAST)
@pytest.mark.parametrize("margin", MARGINS)
@pytest.mark.parametrize("negatives", NEGATIVES)
def test_gist(model, negatives, margin, contrast):
    strategy, value = MARGINS[margin]
    anchors, positives = CONTRAST[contrast]
    kwargs = dict(
        margin_strategy=strategy, margin=value, contrast_anchors=anchors, contrast_positives=positives, temperature=0.1
    )
    inputs = embeddings(2 + negatives, seed=30 + negatives)
    guides = embeddings(2 + negatives, seed=40 + negatives, dim=GUIDE_DIM)
    g = util.cos_sim(guides[0], guides[1])
    positive = g.diagonal()
    assert (positive < 0).any() and (positive > 0).any(), "the relative rule needs guide positives of both signs"
    masked = g > (positive - (value if strategy == "absolute" else positive.abs() * value))[:, None]
    assert 0 < int(masked.sum()) - int(masked.diagonal().sum()) < BATCH * (BATCH - 1), "the guide must mask some"

    def run(module):
        loss = gist(module, model, **kwargs)
        return loss_and_grads(lambda e: loss.calculate_loss([[x] for x in e], [[x] for x in guides]), inputs)

    assert_same(run(infcl_losses), run(st_losses), what=f"GIST {kwargs}")


# ---- memory: nothing B x B ---------------------------------------------------------------------------

MEMORY_BATCH = 100
MEMORY_DIM = 2  # small, so that every O(B * D) tensor (keys of every block, padded) stays below B * B elements
MEMORY_TILES = (32, 64)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensor(fn, inputs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    with LargestTensor() as probe:
        fn(leaves).backward()
    return probe.numel


@pytest.mark.parametrize("loss", ["gte-in-batch-hardness", "gist"])
def test_no_tensor_has_batch_squared_elements(model, loss):
    gen = torch.Generator().manual_seed(50)
    inputs = [torch.randn(MEMORY_BATCH, MEMORY_DIM, generator=gen) for _ in range(5)]  # 3 negative columns
    guides = [torch.randn(MEMORY_BATCH, MEMORY_DIM, generator=gen) for _ in range(5)]
    if loss == "gist":

        def run(module):
            objective = gist(module, model, tiles=MEMORY_TILES, margin=0.1)
            objective.mini_batch_size = MEMORY_BATCH
            return lambda e: objective.calculate_loss([[x] for x in e], [[x] for x in guides])
    else:

        def run(module):
            objective = mnrl(
                module,
                model,
                tiles=MEMORY_TILES,
                directions=DIRECTION_SETS[-1],
                hardness_mode="in_batch_negatives",
                hardness_strength=9.0,
            )
            return lambda e: objective.compute_loss_from_embeddings(e, None)

    square = MEMORY_BATCH * MEMORY_BATCH
    assert largest_tensor(run(st_losses), inputs) >= square, "the probe must see sentence-transformers' B x N block"
    assert largest_tensor(run(infcl_losses), inputs) < square


def confident_triplets(dim=64, noise=0.05, seed=3):
    """Unit anchors, positives close to them, unrelated negatives: rows whose loss is ~1e-6 .. 1e-3."""
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randn(BATCH, dim, generator=gen, dtype=torch.float64)
    positives = (
        anchors
        + noise
        * anchors.norm(dim=1, keepdim=True)
        * torch.randn(BATCH, dim, generator=gen, dtype=torch.float64)
        / dim**0.5
    )
    negatives = torch.randn(BATCH, dim, generator=gen, dtype=torch.float64)
    return [anchors, positives, negatives]


@pytest.mark.parametrize("backend", tiled_backends())
@pytest.mark.parametrize("hardness", ["in_batch", "all"])
def test_in_batch_hardness_confident_rows_keep_their_digits(model, backend, hardness):
    """float32, rows whose positive dominates (the boosted tiles' r_i tiny): no worse than sentence-transformers'
    own float32 loss against its float64 truth."""
    mode, strength = HARDNESS[hardness]
    inputs = confident_triplets()

    def run(module, dtype, **extra):
        loss = mnrl(module, model, hardness_mode=mode, hardness_strength=strength)
        if module is infcl_losses:
            loss.backend = TorchTilesBackend(*SMALL_TILES) if backend == "torch" else backend
        return loss_and_grads(lambda e: loss.compute_loss_from_embeddings(e, None), [x.to(dtype) for x in inputs])

    truth, vanilla, ours = (
        run(st_losses, torch.float64),
        run(st_losses, torch.float32),
        run(infcl_losses, torch.float32),
    )
    assert 1e-7 < float(truth[0]) < 1e-2, f"not the confident regime: loss {float(truth[0])}"
    assert_no_worse(ours[0], vanilla[0], truth[0], 0.0, 1e-5, what=f"{hardness} loss")
    for i, (g, lowp, ref) in enumerate(zip(ours[1], vanilla[1], truth[1])):
        assert_no_worse(g, lowp, ref, 1e-5 * float(ref.abs().max()), 1e-5, what=f"{hardness} grad of column {i}")
