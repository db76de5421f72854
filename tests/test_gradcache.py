"""GradCache: parameter gradients after ``cache_step`` equal those of one big-batch step.

The big-batch reference here is written by hand (its own slicing, model calls and rep extraction), so
it shares no code with ``infcl.gradcache`` except the loss. With dropout on, the reference runs the
same chunks in the same order from the same seed; GradCache must replay each chunk's RNG on its
second pass to match. With dropout off the reference is a plain un-chunked forward.
"""

import logging
import math
import os
import socket
import tempfile
import traceback
from collections import UserDict
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from helpers.support import TOLERANCE, assert_close_verbose, assert_no_worse
from infcl import GradCache, RandContext, cal_inf_loss, split_vlm_inputs
from infcl.gradcache import auto_chunk, grad_cache
from infcl.gradcache.inputs import get_rep, split_inputs

BATCH = 23  # prime: no chunk size below divides it
FEAT, HIDDEN, EMBED = 6, 16, 8
VOCAB, SEQ = 50, 5
DROPOUT = 0.25
SEED = 1234
# Chunk sizes per input that do not divide BATCH (the last chunk is short), and differ per input.
CHUNKS = (5, 7)
FP32_ATOL, FP32_RTOL = TOLERANCE[torch.float32]


# ---- towers: each knows how to read its own output (the reference must not use infcl's get_rep) ----


class TensorTower(nn.Module):
    """[b, FEAT] -> [b, EMBED], called as model(x)."""

    def __init__(self, p=DROPOUT, feat=FEAT):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(feat, HIDDEN), nn.GELU(), nn.Dropout(p), nn.Linear(HIDDEN, EMBED))

    def forward(self, x):
        return self.net(x)

    @staticmethod
    def rep(out):
        return out


class DictTower(nn.Module):
    """model(tokens=[b, SEQ] long, mask=[b, SEQ] float, pool="mean") -> object with last_hidden_state."""

    def __init__(self, p=DROPOUT):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.drop = nn.Dropout(p)
        self.proj = nn.Linear(HIDDEN, EMBED)

    def forward(self, tokens, mask, pool):
        assert pool == "mean"  # the non-tensor value must reach every chunk unchanged
        x = self.emb(tokens) * mask[..., None]
        pooled = x.sum(1) / mask.sum(1, keepdim=True)
        return SimpleNamespace(last_hidden_state=self.proj(self.drop(x + pooled[:, None])))

    @staticmethod
    def rep(out):
        return out.last_hidden_state[:, 0]


class ListTower(nn.Module):
    """model(a [b, FEAT], b [b, 3]) -> (rep, aux), called as model(*x)."""

    def __init__(self, p=DROPOUT):
        super().__init__()
        self.a = nn.Linear(FEAT, HIDDEN)
        self.b = nn.Linear(3, HIDDEN)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(HIDDEN, EMBED)

    def forward(self, a, b):
        h = self.out(self.drop(torch.tanh(self.a(a) + self.b(b))))
        return h, h.sum()

    @staticmethod
    def rep(out):
        return out[0]


class GroupTower(TensorTower):
    """[b, n, FEAT] -> [b * n, EMBED]: several representations per input row (hard negatives)."""

    def forward(self, x):
        return self.net(x.flatten(0, 1))


class ClipLoss(nn.Module):
    """Symmetric CLIP loss over normalized reps with a learnable temperature (log logit scale)."""

    def __init__(self):
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def forward(self, a, b):
        a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
        return cal_inf_loss(a, b, scale=self.log_scale.exp(), symmetric=True)


def make_input(kind, batch=BATCH, gen=None):
    if kind == "tensor":
        return torch.randn(batch, FEAT, generator=gen)
    if kind == "dict":
        mask = (torch.rand(batch, SEQ, generator=gen) > 0.3).float()
        mask[:, 0] = 1.0
        return {"tokens": torch.randint(0, VOCAB, (batch, SEQ), generator=gen), "mask": mask, "pool": "mean"}
    if kind == "userdict":
        return UserDict(make_input("dict", batch, gen))
    return [torch.randn(batch, FEAT, generator=gen), torch.randn(batch, 3, generator=gen)]


TOWER_OF = {"tensor": TensorTower, "dict": DictTower, "userdict": DictTower, "list": ListTower}


# ---- the hand-written big-batch reference ------------------------------------------------------


def hand_chunks(batch, size):
    """``batch`` (a tensor, a mapping or a list) cut into slices of ``size`` rows by explicit indexing."""
    if torch.is_tensor(batch):
        return [batch[s : s + size] for s in range(0, batch.shape[0], size)]
    if hasattr(batch, "items"):
        rows = batch["tokens"].shape[0]
        return [
            {k: v[s : s + size] if torch.is_tensor(v) else v for k, v in batch.items()} for s in range(0, rows, size)
        ]
    return [[v[s : s + size] for v in batch] for s in range(0, batch[0].shape[0], size)]


def hand_call(model, chunk):
    if torch.is_tensor(chunk):
        return model(chunk)
    if isinstance(chunk, dict):
        return model(**chunk)
    return model(*chunk)


