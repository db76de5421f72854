"""``cal_inf_loss(matryoshka=...)`` with the mask options (ids, ``multi_positive`` "mean"/"sum", a guide) against
a float64 truth built without infcl: per prefix, the rules of infcl.masks applied row by row as Python sets
(helpers.truth) on the ``F.normalize``d prefix features (the guide features never truncated), reduced as the
masked loss is, weighted and summed. Loss and the gradients of q, k and the scale, one direction and symmetric,
hard negatives, odd shapes past one tile, non-unit and negative upstream gradients, guide ties (integer guide
features, exact scores); the stats per dim; which backends run the fused pass (``masked_matryoshka``: the torch
tiles, the native kernel, Triton (here under TRITON_INTERPRET=1)) and which keep one call per prefix (the chunked
route). The ring: tests/test_options_ring.py.
"""

import pytest
import torch
import torch.nn.functional as F

import infcl.api
from helpers.support import (
    TOLERANCE,
    assert_close_verbose,
    assert_same_bits_on_thread_counts,
    grads_of,
    reduce_masked_truth,
    tiled_backends,
)
from helpers.truth import truth_directions
from infcl import Matryoshka, cal_inf_loss
from infcl.backends import backend_object, unavailable_reason
from infcl.backends.torch_tiles import TorchTilesBackend

TINY_TILES = (4, 7)  # every block spans many tiles: masks cut across tile edges
TRITON = unavailable_reason("triton", torch.device("cpu")) is None
# Triton's kernels under the interpreter here (tiled_backends() counts it only on a GPU): the tests' small blocks cost
# a fraction of a second each.
TRITON_HERE = ("triton",) if TRITON and "triton" not in tiled_backends() else ()
FUSED = ("torch", "cpu", "triton")  # the backends with masked_matryoshka (where built)
BACKENDS = ("reference", "torch-tiny", *tiled_backends(), *TRITON_HERE)
OTHERS = ("torch", "torch-tiny", *tiled_backends()[1:], *TRITON_HERE)  # the tiled backends, two torch tilings
SCALE = 6.0
# (Bq, Bk, D, symmetric, dims, renormalize, kind, multi_positive)
CASES = (
    (13, 13, 11, True, (11, 5, 2), True, "ids", "mean"),
    (13, 13, 11, True, (3, 11), (False, True), "guide", None),
    (9, 17, 10, False, (10, 4), True, "both", "sum"),  # hard negatives
    (21, 21, 7, False, (7, 1, 3), (True, True, False), "both", None),  # a one-wide renormalized prefix
    (16, 16, 12, True, (12, 6), False, "ids", None),
)


def _backend(name):
    return TorchTilesBackend(*TINY_TILES) if name == "torch-tiny" else name


