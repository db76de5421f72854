"""The public surface: Inf-CL call-compatibility, backend selection, InfCLIPLoss, the reference."""

import pytest
import torch
import torch.nn.functional as F

import infcl
from infcl import InfCLIPLoss, cal_inf_loss, cal_inf_loss_reference
from infcl.backends import resolve_backend
from support import assert_close_verbose, vanilla_loss


def _features(b=40, d=24, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, d, generator=gen, dtype=dtype), torch.randn(b, d, generator=gen, dtype=dtype)


def test_inf_cl_positional_call():
    # inf_cl.cal_inf_loss(q, k, labels, scale, head_dim): mean q->k loss; head_dim is ignored.
    q, k = _features()
    labels = torch.arange(40)
    got = cal_inf_loss(q, k, labels, 5.0, 256)
    assert got.dim() == 0
    assert_close_verbose(got, vanilla_loss(q.double(), k.double(), labels, 5.0), 1e-6, 1e-6, "loss")


def test_auto_resolves_per_device_and_env_overrides(monkeypatch):
    monkeypatch.delenv("INFCL_BACKEND", raising=False)
    assert resolve_backend("auto", torch.device("cpu")) in ("cpu", "torch")
    monkeypatch.setenv("INFCL_BACKEND", "reference")
    assert resolve_backend("auto", torch.device("cpu")) == "reference"
    # An explicit backend is never overridden.
    assert resolve_backend("torch", torch.device("cpu")) == "torch"


def test_env_reference_is_used_by_auto(monkeypatch):
    # The reference materializes the logits through autograd: its graph holds an mm node, ours does not.
    q, k = _features()
    q.requires_grad_(True)
    monkeypatch.setenv("INFCL_BACKEND", "reference")
    loss_ref = cal_inf_loss(q, k)
    monkeypatch.setenv("INFCL_BACKEND", "torch")
    loss_tiled = cal_inf_loss(q, k)

    def graph_names(t):
        seen, todo = set(), [t.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            todo.extend(f for f, _ in fn.next_functions)
        return {type(f).__name__ for f in seen}

    assert any("InfLossFunction" in n for n in graph_names(loss_tiled))
    assert not any("InfLossFunction" in n for n in graph_names(loss_ref))
    assert_close_verbose(loss_tiled, loss_ref, 1e-6, 1e-6, "loss")


def test_reference_has_public_signature():
    q, k = _features()
    labels = torch.randperm(40)
    for symmetric in (False, True):
        got = cal_inf_loss_reference(q, k, labels, 3.0, None, symmetric=symmetric, reduction="none")
        want = cal_inf_loss(q, k, labels, 3.0, symmetric=symmetric, reduction="none", backend="torch")
        assert_close_verbose(got, want, 1e-5, 1e-5, f"symmetric={symmetric}")


def test_clip_loss_dropin_matches_open_clip_formula():
    image, text = _features(64, 32, seed=5)
    image, text = F.normalize(image, dim=-1), F.normalize(text, dim=-1)
    logit_scale = torch.tensor(2.659, requires_grad=True)  # log(1 / 0.07)
    loss_fn = InfCLIPLoss()
    out = loss_fn(image, text, logit_scale.exp(), output_dict=True)
    assert set(out) == {"contrastive_loss"}
    out["contrastive_loss"].backward()
    ours_grad = logit_scale.grad.clone()

    # open_clip's ClipLoss, single process: (CE(logits_per_image) + CE(logits_per_text)) / 2.
    logit_scale.grad = None
    logits = logit_scale.exp() * image @ text.T
    labels = torch.arange(64)
    want = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    want.backward()
    assert_close_verbose(out["contrastive_loss"], want, 1e-6, 1e-6, "loss")
    assert_close_verbose(ours_grad, logit_scale.grad, 1e-6, 1e-6, "dlogit_scale")
    assert torch.is_tensor(loss_fn(image, text, logit_scale.exp()))


def test_output_dtype_is_accumulation_dtype():
    for dtype, want in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float64, torch.float64)):
        q, k = _features(dtype=dtype)
        assert cal_inf_loss(q, k).dtype == want


def test_reductions_relate():
    q, k = _features()
    labels = torch.randperm(40)
    for symmetric in (False, True):
        none = cal_inf_loss(q, k, labels, symmetric=symmetric, reduction="none")
        assert none.shape == (40,)
        assert_close_verbose(cal_inf_loss(q, k, labels, symmetric=symmetric, reduction="sum"), none.sum(), 1e-5, 1e-6, "sum")
        assert_close_verbose(cal_inf_loss(q, k, labels, symmetric=symmetric), none.mean(), 1e-6, 1e-6, "mean")


def test_exports():
    assert {"cal_inf_loss", "InfCLIPLoss", "cal_inf_loss_reference"} <= set(infcl.__all__)