def distinct_params(*modules):
    seen, out = set(), []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def take_grads(params):
    grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    return grads


def big_batch_step(models, batches, chunk_sizes, loss_fn, seed=SEED, autocast_dtype=None):
    """One forward/backward over the whole batch, encoding the same chunks in the same order.

    With ``autocast_dtype`` the forward (encoders and loss) runs under CPU autocast and the backward
    outside it, as PyTorch recommends.
    """
    torch.manual_seed(seed)
    reps = []
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        for model, batch, size in zip(models, batches, chunk_sizes):
            size = size or BATCH * 10  # None: un-chunked
            reps.append(torch.cat([model.rep(hand_call(model, c)) for c in hand_chunks(batch, size)]))
        loss = loss_fn(*reps)
    loss.backward()
    return loss.detach(), take_grads(distinct_params(*models, loss_fn))


def grad_cache_step(models, batches, chunk_sizes, loss_fn, seed=SEED, **kwargs):
    torch.manual_seed(seed)
    loss = GradCache(models, list(chunk_sizes), loss_fn, **kwargs).cache_step(*batches)
    return loss, take_grads(distinct_params(*models, loss_fn))


def assert_grads_close(actual, expected, atol=FP32_ATOL, rtol=FP32_RTOL):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a is not None and e is not None, f"parameter {i}: missing gradient"
        assert e.abs().max() > 0, f"parameter {i}: the reference gradient is zero, the test would be vacuous"
        assert_close_verbose(a, e, atol, rtol, what=f"parameter {i} grad")


# ---- exactness against the big-batch step ------------------------------------------------------


@pytest.mark.parametrize("kind", ["tensor", "dict", "userdict", "list"])
def test_two_towers_match_big_batch_step_with_dropout(kind):
    torch.manual_seed(0)
    models = [TOWER_OF[kind](), TensorTower()]
    loss_fn = ClipLoss()
    batches = [make_input(kind), make_input("tensor")]
    ref_loss, ref = big_batch_step(models, batches, CHUNKS, loss_fn)
    loss, got = grad_cache_step(models, batches, CHUNKS, loss_fn)
    assert_close_verbose(loss, ref_loss, FP32_ATOL, FP32_RTOL, what="loss")
    assert_grads_close(got, ref)  # the last entry is the learnable temperature


def test_dropout_is_replayed_not_redrawn():
    """Guard on the test above: the dropout masks do change the gradient, so a skipped replay fails."""
    torch.manual_seed(0)
    models, loss_fn = [TensorTower(), TensorTower()], ClipLoss()
    batches = [make_input("tensor"), make_input("tensor")]
    _, same_seed = big_batch_step(models, batches, CHUNKS, loss_fn, seed=SEED)
    _, other_seed = big_batch_step(models, batches, CHUNKS, loss_fn, seed=SEED + 1)
    assert not torch.allclose(same_seed[0], other_seed[0], atol=1e-3)


@pytest.mark.parametrize("kind", ["tensor", "dict", "list"])
def test_dropout_off_matches_unchunked_forward(kind):
    torch.manual_seed(1)
    models = [TOWER_OF[kind](p=0.0), TensorTower(p=0.0)]
    loss_fn = ClipLoss()
    batches = [make_input(kind), make_input("tensor")]
    ref_loss, ref = big_batch_step(models, batches, (None, None), loss_fn)
    loss, got = grad_cache_step(models, batches, (4, 9), loss_fn)
    assert_close_verbose(loss, ref_loss, FP32_ATOL, FP32_RTOL, what="loss")
    assert_grads_close(got, ref)


def test_shared_tower_with_hard_negatives():
    """One encoder for queries, positives and a [B, 2, FEAT] group of hard negatives (2 reps per row)."""
    torch.manual_seed(2)
    tower = GroupTower()
    group_size = 2

    class Shared(nn.Module):  # the same parameters behind three call signatures
        def __init__(self):
            super().__init__()
            self.tower = tower

        def forward(self, x):
            return self.tower.net(x)

        rep = staticmethod(TensorTower.rep)

    shared = Shared()
    log_scale = nn.Parameter(torch.tensor(2.0))

    class HardNegLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.log_scale = log_scale

        def forward(self, q, p, n):
            assert n.shape[0] == group_size * q.shape[0]
            return cal_inf_loss(q, torch.cat([p, n]), torch.arange(q.shape[0]), scale=self.log_scale.exp())

    loss_fn = HardNegLoss()
    queries, positives = make_input("tensor"), make_input("tensor")
    negatives = torch.randn(BATCH, group_size, FEAT)
    models = [shared, shared, tower]
    batches = [queries, positives, negatives]
    sizes = (4, 6, 3)
    ref_loss, ref = big_batch_step(models, batches, sizes, loss_fn)
    loss, got = grad_cache_step(models, batches, sizes, loss_fn)
    assert_close_verbose(loss, ref_loss, FP32_ATOL, FP32_RTOL, what="loss")
    assert_grads_close(got, ref)