def _inputs(bq, bk, d, dtype, seed=0, classes=3, integer_guide=True):
    """Features (rows not unit-norm: the renormalization matters), permutation or random labels, ids from a few
    classes with each row's labelled column carrying its id (every row and column has a positive), and guide
    features, integer-valued (exact scores, in any dtype) or not, with every third row's labelled column copied onto
    the next column (a tie with its threshold at margin 0, which the truth decides from exactly rounded scores)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bq, d, generator=gen, dtype=torch.float64) * torch.linspace(0.5, 2.0, d, dtype=torch.float64)
    k = torch.randn(bk, d, generator=gen, dtype=torch.float64)
    labels = torch.randperm(bq, generator=gen) if bq == bk else torch.randint(0, bk, (bq,), generator=gen)
    q_ids = torch.randint(0, classes, (bq,), generator=gen)
    k_ids = torch.randint(0, classes, (bk,), generator=gen)
    k_ids[labels] = q_ids
    if integer_guide:
        gq = torch.randint(-2, 3, (bq, 3), generator=gen).double()
        gk = torch.randint(-2, 3, (bk, 3), generator=gen).double()
    else:
        gq = torch.randn(bq, 5, generator=gen, dtype=torch.float64).to(dtype).double()
        gk = torch.randn(bk, 5, generator=gen, dtype=torch.float64).to(dtype).double()
    for i in range(0, bq, 3):
        gk[(int(labels[i]) + 1) % bk] = gk[labels[i]]
    return q.to(dtype), k.to(dtype), labels, q_ids, k_ids, (gq.to(dtype), gk.to(dtype))


def _options(kind, mode, q_ids, k_ids, guide, margin=0.0):
    opts = {"multi_positive": mode}
    if kind in ("ids", "both") or mode is not None:
        opts.update(q_ids=q_ids, k_ids=k_ids)
    if kind in ("guide", "both"):
        opts.update(guide=guide, guide_margin=margin)
    return opts


def _truth(q, k, labels, scale, symmetric, dims, weights, renormalize, opts, reduction):
    """sum_k w_k * (prefix k's masked loss, reduced) in float64, nothing from infcl."""
    flags = (renormalize,) * len(dims) if isinstance(renormalize, bool) else renormalize
    guide = opts.get("guide")
    total = 0
    for m, w, renorm in zip(dims, weights, flags):
        qm, km = q.double()[:, :m], k.double()[:, :m]
        if renorm:
            qm, km = F.normalize(qm, dim=-1), F.normalize(km, dim=-1)
        rows, cols = truth_directions(
            qm,
            km,
            labels,
            scale,
            symmetric,
            opts.get("q_ids"),
            opts.get("k_ids"),
            opts.get("multi_positive"),
            None if guide is None else (guide[0].double(), guide[1].double()),
            opts.get("guide_margin", 0.0),
        )
        total = total + w * reduce_masked_truth(rows, cols, reduction)
    return total


def _check(backend, case, dtype, reduction, margin=0.0, seed=0, integer_guide=True):
    got, want = _got_and_want(backend, case, dtype, reduction, margin, seed, integer_guide)
    atol, rtol = TOLERANCE[dtype]
    for what, a, b in zip(("loss", "dq", "dk", "dscale"), got, want):
        assert_close_verbose(a, b, atol, rtol, f"{backend} {case[-2:]} {case[4]} {what}")


def _got_and_want(backend, case, dtype, reduction, margin, seed, integer_guide):
    """((loss, dq, dk, dscale) of the call, the same of the float64 truth on the same inputs)."""
    bq, bk, d, symmetric, dims, renormalize, kind, mode = case
    q, k, labels, q_ids, k_ids, guide = _inputs(bq, bk, d, dtype, seed, integer_guide=integer_guide)
    opts = _options(kind, mode, q_ids, k_ids, guide, margin)
    weights = tuple(0.25 + 0.5 * i for i in range(len(dims)))
    spec = Matryoshka(dims, weights, renormalize)
    gen = torch.Generator().manual_seed(11)
    upstream = torch.randn(bq, generator=gen, dtype=torch.float64) if reduction == "none" else torch.tensor(-1.3)
    scale = torch.tensor(SCALE, dtype=dtype)
    call = dict(symmetric=symmetric, reduction=reduction, matryoshka=spec, backend=_backend(backend), **opts)
    got = grads_of(lambda a, b, s: cal_inf_loss(a, b, labels, s, **call), q, k, scale, upstream)
    want = grads_of(
        lambda a, b, s: _truth(a, b, labels, s, symmetric, dims, weights, renormalize, opts, reduction),
        q.double(),
        k.double(),
        scale.double(),
        upstream.double(),
    )
    return got, want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_matches_per_prefix_masked_truth(backend, case, dtype):
    _check(backend, case, dtype, "mean")


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("reduction", ("sum", "none"))
@pytest.mark.parametrize("case", CASES[1:3])
def test_reductions_and_upstream_gradients(backend, reduction, case):
    """ "none" with a random (signed) gradient per row, "sum"; a guide margin that excludes more columns."""
    _check(backend, case, torch.float32, reduction, margin=0.5, seed=1)


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize("case", (CASES[1], CASES[3]))
def test_float_guide_duplicates_tie_their_threshold(backend, case):
    """Float guide features with every third row's labelled column duplicated: at margin 0 the duplicate ties the
    threshold exactly (the thresholds come off the same guide tiles the fused pass forms) and stays."""
    _check(backend, case, torch.float32, "mean", integer_guide=False, seed=5)


@pytest.mark.parametrize("backend", FUSED)
def test_bfloat16_inputs(backend):
    """bfloat16 features, guide and scale are exact in float32, which the fused passes accumulate in: the truth is
    their float64; the loss is float32, dq, dk and dscale come back rounded to bfloat16 (the inputs' dtypes). (The
    chunked route's per-prefix calls keep its own bfloat16 arithmetic, tested with its masked loss.)"""
    if unavailable_reason(backend, torch.device("cpu")) is not None:
        pytest.skip("the native kernel is not built")
    got, want = _got_and_want(backend, CASES[2], torch.bfloat16, "mean", 0.0, 3, True)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[3].dtype == torch.bfloat16
    assert_close_verbose(got[0], want[0], *TOLERANCE[torch.float32], f"{backend} bf16 loss")
    for what, a, b in zip(("dq", "dk", "dscale"), got[1:], want[1:]):
        assert_close_verbose(a, b, 0, 2.0**-8, f"{backend} bf16 {what}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", FUSED)
def test_past_one_key_tile(backend):
    """Blocks past the native kernel's 512-column key tile and 256-row tiles (and many torch tiles)."""
    if backend == "triton" and "triton" not in tiled_backends():
        pytest.skip("the interpreter's many tiles: test_triton_fused_past_one_tile")
    if unavailable_reason(backend, torch.device("cpu")) is not None:
        pytest.skip("the native kernel is not built")
    _check(backend, (530, 530, 6, True, (6, 2), True, "both", "mean"), torch.float32, "mean", seed=2)


def _native():
    if unavailable_reason("cpu", torch.device("cpu")) is not None:
        pytest.skip("the native kernel is not built")


@pytest.mark.parametrize("mode", (None, "sum"))
def test_native_does_not_depend_on_the_thread_count(mode):
    """The fused masked forward (the loss) and dq, whose rows each belong to one lane, are the same bits on 1, 2
    or 3 threads (the column positives kept per positive group, as the masked kernel keeps them)."""
    _native()
    q, k, labels, q_ids, k_ids, guide = _inputs(72, 72, 9, torch.float32, seed=6, integer_guide=False)
    opts = _options("both", mode, q_ids, k_ids, guide)

    def run():
        a = q.clone().requires_grad_()
        loss = cal_inf_loss(a, k, labels, SCALE, symmetric=True, matryoshka=(9, 4), backend="cpu", **opts)
        loss.backward()
        return loss.detach(), a.grad

    assert_same_bits_on_thread_counts(run)


def test_native_masked_ops_pass_opcheck():
    """The masked Matryoshka ops' schemas, fake impls and mutation declarations hold (torch.library.opcheck)."""
    _native()
    q, k, labels, q_ids, k_ids, (gq, gk) = _inputs(12, 12, 10, torch.float32, seed=7)
    dims, renorm, threshold = [3, 10], [True, False], torch.zeros(12)
    masks = ("sum", q_ids, k_ids, gq, gk, threshold, threshold)
    head = (q, k, 5.0, labels, True, dims, renorm)
    torch.library.opcheck(torch.ops.infcl.masked_matryoshka_forward_block.default, (*head, *masks))
    rows, cols = torch.ops.infcl.masked_matryoshka_forward_block(*head, *masks)
    assert rows.shape == cols.shape == (6, 2, 12)
    stats, pos_stats = rows[:2].contiguous(), rows[2:4].contiguous()
    upstream = (stats, torch.ones(2, 12), cols[:2].contiguous(), torch.ones(2, 12))
    positives = (None, pos_stats, None, cols[2:4].contiguous())
    args = (q, k, 5.0, labels, dims, renorm, *upstream, *masks, *positives, torch.zeros(12, 10), torch.zeros(12, 10))
    torch.library.opcheck(torch.ops.infcl.masked_matryoshka_backward_block.default, args)


# Blocks past the interpreter's 32 x 32 Matryoshka tile (infcl.kernels.tiling.INTERPRETER_TILINGS): ragged row and
# column blocks in both walks, forward and backward, each mask kind.
RAGGED_TRITON_CASES = (
    (45, 45, 9, True, (9, 4), True, "both", "mean"),
    (37, 70, 6, False, (2, 6), (True, False), "both", "sum"),
    (40, 40, 5, True, (1, 5), True, "ids", None),  # a one-wide renormalized prefix (SIGN_ONLY)
    (33, 33, 7, True, (7, 3), True, "guide", None),
)


@pytest.mark.interpreter  # the Triton route under TRITON_INTERPRET=1 here
@pytest.mark.skipif(not TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("case", RAGGED_TRITON_CASES)
def test_triton_fused_past_one_tile(monkeypatch, case):
    """Triton's fused masked Matryoshka kernels (masked_matryoshka): never a call per prefix, equal to the truth on
    blocks of several ragged tiles, with a signed upstream gradient per row."""
    assert getattr(backend_object("triton"), "masked_matryoshka", False)

    def per_prefix(*args, **kwargs):
        raise AssertionError("a call per prefix")

    monkeypatch.setattr(infcl.api, "_one_loss", per_prefix)
    _check("triton", case, torch.float32, "none", margin=0.25, seed=8)


@pytest.mark.interpreter
@pytest.mark.skipif(not TRITON, reason="Triton is not installed")
@pytest.mark.parametrize("symmetric,mode", ((True, "sum"), (False, "mean"), (True, "")))
def test_triton_masked_ops_pass_opcheck(symmetric, mode):
    """torch.library.opcheck of the Triton masked Matryoshka ops (schema, fake impls, the mutated dq and dk): the
    forward, then the backward on the forward's own partials (standing in for the global ones); 14 columns against
    12 rows, so each side's outputs have their own size."""
    from infcl.kernels.matryoshka_ops import masked_backward_op, masked_forward_op

    q, k, labels, q_ids, k_ids, (gq, gk) = _inputs(12, 14, 10, torch.float32, seed=7)
    bounds = torch.tensor((0, 3, 10), dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    q_factors, k_factors = torch.rand(2, 12, generator=gen) + 0.5, torch.rand(2, 14, generator=gen) + 0.5
    scale = torch.tensor(5.0)
    masks = (q_ids, k_ids, gq, gk, torch.zeros(12), torch.zeros(14) if symmetric else None, mode)
    head = (q, k, scale, labels, bounds, q_factors, k_factors)
    torch.library.opcheck(masked_forward_op, (*head, symmetric, *masks, "ieee"))
    rows, cols = masked_forward_op(*head, symmetric, *masks, "ieee")
    assert rows.shape == (6, 2, 12) and cols.shape == (6, 2, 14 if symmetric else 0)
    pick = {"sum": lambda p: p[2:4].contiguous(), "mean": lambda p: p[5].contiguous(), "": lambda p: None}[mode]
    g_row, g_col = torch.full((2, 12), 1 / 12), torch.full((2, 14), 1 / 14)
    col_args = (cols[:2].contiguous(), g_col) if symmetric else (None, None)
    positives = (pick(rows), pick(cols) if symmetric else None)
    grads = (torch.zeros(12, 10), torch.zeros(14, 10))
    args = (*head, rows[:2].contiguous(), g_row, *col_args, *positives, *masks, *grads, False, "ieee")
    torch.library.opcheck(masked_backward_op, args)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("kind,mode", (("ids", None), ("ids", "sum"), ("guide", None), ("both", "mean")))
def test_fused_pass_is_taken(monkeypatch, backend, kind, mode):
    """The torch tiles and the native kernel run every prefix of a masked call in one pass: never a call per
    prefix (infcl.api._one_loss), one guide-threshold pass whatever K."""
    if unavailable_reason(backend, torch.device("cpu")) is not None:
        pytest.skip("the native kernel is not built")
    assert getattr(backend_object(backend), "masked_matryoshka", False)
    q, k, labels, q_ids, k_ids, guide = _inputs(10, 10, 8, torch.float32)

    def per_prefix(*args, **kwargs):
        raise AssertionError("a call per prefix")

    monkeypatch.setattr(infcl.api, "_one_loss", per_prefix)
    loss = cal_inf_loss(
        q,
        k,
        labels,
        SCALE,
        symmetric=True,
        matryoshka=(8, 3, 5),
        backend=backend,
        **_options(kind, mode, q_ids, k_ids, guide),
    )
    assert torch.isfinite(loss)


@pytest.mark.parametrize("backend", ("torch", *tiled_backends()[1:], *TRITON_HERE))
def test_stats_per_dim(backend):
    """return_stats: {dim: InfLossStats} in the order given, each equal to that prefix's own masked call's."""
    q, k, labels, q_ids, k_ids, guide = _inputs(14, 14, 9, torch.float64, seed=3)
    opts = _options("both", "mean", q_ids, k_ids, guide)
    dims = (9, 2, 5)
    _, stats = cal_inf_loss(
        q, k, labels, SCALE, symmetric=True, matryoshka=dims, backend=backend, return_stats=True, **opts
    )
    assert tuple(stats) == dims
    for m in dims:
        qm, km = F.normalize(q[:, :m], dim=-1), F.normalize(k[:, :m], dim=-1)
        _, one = cal_inf_loss(qm, km, labels, SCALE, symmetric=True, backend="reference", return_stats=True, **opts)
        for a, b in zip(stats[m], one):
            assert_close_verbose(a, b, 1e-12, 1e-12, f"{backend} stats dim {m}")


@pytest.mark.parametrize("backend", ("torch", *tiled_backends()[1:], *TRITON_HERE))
def test_nan_guide_row_poisons_every_prefix(backend):
    """A guide row with NaN leaves that row's exclusions undefined: its loss is NaN in every prefix, the others'
    are not."""
    q, k, labels, q_ids, k_ids, (gq, gk) = _inputs(8, 8, 6, torch.float32, seed=4)
    gq = gq.clone()
    gq[3, 1] = float("nan")
    per = cal_inf_loss(q, k, labels, SCALE, reduction="none", matryoshka=(6, 2), backend=backend, guide=(gq, gk))
    assert torch.isnan(per[3]) and not torch.isnan(per[torch.arange(8) != 3]).any()
