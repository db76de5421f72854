"""The public surface: Inf-CL call-compatibility, backend selection, InfCLIPLoss, the reference."""

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import infcl
from helpers.support import assert_close_verbose, vanilla_loss
from infcl import InfCLIPLoss, cal_inf_loss, cal_inf_loss_reference
from infcl.backends import resolve_backend


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
    expected = ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float64, torch.float64))
    for dtype, want in expected:
        q, k = _features(dtype=dtype)
        assert cal_inf_loss(q, k).dtype == want


def test_reductions_relate():
    q, k = _features()
    labels = torch.randperm(40)
    for symmetric in (False, True):
        none = cal_inf_loss(q, k, labels, symmetric=symmetric, reduction="none")
        assert none.shape == (40,)
        summed = cal_inf_loss(q, k, labels, symmetric=symmetric, reduction="sum")
        assert_close_verbose(summed, none.sum(), 1e-5, 1e-6, "sum")
        assert_close_verbose(cal_inf_loss(q, k, labels, symmetric=symmetric), none.mean(), 1e-6, 1e-6, "mean")


def test_exports():
    assert {"cal_inf_loss", "InfCLIPLoss", "cal_inf_loss_reference"} <= set(infcl.__all__)


# ---- the import graph ------------------------------------------------------------------------------

PACKAGE = Path(infcl.__file__).resolve().parent


def _module_names():
    """{dotted module name: path} for every module of the package (a package is its __init__.py)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("infcl",) + path.relative_to(PACKAGE).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name, path, modules):
    """The package's modules that ``name`` imports anywhere in its text (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if node.module and target in modules:  # `from . import x` imports x, not the package again
                found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules)
    return found - {name}


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    modules = _module_names()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["infcl.api"] >= {"infcl.reference"}, "the import graph parser misses relative imports"
    assert _cycles(graph) == []


# What the reference must not share with what it checks: the API and the tiled path behind it.
TILED_PATH = ("infcl.api", "infcl.function", "infcl.losses", "infcl.ring.driver", "infcl.ring.comm", "infcl.kernels")
TILED_BACKENDS = ("infcl.backends.torch_tiles", "infcl.backends.native", "infcl.backends.triton")


def test_reference_imports_nothing_of_the_tiled_path():
    """The reference is an independent A/B check: it may share the dtype policy and the ring layout, not the
    API, the autograd Functions, the losses' block steps, the ring loop, the tiles or the kernels."""
    modules = _module_names()
    imported = _imports("infcl.reference", modules["infcl.reference"], modules)
    assert "infcl.ring.layout" in imported, "the import graph parser misses the reference's imports"
    shared = {m for m in imported if m.startswith(TILED_PATH) or m.startswith(TILED_BACKENDS)}
    assert not shared, shared


def test_auto_runs_guided_losses_on_the_torch_tiles_on_cuda(monkeypatch):
    """The guided Triton forward faulted on an H200 (README, "Known issue"): "auto" keeps guided calls on the
    torch tiles on CUDA, with one warning; unguided calls and an explicit backend="triton" are unchanged."""
    from infcl.backends import resolve as backends

    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    monkeypatch.delenv("INFCL_BACKEND", raising=False)
    cuda = torch.device("cuda")
    assert backends.resolve_backend("auto", cuda) == "triton"
    with pytest.warns(RuntimeWarning, match="guided loss on the torch tiles"):
        backends._WARNED.clear()
        assert backends.resolve_backend("auto", cuda, "guided") == "torch"
    assert backends.resolve_backend("triton", cuda, "guided") == "triton"
    assert backends.resolve_backend("auto", torch.device("cpu"), "guided") == "cpu"


def test_group_local_runs_without_a_ring_and_other_strings_raise():
    """``group="local"``: this process's batch alone (the drop-ins' open_clip default); any other string is
    a ValueError naming ``group``."""
    q, k = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    assert torch.equal(cal_inf_loss(q, k, group="local"), cal_inf_loss(q, k))
    with pytest.raises(ValueError, match="group must be"):
        cal_inf_loss(q, k, group="world")