def test_gradients_accumulate_and_rng_stream_continues():
    """cache_step adds to existing .grad (like backward) and leaves the RNG where the big step would."""
    torch.manual_seed(3)
    models, loss_fn = [TensorTower(), TensorTower()], ClipLoss()
    params = distinct_params(*models, loss_fn)
    batches = [make_input("tensor"), make_input("tensor")]
    big_batch_step(models, batches, CHUNKS, loss_fn)
    after_big = torch.rand(4)
    _, once = grad_cache_step(models, batches, CHUNKS, loss_fn)
    gc = GradCache(models, list(CHUNKS), loss_fn)
    torch.manual_seed(SEED)
    gc(*batches)
    assert torch.equal(torch.rand(4), after_big)
    torch.manual_seed(SEED)
    gc(*batches)
    assert_grads_close(take_grads(params), [2 * g for g in once])


# ---- inputs and representations ----------------------------------------------------------------


def test_split_inputs_structures():
    x = torch.arange(10.0).reshape(5, 2)
    flag = torch.tensor(3.0)
    chunks = split_inputs({"x": x, "flag": flag, "name": "q", "nested": [x[:, 0]]}, 2)
    assert len(chunks) == 3
    assert torch.equal(chunks[2]["x"], x[4:])
    assert chunks[1]["flag"] is flag and chunks[1]["name"] == "q"
    assert torch.equal(chunks[1]["nested"][0], x[2:4, 0])
    pair = split_inputs(([x], {"y": x}), 4)
    assert [tuple(c[0][0].shape) for c in pair] == [(4, 2), (1, 2)] and isinstance(pair[0], tuple)
    with pytest.raises(ValueError, match=r"input\['b'\]: \(4,\)"):
        split_inputs({"a": torch.zeros(5), "b": torch.zeros(4)}, 2)
    with pytest.raises(ValueError, match="chunk_size"):
        split_inputs(x, 0)


def test_get_rep_order():
    a, b, h = torch.ones(2, 3), torch.zeros(2, 3), torch.arange(12.0).reshape(2, 2, 3)
    bert_like = SimpleNamespace(pooler_output=a, last_hidden_state=h)  # pooler = BERT's NSP head
    assert get_rep(a) is a
    assert get_rep(SimpleNamespace(pooler_output=a, sentence_embedding=b, last_hidden_state=h)) is b
    assert get_rep({"sentence_embedding": b, "last_hidden_state": h}) is b
    assert torch.equal(get_rep(bert_like), h[:, 0]), "pooler_output must not be taken unless named"
    assert get_rep(bert_like, "pooler_output") is a
    assert get_rep({"text_embeds": a, "sentence_embedding": b}, "text_embeds") is a, "a named field wins"
    assert get_rep((b, a)) is b
    with pytest.raises(TypeError, match="rep_field='pooler_output'"):
        get_rep(SimpleNamespace(pooler_output=a))
    with pytest.raises(TypeError, match="no tensor 'image_embeds'"):
        get_rep(bert_like, "image_embeds")
    with pytest.raises(TypeError, match="get_rep_fn"):
        get_rep({"logits": a})


def test_rep_field_reaches_grad_cache():
    """GradCache(rep_field=...) back-propagates through the named field, not the default choice."""
    torch.manual_seed(6)

    class BertLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(FEAT, EMBED)
            self.pooler = nn.Linear(EMBED, EMBED)

        def forward(self, x):
            hidden = self.body(x)[:, None].expand(-1, 2, -1)
            return SimpleNamespace(last_hidden_state=hidden, pooler_output=torch.tanh(self.pooler(hidden[:, 0])))

    towers, loss_fn = [BertLike(), TensorTower(p=0.0)], ClipLoss()
    batches = [make_input("tensor"), make_input("tensor")]
    GradCache(towers, 5, loss_fn).cache_step(*batches)
    assert towers[0].pooler.weight.grad is None, "the default must not use the NSP pooler"
    GradCache(towers, 5, loss_fn, rep_field="pooler_output").cache_step(*batches)
    assert towers[0].pooler.weight.grad.abs().max() > 0


def test_get_rep_fn_and_split_input_fn_are_used():
    torch.manual_seed(4)
    models, loss_fn = [ListTower(p=0.0), TensorTower(p=0.0)], ClipLoss()
    batches = [make_input("list"), make_input("tensor")]
    ref_loss, ref = big_batch_step(models, batches, (None, None), loss_fn)
    calls = []

    def split(x, size):
        calls.append(size)
        return split_inputs(x, size)

    def rep(out):
        return out[0] if isinstance(out, tuple) else out

    loss, got = grad_cache_step(models, batches, (6, 6), loss_fn, split_input_fn=split, get_rep_fn=rep)
    assert calls == [6, 6]
    assert_close_verbose(loss, ref_loss, FP32_ATOL, FP32_RTOL, what="loss")
    assert_grads_close(got, ref)


def test_rand_context_replays_and_restores():
    torch.manual_seed(5)
    ctx = RandContext(torch.zeros(1))
    first = torch.rand(3)
    outer_next = torch.rand(3)
    torch.manual_seed(5)
    torch.rand(3)
    with ctx:
        assert torch.equal(torch.rand(3), first)
    assert torch.equal(torch.rand(3), outer_next), "RandContext must not disturb the outer stream"
    with ctx:  # may be replayed again
        assert torch.equal(torch.rand(3), first)
        with pytest.raises(RuntimeError, match="already active"):
            ctx.__enter__()


