"""infcl.sentence_transformers against sentence-transformers' own loss classes.

Every comparison runs both losses on the same tiny random-init BERT SentenceTransformer (built
offline, tests/helpers/st_models.py) and batch, and checks the loss and every parameter gradient to 1e-4
relative (fp32). The model is in eval mode unless a test is about dropout.
"""

import importlib.util
import inspect
import math
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers import __version__ as st_version  # noqa: E402
from sentence_transformers import util  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

import infcl.sentence_transformers as infcl_losses  # noqa: E402
from helpers.distributed import REPO_ROOT, describe, launch  # noqa: E402
from helpers.st_models import batch, loss_and_grads, tiny_model  # noqa: E402
from helpers.support import assert_close_verbose  # noqa: E402
from workers.st_worker import CASES, UNEVEN_BATCHES  # noqa: E402

CLASSES = (
    "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesRankingLoss",
    "MultipleNegativesSymmetricRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
)
BATCH = 7
MINI_BATCH = 3  # does not divide BATCH: the last mini-batch is short
COLUMNS = {"pairs": 2, "triplets": 3, "two-negatives": 4}
SIMILARITIES = {"cos_sim": (util.cos_sim, 20.0), "dot_score": (util.dot_score, 1.0)}
REL_TOL = 1e-4
# Gradients that are zero in exact arithmetic (BERT's attention key bias: softmax ignores a shift)
# come out as ~1e-11 round-off; they are held to this fraction of the largest gradient instead.
ZERO_GRAD_FRACTION = 1e-6
SEED = 1234
EXAMPLE = os.path.join(REPO_ROOT, "examples", "train_sentence_transformer.py")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model is tiny: with more than one thread the ops spend their time waking threads up
    (seconds per test on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    model = tiny_model()
    model.eval()
    return model


def make(module, name, model, **kwargs):
    if module is infcl_losses:
        kwargs.setdefault("backend", "torch")
    if "Cached" in name:
        kwargs.setdefault("mini_batch_size", MINI_BATCH)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the symmetric classes are deprecated in both
        return getattr(module, name)(model, **kwargs)


def assert_same(actual, expected, what=""):
    """Loss and gradients of ours (actual) and sentence-transformers' (expected) within REL_TOL."""
    (loss, grads), (ref_loss, ref_grads) = actual, expected
    assert_close_verbose(loss, ref_loss, 0.0, REL_TOL, what=f"{what} loss")
    assert grads.keys() == ref_grads.keys(), f"{what}: different parameters got gradients"
    largest = max(g.abs().max() for g in ref_grads.values())
    for name, ref in ref_grads.items():
        atol = REL_TOL * max(ref.abs().max(), ZERO_GRAD_FRACTION * largest)
        assert_close_verbose(grads[name], ref, float(atol), REL_TOL, what=f"{what} grad of {name}")


def compare(model, name, columns, seed=1, **kwargs):
    features = batch(model, BATCH, columns, seed)
    theirs = loss_and_grads(make(st_losses, name, model, **kwargs), model, features)
    ours = loss_and_grads(make(infcl_losses, name, model, **kwargs), model, features)
    assert_same(ours, theirs, what=name)
    return ours


# ---- the same loss and gradients ---------------------------------------------------------------


@pytest.mark.parametrize("similarity", SIMILARITIES)
@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("name", CLASSES)
def test_matches_sentence_transformers(model, name, columns, similarity):
    fct, scale = SIMILARITIES[similarity]
    compare(model, name, COLUMNS[columns], similarity_fct=fct, scale=scale)


@pytest.mark.parametrize("partition_mode", ["joint", "per_direction"])
@pytest.mark.parametrize("columns", ["pairs", "two-negatives"])
@pytest.mark.parametrize("name", CLASSES[:2])
def test_both_directions(model, name, columns, partition_mode):
    compare(model, name, COLUMNS[columns], directions=("doc_to_query", "query_to_doc"), partition_mode=partition_mode)


GTE_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
# hardness_mode -> the strength the papers use (sentence-transformers' docstring); 0 for none.
HARDNESS = {None: 0.0, "in_batch_negatives": 9.0, "hard_negatives": 5.0, "all_negatives": 3.0}


@pytest.mark.parametrize("hardness_mode", HARDNESS)
@pytest.mark.parametrize(
    "directions",
    [GTE_DIRECTIONS, ("query_to_doc", "query_to_query"), ("query_to_doc", "doc_to_doc")],
    ids=["gte", "q2d+q2q", "q2d+d2d"],
)
@pytest.mark.parametrize("columns", ["pairs", "two-negatives"])
@pytest.mark.parametrize("name", CLASSES[:2])
def test_same_type_directions_and_hardness(model, name, columns, directions, hardness_mode):
    """query_to_query / doc_to_doc (their self and own-document entries left out) and every hardness
    mode, one joint softmax; every direction subset and option on random embeddings: tests/test_st_objective.py."""
    compare(
        model,
        name,
        COLUMNS[columns],
        directions=directions,
        hardness_mode=hardness_mode,
        hardness_strength=HARDNESS[hardness_mode],
    )


@pytest.mark.parametrize("hardness_mode", list(HARDNESS)[1:])
@pytest.mark.parametrize("columns", ["pairs", "two-negatives"])
@pytest.mark.parametrize("name", CLASSES[:2])
def test_hardness_per_direction(model, name, columns, hardness_mode):
    compare(
        model,
        name,
        COLUMNS[columns],
        directions=("query_to_doc", "doc_to_query"),
        partition_mode="per_direction",
        hardness_mode=hardness_mode,
        hardness_strength=HARDNESS[hardness_mode],
    )


def test_hardness_with_dot_product(model):
    compare(
        model,
        CLASSES[1],
        4,
        similarity_fct=util.dot_score,
        scale=1.0,
        directions=GTE_DIRECTIONS,
        hardness_mode="all_negatives",
        hardness_strength=3.0,
    )


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_backend_without_masks_runs_the_masked_calls_on_torch(model, backend):
    """backend= names what the plain calls run on; the calls with ids or a guide, which that backend cannot
    run, go to the torch tiles instead of raising."""
    from infcl.backends import unavailable_reason

    why = unavailable_reason(backend, torch.device("cpu"))
    if why is not None:
        pytest.skip(why)
    features = batch(model, BATCH, 3, seed=6)
    kwargs = dict(directions=GTE_DIRECTIONS, hardness_mode="in_batch_negatives", hardness_strength=9.0)
    theirs = loss_and_grads(make(st_losses, CLASSES[0], model, **kwargs), model, features)
    ours = loss_and_grads(make(infcl_losses, CLASSES[0], model, backend=backend, **kwargs), model, features)
    assert_same(ours, theirs, what=f"backend={backend}")


# ---- GISTEmbedLoss -------------------------------------------------------------------------------

GIST_CLASSES = ("GISTEmbedLoss", "CachedGISTEmbedLoss")
# The tiny guide's similarities lie in ~[0.75, 0.99]: these margins leave out some in-batch candidates, not all.
GIST_MARGINS = {
    "absolute-0": ("absolute", 0.0),
    "absolute-0.02": ("absolute", 0.02),
    "relative-0.02": ("relative", 0.02),
    "relative-neg": ("relative", -0.01),
    # Above every guide similarity (<= 1): the rule leaves nothing out, not even a row's own anchor or positive
    # in the anchor-anchor and positive-positive blocks, which sentence-transformers 6.3 leaves out by index.
    "absolute-neg": ("absolute", -0.3),
}
ST_VERSION = tuple(int(part) for part in st_version.split(".")[:2])
GIST_CONTRAST = {"both": (True, True), "anchors": (True, False), "positives": (False, True), "neither": (False, False)}


@pytest.fixture(scope="module")
def guide():
    """A guide that differs from the model (another random init)."""
    guide = tiny_model(seed=7)
    guide.eval()
    return guide


@pytest.mark.parametrize("contrast", GIST_CONTRAST)
@pytest.mark.parametrize("margin", GIST_MARGINS)
@pytest.mark.parametrize("columns", ["pairs", "triplets"])
@pytest.mark.parametrize("name", GIST_CLASSES)
def test_gist_matches_sentence_transformers(model, guide, name, columns, margin, contrast):
    if margin == "absolute-neg" and contrast != "neither" and ST_VERSION < (6, 3):
        pytest.skip("sentence-transformers before 6.3 keeps a row's own anchor / positive as its negative")
    strategy, value = GIST_MARGINS[margin]
    anchors, positives = GIST_CONTRAST[contrast]
    compare(
        model,
        name,
        COLUMNS[columns],
        guide=guide,
        margin_strategy=strategy,
        margin=value,
        contrast_anchors=anchors,
        contrast_positives=positives,
    )


@pytest.mark.parametrize("name", GIST_CLASSES)
def test_matryoshka_wraps_gist(model, guide, name):
    """MatryoshkaLoss truncates the embeddings GIST's loss gets (the cached one through calculate_loss)."""
    features = batch(model, BATCH, 3, seed=4)
    results = [
        loss_and_grads(
            st_losses.MatryoshkaLoss(model, make(module, name, model, guide=guide, margin=0.01), [16, 8, 4]),
            model,
            features,
        )
        for module in (infcl_losses, st_losses)
    ]
    assert_same(*results, what=f"MatryoshkaLoss({name})")


def test_cached_gist_two_negatives_num_tokens_and_retokenized_guide(model):
    """The cached loss takes any number of negatives and mini-batches by token count; a guide with a
    shorter max_seq_length makes both losses decode and re-tokenize for the guide."""
    guide = tiny_model(seed=8)
    guide.eval()
    guide.max_seq_length = 6
    assert make(st_losses, GIST_CLASSES[1], model, guide=guide).must_retokenize
    compare(model, GIST_CLASSES[1], 4, guide=guide, margin=0.01, mini_batch_num_tokens=20)
    compare(model, GIST_CLASSES[0], 3, guide=guide, margin_strategy="relative", margin=0.01, temperature=0.05)


@pytest.mark.parametrize("name", GIST_CLASSES)
def test_gist_dropout_draws_the_same_masks(model, guide, name):
    features = batch(model, BATCH, 3, seed=2)
    model.train()
    try:
        runs = []
        for module in (st_losses, infcl_losses):
            torch.manual_seed(SEED)
            runs.append(loss_and_grads(make(module, name, model, guide=guide, margin=0.01), model, features))
    finally:
        model.eval()
    assert_same(runs[1], runs[0], what=f"{name} with dropout")


def test_mini_batch_num_tokens_model_similarity_and_progress_bar(model, capsys):
    """Mini-batches packed by token count, model.similarity resolved to the model's function, and the
    progress bar over the embedding mini-batches (both passes)."""
    compare(model, CLASSES[1], 3, mini_batch_num_tokens=20, similarity_fct=model.similarity, show_progress_bar=True)
    assert capsys.readouterr().err.count("Embed mini-batches") >= 2 * 3 * 2  # ours and theirs, 3 columns, 2 passes


@pytest.mark.parametrize("name", [CLASSES[0], CLASSES[1], CLASSES[3]])
def test_dropout_draws_the_same_masks_under_the_same_seed(model, name):
    features = batch(model, BATCH, 3, seed=2)
    model.train()
    try:
        runs = {}
        for module, seed in ((st_losses, SEED), (infcl_losses, SEED), (infcl_losses, SEED + 1)):
            torch.manual_seed(seed)
            runs[module.__name__, seed] = loss_and_grads(make(module, name, model), model, features)
    finally:
        model.eval()
    assert_same(runs[infcl_losses.__name__, SEED], runs[st_losses.__name__, SEED], what=f"{name} with dropout")
    other_seed = runs[infcl_losses.__name__, SEED + 1][1]
    assert any(not torch.allclose(g, other_seed[k]) for k, g in runs[st_losses.__name__, SEED][1].items()), (
        "dropout must change the gradients, or this test shows nothing"
    )


def test_no_grad_evaluation(model):
    features = batch(model, BATCH, 3, seed=3)
    with torch.no_grad():
        theirs = make(st_losses, CLASSES[1], model)([dict(f) for f in features], None)
        ours = make(infcl_losses, CLASSES[1], model)([dict(f) for f in features], None)
    assert not ours.requires_grad
    assert_close_verbose(ours, theirs, 0.0, REL_TOL, what="evaluation loss")


def test_matryoshka_wraps_the_cached_loss(model):
    """MatryoshkaLoss decorates a cached loss's calculate_loss: ours keeps that contract."""
    features = batch(model, BATCH, 3, seed=4)
    results = [
        loss_and_grads(st_losses.MatryoshkaLoss(model, make(module, CLASSES[1], model), [16, 8, 4]), model, features)
        for module in (infcl_losses, st_losses)
    ]
    assert_same(*results, what="MatryoshkaLoss")


# ---- the same interface ------------------------------------------------------------------------


@pytest.mark.parametrize("name", CLASSES + GIST_CLASSES)
def test_same_constructor_config_and_citation(model, name):
    # __init__'s: sentence-transformers' @deprecated wraps the symmetric classes' __new__ in (*args, **kwargs).
    ours_params = inspect.signature(getattr(infcl_losses, name).__init__).parameters
    theirs_params = inspect.signature(getattr(st_losses, name).__init__).parameters
    shared = [(p.name, p.default, p.kind) for p in ours_params.values() if p.name not in ("group", "backend")]
    assert shared == [(p.name, p.default, p.kind) for p in theirs_params.values()]
    extra_kinds = [p.kind for p in ours_params.values() if p.name in ("group", "backend")]
    assert extra_kinds == [inspect.Parameter.KEYWORD_ONLY] * 2
    kwargs = {"guide": model} if "GIST" in name else {}
    ours, theirs = make(infcl_losses, name, model, **kwargs), make(st_losses, name, model, **kwargs)
    parents = {"Cached": "CachedMultipleNegativesRankingLoss", "": "MultipleNegativesRankingLoss"}
    parent = name if "GIST" in name else parents["Cached" if "Cached" in name else ""]
    assert isinstance(ours, getattr(st_losses, parent))
    assert ours.get_config_dict() == theirs.get_config_dict()
    assert getattr(ours, "citation", None) == getattr(theirs, "citation", None)  # CachedGISTEmbedLoss has none


def test_unsupported_options_raise(model):
    name = CLASSES[1]
    with pytest.raises(ValueError, match=r"manhattan_sim is not supported.*cos_sim, util\.dot_score"):
        make(infcl_losses, name, model, similarity_fct=util.manhattan_sim)
    with pytest.raises(ValueError, match="needs gather_across_devices=True"):
        make(infcl_losses, name, model, group=object())
    with pytest.raises(ValueError, match="needs gather_across_devices=True"):
        make(infcl_losses, "GISTEmbedLoss", model, guide=model, group=object())
    # sentence-transformers' own checks stay theirs.
    with pytest.raises(ValueError, match="'query_to_doc' direction is required"):
        make(infcl_losses, name, model, directions=("doc_to_query",))
    with pytest.raises(ValueError, match="partition_mode='per_direction' requires every direction"):
        make(infcl_losses, name, model, directions=("query_to_doc", "query_to_query"), partition_mode="per_direction")
    with pytest.raises(ValueError, match="margin_strategy must be 'absolute' or 'relative'"):
        make(infcl_losses, "CachedGISTEmbedLoss", model, guide=model, margin_strategy="ratio")

    loss = make(infcl_losses, name, model)
    loss.similarity_fct = util.euclidean_sim  # delegated to the wrapped loss, checked when the loss runs
    with pytest.raises(ValueError, match="euclidean_sim is not supported"):
        loss(batch(model, BATCH, 2, seed=5), None)
    # hardness_mode without strength has no effect in sentence-transformers either: accepted.
    compare(model, name, 3, hardness_mode="hard_negatives", hardness_strength=0.0)


def test_import_infcl_does_not_import_sentence_transformers():
    code = "import sys, infcl, infcl.gradcache; assert 'sentence_transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})


# ---- across ranks -----------------------------------------------------------------------------


@pytest.mark.distributed
def test_two_gloo_ranks_match_gather_across_devices():
    """Per-rank loss and gradients equal sentence-transformers' with gather_across_devices=True
    (all_gather with gradients) — and with a DDP-wrapped model, its synchronized gradients."""
    with tempfile.TemporaryDirectory() as out_dir:
        outcomes = launch(2, "workers.st_worker", out_dir, deadline_s=240.0)
    assert all(o.returncode == 0 and o.results is not None for o in outcomes), describe(outcomes)
    for outcome in outcomes:
        for case in CASES:
            theirs, ours = outcome.results[case]
            assert_same(ours, theirs, what=f"rank {outcome.rank} {case}")
    # Uneven shards: the batch-size-weighted mean of the ranks' losses is the whole batch's loss.
    for case in ("uneven", "uneven-padded"):
        ours = sum(size * o.results[case][0] for size, o in zip(UNEVEN_BATCHES, outcomes)) / sum(UNEVEN_BATCHES)
        assert_close_verbose(ours, outcomes[0].results[case][1], 0.0, REL_TOL, what=f"{case} shards")


# ---- SentenceTransformerTrainer -----------------------------------------------------------------


def skip_without_training_extras():
    for name in ("datasets", "accelerate"):
        pytest.importorskip(name, reason=f"SentenceTransformerTrainer needs {name} (sentence-transformers[train])")


def test_trainer_trains_with_the_cached_loss():
    skip_without_training_extras()
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from helpers.st_models import sentences

    model = tiny_model(seed=3)
    anchors, positives = sentences(32, 2, seed=6)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as out_dir:
        args = SentenceTransformerTrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=16,
            max_steps=3,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        loss = infcl_losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4, backend="torch")
        dataset = Dataset.from_dict({"anchor": anchors, "positive": positives})
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert len(changed) > len(before) // 2, f"only {changed} changed"


def test_example_script_trains_both_losses_alike():
    """examples/train_sentence_transformer.py at a tiny size: with dropout on, the same per-step losses."""
    skip_without_training_extras()
    spec = importlib.util.spec_from_file_location("train_sentence_transformer", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(
        [
            "--batch-size",
            "32",
            "--mini-batch-size",
            "8",
            "--steps",
            "2",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--vocab",
            "100",
            "--backend",
            "torch",
        ]
    )
    theirs, ours = results = [example.train(name, args) for name in example.LOSSES]
    example.report(results, args)
    assert len(ours["losses"]) == args.steps and all(math.isfinite(x) for x in ours["losses"]), ours
    assert_close_verbose(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), 0.0, REL_TOL, what="losses")