class _FakeDeviceRNG:
    """The ``torch.cuda``-style RNG API (get/set_rng_state per device) of a stand-in accelerator.

    Registered as ``torch.meta`` in the test below, it makes the "meta" device type look like a GPU
    to RandContext, whose only view of a device RNG is that API, so a CPU-only machine can show what
    happens on a GPU: a model that keeps its parameters on the device and draws dropout there.
    """

    def __init__(self):
        self.generator = torch.Generator().manual_seed(0)

    def get_rng_state(self, device=None):
        return self.generator.get_state()

    def set_rng_state(self, state, device=None):
        self.generator.set_state(state)


class DeviceDropoutTower(nn.Module):
    """Takes CPU inputs and draws its dropout mask from the RNG of the device it lives on.

    The model's "device" is that of its ``home`` buffer (meta here, a GPU in real life), exactly as
    a model that moves its inputs to ``next(self.parameters()).device`` and runs dropout there: the
    inputs never name that device, so only a RandContext that looks at the model replays its RNG.
    """

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(FEAT, EMBED)
        self.register_buffer("home", torch.empty(0, device="meta"))

    def forward(self, x):
        generator = getattr(torch, self.home.device.type).generator
        keep = torch.rand(x.shape[0], EMBED, generator=generator) >= DROPOUT
        return self.net(x) * keep / (1 - DROPOUT)

    rep = staticmethod(TensorTower.rep)


def test_model_device_rng_is_replayed(monkeypatch):
    fake = _FakeDeviceRNG()
    monkeypatch.setattr(torch, "meta", fake, raising=False)
    torch.manual_seed(7)
    models, loss_fn = [DeviceDropoutTower(), TensorTower()], ClipLoss()
    batches = [make_input("tensor"), make_input("tensor")]

    def run(step):
        fake.generator.manual_seed(SEED)
        return step(models, batches, CHUNKS, loss_fn)

    ref_loss, ref = run(big_batch_step)
    loss, got = run(grad_cache_step)
    assert_close_verbose(loss, ref_loss, FP32_ATOL, FP32_RTOL, what="loss")
    assert_grads_close(got, ref)

    # The old RandContext looked at the inputs' devices only: the second pass then draws new masks.
    monkeypatch.setattr(grad_cache, "module_devices", lambda model: [])
    _, inputs_only = run(grad_cache_step)
    assert not torch.allclose(inputs_only[0], ref[0], atol=1e-3), "the device RNG must matter in this test"


class DeviceBatch:
    """A model input type GradCache cannot look into: CPU features plus a tensor on the device the model
    draws its dropout on (meta, standing in for a GPU as above)."""

    def __init__(self, x, home):
        self.x, self.home = x, home


def split_device_batch(batch, size):
    if not isinstance(batch, DeviceBatch):
        return split_inputs(batch, size)
    return [DeviceBatch(x, batch.home) for x in batch.x.split(size)]


class InputDeviceDropoutTower(nn.Module):
    """Draws its dropout mask from the RNG of the device its input names, which only the input knows."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(FEAT, EMBED)

    def forward(self, batch):
        generator = getattr(torch, batch.home.device.type).generator
        keep = torch.rand(batch.x.shape[0], EMBED, generator=generator) >= DROPOUT
        return self.net(batch.x) * keep / (1 - DROPOUT)


class DeviceBatchGradCache(GradCache):
    """luyug's documented extension point: say which tensors a custom input type holds."""

    def get_input_tensors(self, model_input):
        if isinstance(model_input, DeviceBatch):
            return [model_input.x, model_input.home]
        return super().get_input_tensors(model_input)


def test_overridden_get_input_tensors_names_the_rngs_to_replay(monkeypatch):
    fake = _FakeDeviceRNG()
    monkeypatch.setattr(torch, "meta", fake, raising=False)
    torch.manual_seed(10)
    models, loss_fn = [InputDeviceDropoutTower(), TensorTower()], ClipLoss()
    batches = [DeviceBatch(make_input("tensor"), torch.empty(0, device="meta")), make_input("tensor")]
    params = distinct_params(*models, loss_fn)

    fake.generator.manual_seed(SEED)
    torch.manual_seed(SEED)
    reps = [
        torch.cat([models[0](c) for c in split_device_batch(batches[0], CHUNKS[0])]),
        torch.cat([models[1](c) for c in batches[1].split(CHUNKS[1])]),
    ]
    loss_fn(*reps).backward()
    ref = take_grads(params)

    def step(cls):
        fake.generator.manual_seed(SEED)
        torch.manual_seed(SEED)
        cls(models, list(CHUNKS), loss_fn, split_input_fn=split_device_batch).cache_step(*batches)
        return take_grads(params)

    assert_grads_close(step(DeviceBatchGradCache), ref)
    # The default sees no tensor in a DeviceBatch: the device RNG is not replayed and the masks differ.
    assert not torch.allclose(step(GradCache)[0], ref[0], atol=1e-3), "the device RNG must matter in this test"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU stand-in is the test above)")
def test_model_that_moves_cpu_inputs_to_cuda_replays_cuda_dropout():
    class CudaTower(TensorTower):
        def forward(self, x):
            return self.net(x.to(next(self.parameters()).device))

    torch.manual_seed(8)
    models, loss_fn = [CudaTower().cuda(), CudaTower().cuda()], ClipLoss().cuda()
    batches = [make_input("tensor"), make_input("tensor")]  # CPU tensors: they do not name the GPU
    ref_loss, ref = big_batch_step(models, batches, CHUNKS, loss_fn)
    loss, got = grad_cache_step(models, batches, CHUNKS, loss_fn)
    assert_close_verbose(loss, ref_loss, FP32_ATOL, FP32_RTOL, what="loss")
    assert_grads_close(got, ref)


# ---- Qwen-VL batches ---------------------------------------------------------------------------

# Four images with (t, h, w) grids of 4, 8, 8 and 16 patches: pixel rows [0:4], [4:12], [12:20], [20:36].
VLM_GRID = torch.tensor([[1, 2, 2], [1, 2, 4], [2, 2, 2], [1, 4, 4]])
PATCH_DIM = 6  # channels * temporal_patch * patch * patch, flattened as the Qwen processor does


def vlm_batch():
    return {
        "input_ids": torch.arange(4 * 7).reshape(4, 7),
        "attention_mask": torch.ones(4, 7, dtype=torch.long),
        "pixel_values": torch.randn(36, PATCH_DIM),
        "image_grid_thw": VLM_GRID.clone(),
        "return_loss": False,
    }


def test_split_vlm_inputs_one_image_per_sample():
    batch = vlm_batch()
    chunks = split_vlm_inputs(batch, 3)
    assert len(chunks) == 2 and list(chunks[0]) == list(batch)
    assert torch.equal(chunks[0]["pixel_values"], batch["pixel_values"][0:20])
    assert torch.equal(chunks[1]["pixel_values"], batch["pixel_values"][20:36])
    assert torch.equal(chunks[0]["image_grid_thw"], VLM_GRID[0:3])
    assert torch.equal(chunks[1]["image_grid_thw"], VLM_GRID[3:4])
    assert torch.equal(chunks[1]["input_ids"], batch["input_ids"][3:4])
    assert chunks[1]["return_loss"] is False
    pairs = split_vlm_inputs(batch, 2)
    assert [tuple(c["pixel_values"].shape) for c in pairs] == [(12, PATCH_DIM), (24, PATCH_DIM)]
    assert torch.equal(pairs[1]["pixel_values"], batch["pixel_values"][12:36])


def test_split_vlm_inputs_uneven_images_and_videos():
    batch = vlm_batch()
    # Sample 0 has two images, sample 1 is text only, samples 2 and 3 have one each.
    chunks = split_vlm_inputs(batch, 2, images_per_sample=[2, 0, 1, 1])
    assert torch.equal(chunks[0]["pixel_values"], batch["pixel_values"][0:12])
    assert torch.equal(chunks[0]["image_grid_thw"], VLM_GRID[0:2])
    assert torch.equal(chunks[1]["pixel_values"], batch["pixel_values"][12:36])
    video = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "pixel_values_videos": torch.arange(12.0)[:, None],
        "video_grid_thw": torch.tensor([[2, 1, 2], [1, 2, 4]]),
        "second_per_grid_ts": torch.tensor([0.5, 1.0]),
    }
    parts = split_vlm_inputs(video, 1)
    assert torch.equal(parts[1]["pixel_values_videos"], video["pixel_values_videos"][4:12])
    assert torch.equal(parts[1]["second_per_grid_ts"], torch.tensor([1.0]))


def test_split_vlm_inputs_fallbacks_and_errors():
    clip_style = {"input_ids": torch.zeros(5, 3), "pixel_values": torch.zeros(5, 3, 4, 4)}
    assert [c["pixel_values"].shape[0] for c in split_vlm_inputs(clip_style, 2)] == [2, 2, 1]
    assert [c.shape[0] for c in split_vlm_inputs(torch.zeros(5, 2), 3)] == [3, 2]
    bad = vlm_batch()
    bad["pixel_values"] = bad["pixel_values"][:35]
    with pytest.raises(ValueError, match=r"sum\(t\*h\*w\) = 36"):
        split_vlm_inputs(bad, 2)
    with pytest.raises(ValueError, match="images_per_sample"):
        split_vlm_inputs({**vlm_batch(), "input_ids": torch.zeros(3, 7), "attention_mask": torch.ones(3, 7)}, 2)
    with pytest.raises(ValueError, match="images_per_sample"):
        split_vlm_inputs(vlm_batch(), 2, images_per_sample=[1, 1, 1, 2])
    with pytest.raises(ValueError, match=r"\[num_items, 3\]"):
        split_vlm_inputs({**vlm_batch(), "image_grid_thw": VLM_GRID[:, :2]}, 2)


def test_vlm_split_drives_grad_cache():
    """A toy VLM encoder (mean of each image's patches + token embedding) through GradCache."""
    torch.manual_seed(6)

    class ToyVLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Linear(PATCH_DIM, EMBED)
            self.tok = nn.Embedding(64, EMBED)

        def forward(self, input_ids, attention_mask, pixel_values, image_grid_thw, return_loss):
            per_image_patches = self.patch(pixel_values).split(image_grid_thw.prod(1).tolist())
            per_image = torch.stack([p.mean(0) for p in per_image_patches])
            return per_image + self.tok(input_ids).mean(1)

    vlm, text, loss_fn = ToyVLM(), TensorTower(p=0.0), ClipLoss()
    batch, texts = vlm_batch(), torch.randn(4, FEAT)
    torch.manual_seed(SEED)
    loss = loss_fn(vlm(**batch), text(texts))
    loss.backward()
    ref = take_grads(distinct_params(vlm, text, loss_fn))
    gc = GradCache([vlm, text], [3, 3], loss_fn, split_input_fn=split_vlm_inputs)
    got_loss = gc(batch, texts)
    assert_close_verbose(got_loss, loss.detach(), FP32_ATOL, FP32_RTOL, what="loss")
    assert_grads_close(take_grads(distinct_params(vlm, text, loss_fn)), ref)


# ---- mixed precision ---------------------------------------------------------------------------


def fp64_truth(models, batches, loss_fn):
    """Gradients of the un-chunked step in float64 (dropout off), on copies of the modules."""
    import copy

    copies = [copy.deepcopy(m).double() for m in models]
    loss_copy = copy.deepcopy(loss_fn).double()
    doubled = [b.double() if torch.is_tensor(b) else b for b in batches]
    return big_batch_step(copies, doubled, (None, None), loss_copy)[1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_precision_close_to_fp32(dtype):
    torch.manual_seed(7)
    models, loss_fn = [TensorTower(p=0.0), TensorTower(p=0.0)], ClipLoss()
    params = distinct_params(*models, loss_fn)
    batches = [make_input("tensor"), make_input("tensor")]
    truth = fp64_truth(models, batches, loss_fn)
    fp16 = dtype is torch.float16

    def unscaled(run):
        """Run a step (fp16: with a GradScaler), unscale as an optimizer step would, return the grads."""
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if fp16 else None
        run(scaler)
        if scaler is not None:
            opt = torch.optim.SGD(params, lr=0.0)
            scaler.unscale_(opt)
        return take_grads(params)

    def plain(scaler):  # torch's own low-precision big-batch step
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(*(m(b) for m, b in zip(models, batches)))
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def cached(scaler):
        kwargs = {"fp16": True, "scaler": scaler} if fp16 else {"bf16": True}
        GradCache(models, [5, 6], loss_fn, **kwargs).cache_step(*batches)

    torch_lowp, ours = unscaled(plain), unscaled(cached)
    atol, rtol = TOLERANCE[dtype]
    for i, (o, t, ref) in enumerate(zip(ours, torch_lowp, truth)):
        assert torch.isfinite(o).all(), f"parameter {i}: non-finite {dtype} gradient"
        assert_no_worse(o, t, ref, atol, rtol, what=f"{dtype} parameter {i}")


def test_outer_autocast_does_not_break_it():
    """Inside an outer bf16 autocast (as HF Trainer runs), no worse than torch's own bf16 big step.

    Not bitwise equal to it: in one big backward the chunks' gradients meet at autocast's cached bf16
    weight copy and are summed in bf16, while GradCache's per-chunk backward passes sum in fp32.
    """
    torch.manual_seed(8)
    models, loss_fn = [DictTower(p=0.0), TensorTower(p=0.0)], ClipLoss()
    batches = [make_input("dict"), make_input("tensor")]
    truth = fp64_truth(models, batches, loss_fn)
    ref_loss, torch_bf16 = big_batch_step(models, batches, CHUNKS, loss_fn, autocast_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, ours = grad_cache_step(models, batches, CHUNKS, loss_fn)
    assert_close_verbose(loss, ref_loss, FP32_ATOL, FP32_RTOL, what="loss")
    atol, rtol = TOLERANCE[torch.bfloat16]
    for i, (o, t, ref) in enumerate(zip(ours, torch_bf16, truth)):
        assert torch.isfinite(o).all(), f"parameter {i}: non-finite gradient under outer autocast"
        assert_no_worse(o, t, ref, atol, rtol, what=f"outer-autocast parameter {i}")


def test_precision_arguments_are_checked():
    models, loss_fn = [TensorTower()], lambda a: a.sum()
    with pytest.raises(ValueError, match="GradScaler"):
        GradCache(models, 4, loss_fn, fp16=True)
    with pytest.raises(ValueError, match="only used with fp16"):
        GradCache(models, 4, loss_fn, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="exclusive"):
        GradCache(models, 4, loss_fn, fp16=True, bf16=True, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="one positive int per model"):
        GradCache(models, [4, 4], loss_fn)
    with pytest.raises(TypeError, match="list of nn.Module"):
        GradCache(models[0], 4, loss_fn)
    with pytest.raises(ValueError, match="0-d tensor"):
        GradCache(models, 4, lambda a: a)(torch.randn(5, FEAT))
    with pytest.raises(ValueError, match="2 model inputs for 1 models"):
        GradCache(models, 4, loss_fn)(torch.randn(5, FEAT), torch.randn(5, FEAT))


# ---- chunk_sizes="auto" ------------------------------------------------------------------------


def test_auto_chunk_size_fits_budget_and_stays_exact(caplog):
    torch.manual_seed(9)
    models, loss_fn = [TensorTower(), TensorTower()], ClipLoss()
    batches = [make_input("tensor"), make_input("tensor")]
    measure = auto_chunk.saved_activation_bytes
    per_sample = measure(models[0], batches[0][:4], lambda m, x: m(x)) / 4
    # GELU saves its input and the last Linear its input (HIDDEN floats each), Dropout its mask; the
    # first Linear's input is the batch itself, already resident. No fixed cost: linear in the rows.
    assert per_sample >= 4 * 2 * HIDDEN
    assert measure(models[0], batches[0][:8], lambda m, x: m(x)) == 8 * per_sample
    budget = int(per_sample * 6.5)
    with caplog.at_level(logging.DEBUG, logger="infcl.gradcache.auto_chunk"):
        torch.manual_seed(SEED)
        loss = GradCache(models, "auto", loss_fn, memory_budget=budget).cache_step(*batches)
        got = take_grads(distinct_params(*models, loss_fn))
    assert "chunk 6 of 23" in caplog.text
    ref_loss, ref = big_batch_step(models, batches, (6, 6), loss_fn)  # the probe left the RNG alone
    assert_close_verbose(loss, ref_loss, FP32_ATOL, FP32_RTOL, what="loss")
    assert_grads_close(got, ref)
    with pytest.raises(ValueError, match="memory_budget"):
        GradCache(models, "auto", loss_fn)(*batches)


def test_auto_chunk_size_separates_fixed_cost(caplog):
    """A fixed saved tensor (here a weight copy, as autocast makes) must not inflate the per-sample cost."""
    width = 256

    class FixedCostTower(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(FEAT, width)
            self.w = nn.Parameter(torch.randn(width, EMBED) / width**0.5)

        def forward(self, x):
            # tanh saves its output, which the matmul saves too (per sample); the matmul also saves
            # the weight copy (fixed), since its other operand requires grad.
            return torch.tanh(self.inp(x)) @ self.w.clone()

    fixed, per_sample = 4 * width * EMBED, 4 * width
    models = [FixedCostTower(), TensorTower()]
    batches = [make_input("tensor"), make_input("tensor")]
    budget = int(fixed + 6.5 * per_sample)
    with caplog.at_level(logging.DEBUG, logger="infcl.gradcache.auto_chunk"):
        GradCache(models, "auto", ClipLoss(), memory_budget=budget)(*batches)
    assert f"models[0]: {per_sample} activation bytes/sample + {fixed} fixed" in caplog.text
    assert "chunk 6 of 23" in caplog.text


# ---- DDP / FSDP / FSDP2: no_sync_except_last ---------------------------------------------------


def test_no_sync_except_last_requires_a_data_parallel_wrapper():
    gc = GradCache([TensorTower(), TensorTower()], 4, ClipLoss())
    expected = r"FullyShardedDataParallel.*models\[0\] is TensorTower, models\[1\] is TensorTower"
    with pytest.raises(TypeError, match=expected):
        gc(torch.randn(5, FEAT), torch.randn(5, FEAT), no_sync_except_last=True)


WORLD = 2
DDP_BATCH = 11  # per rank
DDP_CHUNK = 4  # 3 chunks per input, the last one short
SPAWN_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_batch(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(DDP_BATCH, FEAT, generator=gen), torch.randn(DDP_BATCH, FEAT, generator=gen)


def _ddp_case(rank, shared, no_sync):
    """(cached grads, un-cached grads, all-reduce calls) on this rank for one configuration."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(10)  # the same initial weights on every rank
    towers = [TensorTower(p=0.0)] if shared else [TensorTower(p=0.0), TensorTower(p=0.0)]
    wrapped = [DDP(t) for t in towers]
    calls = [0]

    def counting_allreduce(state, bucket):
        calls[0] += 1
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(state, bucket)

    for w in wrapped:
        w.register_comm_hook(None, counting_allreduce)
    loss_fn = ClipLoss()  # under torch.distributed, cal_inf_loss rings over the world
    q, p = _rank_batch(rank)
    params = distinct_params(*towers, loss_fn)

    models = [wrapped[0], wrapped[0]] if shared else wrapped
    GradCache(models, DDP_CHUNK, loss_fn).cache_step(q, p, no_sync_except_last=no_sync)
    cached, cached_calls = take_grads(params), calls[0]

    if shared:  # one DDP forward per backward: run both inputs through at once
        reps = wrapped[0](torch.cat([q, p]))
        loss = loss_fn(reps[:DDP_BATCH], reps[DDP_BATCH:])
    else:
        loss = loss_fn(wrapped[0](q), wrapped[1](p))
    loss.backward()
    return cached, take_grads(params), cached_calls


def _ddp_results(rank):
    cases = [(shared, no_sync) for shared in (False, True) for no_sync in (True, False)]
    return {case: _ddp_case(rank, *case) for case in cases}


# torch.distributed collectives through which FSDP (1 and 2) reduce-scatter gradients, by torch version.
REDUCE_SCATTER_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")


@contextmanager
def _counting_reduce_scatters():
    """Count the calls of torch.distributed's reduce-scatter entry points inside the block."""
    import torch.distributed as dist

    calls = [0]
    real = {name: getattr(dist, name) for name in REDUCE_SCATTER_NAMES if hasattr(dist, name)}

    def counting(fn):
        def counted(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in real.items():
        setattr(dist, name, counting(fn))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _full_grads(towers, kind):
    """Every tower parameter's full (unsharded) gradient, in parameter order."""
    if kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        grads = []
        for tower in towers:
            with FSDP.summon_full_params(tower, with_grads=True):
                grads += [p.grad.detach().clone() for p in tower.parameters()]
        return grads
    return [p.grad.full_tensor().detach().clone() for tower in towers for p in tower.parameters()]


def _fsdp_case(rank, kind, no_sync):
    """(cached grads, un-cached grads, reduce-scatter calls) of two FSDP1 or FSDP2 towers on this rank."""
    torch.manual_seed(10)
    towers = [TensorTower(p=0.0), TensorTower(p=0.0)]
    if kind == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        towers = [FSDP(t, device_id=torch.device("cpu"), use_orig_params=True) for t in towers]
    else:
        from torch.distributed.fsdp import fully_shard

        for tower in towers:
            fully_shard(tower)
    loss_fn = ClipLoss()
    q, p = _rank_batch(rank)
    with _counting_reduce_scatters() as calls:
        GradCache(towers, DDP_CHUNK, loss_fn).cache_step(q, p, no_sync_except_last=no_sync)
    cached, cached_calls = _full_grads(towers, kind), calls[0]
    for tower in towers:
        tower.zero_grad(set_to_none=True)
    loss_fn(towers[0](q), towers[1](p)).backward()
    return cached, _full_grads(towers, kind), cached_calls


def _fsdp_results(rank):
    return {(kind, no_sync): _fsdp_case(rank, kind, no_sync) for kind in ("fsdp", "fsdp2") for no_sync in (True, False)}


def _spawned_worker(rank, port, out_dir, job):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    status = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        torch.save(job(rank), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:  # report to the parent, which fails the test with it
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        status = 1
    # Gloo can abort (SIGABRT) in its exit-time teardown even after destroy_process_group(); the
    # results are on disk and every rank passed the barrier, so leave without running it.
    os._exit(status)


def _run_spawned(job):
    """``job(rank)`` on WORLD spawned gloo ranks; every rank's return value, in rank order."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_spawned_worker, args=(r, port, out_dir, job)) for r in range(WORLD)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(SPAWN_TIMEOUT_S)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        errors = [open(os.path.join(out_dir, n)).read() for n in sorted(os.listdir(out_dir)) if n.endswith(".err")]
        assert not errors, "\n".join(errors)
        assert [proc.exitcode for proc in procs] == [0] * WORLD
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.distributed
def test_ddp_no_sync_except_last_matches_uncached_step():
    results = _run_spawned(_ddp_results)
    chunks = -(-DDP_BATCH // DDP_CHUNK)
    for (shared, no_sync), _ in results[0].items():
        per_rank = [res[(shared, no_sync)] for res in results]
        for rank, (cached, uncached, calls) in enumerate(per_rank):
            # One bucket per (small) model: one all-reduce per distinct module with no_sync_except_last,
            # one per chunk per input without it.
            expected_calls = (1 if shared else 2) if no_sync else 2 * chunks
            assert calls == expected_calls, f"shared={shared} no_sync={no_sync} rank {rank}: {calls} all-reduces"
            assert_grads_close(cached, uncached)
        encoder_params = len(per_rank[0][0]) - 1  # the loss's temperature is not DDP-synced
        for a, b in zip(per_rank[0][0][:encoder_params], per_rank[1][0][:encoder_params]):
            assert_close_verbose(a, b, FP32_ATOL, FP32_RTOL, what="DDP gradient differs between ranks")


@pytest.mark.distributed
def test_fsdp_no_sync_except_last_matches_uncached_step():
    """FSDP1 (FullyShardedDataParallel.no_sync) and FSDP2 (set_requires_gradient_sync) on CPU + gloo:
    one reduce-scatter per tower with no_sync_except_last, one per chunk without, the same gradients."""
    results = _run_spawned(_fsdp_results)
    chunks = -(-DDP_BATCH // DDP_CHUNK)
    for (kind, no_sync), _ in results[0].items():
        per_rank = [res[(kind, no_sync)] for res in results]
        for rank, (cached, uncached, calls) in enumerate(per_rank):
            expected_calls = 2 if no_sync else 2 * chunks  # two towers, one flat parameter group each
            assert calls == expected_calls, f"{kind} no_sync={no_sync} rank {rank}: {calls} reduce-scatters"
            assert_grads_close(cached, uncached)
        for a, b in zip(per_rank[0][0], per_rank[1][0]):
            assert_close_verbose(a, b, FP32_ATOL, FP32_RTOL, what=f"{kind} gradient differs between ranks")
