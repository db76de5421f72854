"""Issue 23: false-negative ids, multiple positives and guide masks, against a float64 truth built row by row.

The truth (support.masked_loss_truth) builds each row's positives and exclusions as Python sets, so it
shares nothing with the reference backend's or the tiles' masks.
"""

import pytest
import torch
import torch.nn.functional as F

from helpers.exact_scores import truth_scores
from helpers.support import (
    TOLERANCE,
    assert_close_verbose,
    assert_no_worse,
    assert_normwise,
    assert_same_bits_on_thread_counts,
    grads_of_inputs,
    masked_loss_truth,
    masked_truth_directions,
    reduce_masked_truth,
)
from infcl import InfCLIPLoss, cal_inf_loss
from infcl.backends import resolve_backend, unavailable_reason
from infcl.backends.torch_tiles import TorchTilesBackend
from infcl.masks import guide_threshold
from infcl.stats import InfLossStats

# "torch-tiny": the torch tiles shrunk so that every block spans many tiles (masks cut across tile edges).
# "cpu": the native kernel, skipped where it is not built. "triton": the Triton kernels on these CPU tensors,
# under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU), on their smallest
# tiles, split (see _use).
NATIVE_REASON = unavailable_reason("cpu", torch.device("cpu"))
TRITON = unavailable_reason("triton", torch.device("cpu")) is None
MASK_BACKENDS = ("reference", "torch", "torch-tiny", "cpu") + (("triton",) if TRITON else ())
TINY_TILES = (4, 7)
MODES = (None, "mean", "sum")
# (kind, multi_positive): multi_positive needs ids, so a guide alone goes with None only ("guide" with a mode
# would be "both" with that mode again).
KIND_MODES = [(kind, mode) for kind in ("ids", "guide", "both") for mode in MODES if kind != "guide" or mode is None]
SCALE = 7.0  # CLIP-like logits in [-7, 7] on unit features
CONFIDENT_SCALE = 40.0  # gaps of tens of logits between a positive and the rest
# Normwise relative error bounds of the confident batch: a few float32 round-offs; float64 likewise.
CONFIDENT_BOUND = {torch.float32: 1e-5, torch.float64: 1e-12}
# (name, kwargs builder): ids drawn from few classes (many duplicates), from a guide, or both.
N_CLASSES = 5
# The native kernel hands dS to its bfloat16 GEMMs rounded to bfloat16 (csrc/softmax_backward.cpp), masks or not,
# where the reference and the torch tiles keep it in float32; on the cancelling sums of dq and dk that
# rounding exceeds TOLERANCE's elementwise bound (its plain loss does the same). Its bfloat16 outputs are
# held instead, like its plain loss's in test_native.py, to this multiple of the reference backend's own
# max error on the same bfloat16 inputs, plus TOLERANCE's atol.
NATIVE_BF16_ERR_FACTOR = 4.0


def _inputs(bq, bk, d=6, dtype=torch.float32, seed=0, classes=N_CLASSES, guide_dim=4, labels="perm"):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(bq, d, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    k = F.normalize(torch.randn(bk, d, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    q_ids = torch.randint(0, classes, (bq,), generator=gen)
    k_ids = torch.randint(0, classes, (bk,), generator=gen)
    if bq == bk:
        k_ids[:bq] = q_ids  # paired data: each row's own column shares its id
    gq = torch.randn(bq, guide_dim, generator=gen, dtype=torch.float64).to(dtype)
    gk = torch.randn(bk, guide_dim, generator=gen, dtype=torch.float64).to(dtype)
    lab = torch.randperm(bq, generator=gen) if labels == "perm" else torch.randint(0, bk, (bq,), generator=gen)
    if labels == "perm" and bq == bk:
        k_ids = k_ids.clone()
        k_ids[lab] = q_ids  # the labelled column shares the row's id (as in real paired data)
    return q, k, lab, q_ids, k_ids, (gq, gk)


def _options(kind, mode, q_ids, k_ids, guide, strategy="absolute"):
    opts = {"multi_positive": mode}
    if kind in ("ids", "both") or mode is not None:
        opts.update(q_ids=q_ids, k_ids=k_ids)
    if kind in ("guide", "both"):
        opts.update(guide=guide, guide_margin=0.3 if strategy == "absolute" else 0.2, guide_margin_strategy=strategy)
    return opts


def _triton_tiny():
    """The Triton kernels' smallest tiles (16 x 16, 16-wide feature chunks and dq / dk slices), with two
    row groups, two k splits and two backward splits: a 23-row batch spans ragged blocks, chunks and
    merged partials in every kernel."""
    from infcl.kernels import TileConfig, Tiling

    tile = TileConfig(block_m=16, block_n=16, block_out=16)
    return Tiling(forward=tile, dq=tile, dk=tile, resident_d=16, chunk_d=16, groups=2, splits=2, backward_splits=2)


def _use(backend):
    """The ``backend=`` to pass (options from the call): the torch tiles shrunk for "torch-tiny" and the Triton
    kernels' tiles for "triton", as backend objects, else the name; skips the test for "cpu" where the native
    kernel is unavailable."""
    if backend == "cpu" and NATIVE_REASON is not None:
        pytest.skip(f"native kernel unavailable: {NATIVE_REASON}")
    if backend == "torch-tiny":
        return TorchTilesBackend(*TINY_TILES)
    if backend == "triton":
        from infcl.backends import TritonBackend

        return TritonBackend(tiling=_triton_tiny())
    return backend


def _masked_in_dtype(
    q,
    k,
    labels,
    scale,
    *,
    symmetric=False,
    reduction="mean",
    q_ids=None,
    k_ids=None,
    multi_positive=None,
    guide=None,
    guide_margin=0.0,
    guide_margin_strategy="absolute",
):
    """The masked loss as torch computes it in q's dtype on dense [Bq, Bk] masks (logits, log-sum-exp and
    their gradients in bfloat16 / float16): the low-precision baseline of the Triton kernels, whose
    tensor-core products take dS rounded to the inputs' dtype (as in tests/test_triton.py). The masks are
    the float64 definition's. Every row here has a positive."""
    logits = scale.to(q.dtype) * q @ k.T
    labels = torch.arange(q.shape[0]) if labels is None else labels

    def direction(lg, lab, ids, other_ids, g, other_g):
        positive = torch.zeros(lg.shape, dtype=torch.bool).scatter_(1, lab[:, None], True)
        excluded = torch.zeros_like(positive)
        if ids is not None:
            same = ids[:, None] == other_ids[None, :]
            positive, excluded = (positive, same) if multi_positive is None else (same, excluded)
        if g is not None:
            scores = truth_scores(g, other_g)  # the float64 definition's, exactly rounded: duplicates tie
            excluded |= scores > guide_threshold(scores.gather(1, lab[:, None]), guide_margin, guide_margin_strategy)
        lse = torch.logsumexp(lg.masked_fill(excluded & ~positive, float("-inf")), dim=1)
        if multi_positive == "sum":
            return lse - torch.logsumexp(lg.masked_fill(~positive, float("-inf")), dim=1)
        return lse - lg.masked_fill(~positive, 0.0).sum(dim=1) / positive.sum(dim=1).to(lg.dtype)

    gq, gk = (None, None) if guide is None else guide
    rows = direction(logits, labels, q_ids, k_ids, gq, gk)
    cols = direction(logits.T, torch.argsort(labels), k_ids, q_ids, gk, gq) if symmetric else None
    return reduce_masked_truth(rows, cols, reduction)


def _truths(q, k, labels, opts, symmetric, upstream, reductions=("mean", "sum", "none")):
    """The float64 truth's (loss, dq, dk, dscale) for each reduction, with the row-by-row directions (the
    costly part) built once and every reduction's gradient taken through that one graph; ``upstream`` is the
    upstream gradient of "none" (the others take 1)."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, torch.tensor(SCALE, dtype=torch.float64))]
    rows, cols = masked_truth_directions(leaves[0], leaves[1], labels, leaves[2], symmetric=symmetric, **opts)
    truths = {}
    for reduction in reductions:
        loss = reduce_masked_truth(rows, cols, reduction)
        grad_out = upstream if reduction == "none" and upstream is not None else torch.ones_like(loss)
        truths[reduction] = (loss.detach(), *torch.autograd.grad(loss, leaves, grad_out, retain_graph=True))
    return truths


def _check(backend, q, k, labels, opts, symmetric, reduction, dtype, upstream=None, what="", truth=None):
    scale = torch.tensor(SCALE, dtype=torch.float64)
    if truth is None:
        truth = _truths(q, k, labels, opts, symmetric, upstream, (reduction,))[reduction]
    name = _use(backend)
    got = grads_of_inputs(
        lambda a, b, s: cal_inf_loss(a, b, labels, s, symmetric=symmetric, reduction=reduction, backend=name, **opts),
        (q, k, scale.to(dtype)),
        upstream,
    )
    atol, rtol = TOLERANCE[dtype]
    if backend == "cpu" and dtype == torch.bfloat16:
        ref = grads_of_inputs(
            lambda a, b, s: cal_inf_loss(
                a, b, labels, s, symmetric=symmetric, reduction=reduction, backend="reference", **opts
            ),
            (q, k, scale.to(dtype)),
            upstream,
        )
        for name, g, r, t in zip(("loss", "dq", "dk", "dscale"), got, ref, truth):
            err, ref_err = (float((x.double() - t).abs().nan_to_num(0.0).max()) for x in (g, r))
            assert torch.equal(torch.isnan(g), torch.isnan(t)), f"{what} {name}: NaN pattern differs"
            bound = NATIVE_BF16_ERR_FACTOR * ref_err + atol
            assert err <= bound, f"{what} {name}: max error {err:.3g} > {bound:.3g} (reference: {ref_err:.3g})"
        return got, truth
    if backend == "triton" and dtype in (torch.bfloat16, torch.float16):
        # dS meets the tensor cores in the inputs' dtype: no worse than torch's own loss in that dtype.
        lowp = grads_of_inputs(
            lambda a, b, s: _masked_in_dtype(a, b, labels, s, symmetric=symmetric, reduction=reduction, **opts),
            (q, k, scale.to(dtype)),
            upstream,
        )
        for name, g, t, e in zip(("loss", "dq", "dk", "dscale"), got, lowp, truth):
            assert_no_worse(g, t, e, atol, rtol, f"{what} {name}")
        return got, truth
    for name, g, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
        assert_close_verbose(g, t, atol, rtol, f"{what} {name}")
    return got, truth


@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("kind,mode", KIND_MODES)
@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32, torch.bfloat16, torch.float16))
def test_matches_truth(backend, mode, kind, symmetric, dtype):
    if backend == "triton" and dtype in (torch.float64, torch.float16) and kind != "both":
        pytest.skip("interpreted Triton: float64 and float16 (dS normalization) with ids and a guide only")
    q, k, labels, q_ids, k_ids, guide = _inputs(23, 23, dtype=dtype)
    opts = _options(kind, mode, q_ids, k_ids, guide)
    upstream = torch.linspace(-0.5, 1.5, 23, dtype=torch.float64)
    truths = _truths(q, k, labels, opts, symmetric, upstream)
    for reduction in ("mean", "sum", "none"):
        _check(
            backend,
            q,
            k,
            labels,
            opts,
            symmetric,
            reduction,
            dtype,
            upstream if reduction == "none" else None,
            f"{backend} {kind} {mode} sym={symmetric} {reduction}",
            truths[reduction],
        )


@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", ("absolute", "relative"))
def test_hard_negative_columns_and_margin_strategies(backend, mode, strategy):
    q, k, labels, q_ids, k_ids, guide = _inputs(13, 31, dtype=torch.float64, labels="random", seed=3)
    opts = _options("both", mode, q_ids, k_ids, guide, strategy)
    _check(backend, q, k, labels, opts, False, "mean", torch.float64, what=f"{backend} {mode} {strategy}")


@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("symmetric", (False, True))
def test_rows_without_positive(backend, symmetric):
    # Ids from 7 classes on 9 rows: some rows (and columns) have no partner; their losses are NaN under
    # "none" and are left out of "sum" and of "mean"'s count.
    q, k, labels, _, _, _ = _inputs(9, 9, dtype=torch.float64, seed=5)
    name = _use(backend)
    q_ids = torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 6])
    k_ids = torch.tensor([0, 1, 1, 2, 9, 3, 4, 7, 8])
    for mode in ("mean", "sum"):
        opts = {"q_ids": q_ids, "k_ids": k_ids, "multi_positive": mode}
        none = cal_inf_loss(q, k, labels, SCALE, symmetric=symmetric, reduction="none", backend=name, **opts)
        want = masked_loss_truth(q, k, labels, SCALE, symmetric=symmetric, reduction="none", **opts)
        assert torch.isnan(none).any() and not torch.isnan(none).all()
        assert_close_verbose(none, want, 1e-10, 1e-10, f"{mode} none")
        for reduction in ("mean", "sum"):
            _check(backend, q, k, labels, opts, symmetric, reduction, torch.float64, what=f"{mode} {reduction}")


@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("symmetric", (False, True))
def test_all_ids_equal(backend, symmetric):
    q, k, labels, _, _, _ = _inputs(11, 11, dtype=torch.float64, seed=7)
    name = _use(backend)
    same = torch.zeros(11, dtype=torch.int64)
    # One positive per row and every other column a false negative: each row's softmax is its positive alone.
    alone = cal_inf_loss(
        q, k, labels, SCALE, symmetric=symmetric, reduction="none", q_ids=same, k_ids=same, backend=name
    )
    assert_close_verbose(alone, torch.zeros(11, dtype=torch.float64), 1e-12, 0, "None: loss 0")
    # "sum": the positives are every column, so lse - lse = 0; "mean": lse - mean of the row.
    summed = cal_inf_loss(
        q,
        k,
        labels,
        SCALE,
        symmetric=symmetric,
        reduction="none",
        q_ids=same,
        k_ids=same,
        multi_positive="sum",
        backend=name,
    )
    assert_close_verbose(summed, torch.zeros(11, dtype=torch.float64), 1e-12, 0, "sum: loss 0")
    for mode in MODES:
        _check(
            backend,
            q,
            k,
            labels,
            {"q_ids": same, "k_ids": same, "multi_positive": mode},
            symmetric,
            "mean",
            torch.float64,
            what=f"all equal {mode}",
        )


@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_distinct_ids_equal_plain_loss(backend, symmetric, dtype):
    # Ids that never repeat exclude nothing and make each row's labelled column its only positive: the
    # tiles must then give the plain loss and its gradients bit for bit (the reference: to round-off).
    q, k, labels, _, _, _ = _inputs(37, 37, dtype=dtype, seed=11)
    ids = torch.randperm(37) * 3
    k_ids = torch.empty_like(ids)
    k_ids[labels] = ids  # each row's labelled column carries its id, every other column another one
    scale = torch.tensor(SCALE, dtype=dtype)
    upstream = torch.linspace(-0.5, 1.5, 37, dtype=torch.float64)
    atol, rtol = TOLERANCE[dtype]
    name = _use(backend)
    # The kernels see the reductions only through the upstream gradient: the interpreted ones take "none".
    reductions = ("none",) if backend == "triton" else ("mean", "sum", "none")
    for mode in MODES:
        for reduction in reductions:
            up = upstream if reduction == "none" else None
            common = {"symmetric": symmetric, "reduction": reduction, "backend": name}
            masks = {"q_ids": ids, "k_ids": k_ids, "multi_positive": mode}
            masked = grads_of_inputs(
                lambda a, b, s, c=common, m=masks: cal_inf_loss(a, b, labels, s, **c, **m), (q, k, scale), up
            )
            plain = grads_of_inputs(lambda a, b, s, c=common: cal_inf_loss(a, b, labels, s, **c), (q, k, scale), up)
            for what, m, p in zip(("loss", "dq", "dk", "dscale"), masked, plain):
                if backend == "reference":
                    assert_close_verbose(m, p, atol, rtol, f"{mode} {reduction} {what}")
                else:
                    assert torch.equal(m, p), f"{mode} {reduction} {what}: not bit for bit"


# The native kernel's tiles are 32-256 rows by 512 columns: these batches span several row tiles (and column
# groups) and cross a key-tile edge, so masks, positives and their partials are cut and merged across tiles.
NATIVE_TILED = {"sym": (600, 600, True), "hardneg": (300, 1100, False)}


@pytest.mark.parametrize("shape", sorted(NATIVE_TILED))
@pytest.mark.parametrize("kind,mode", KIND_MODES)
@pytest.mark.parametrize("classes", (N_CLASSES, 300))  # every row with many positives, or some with one
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_native_across_tiles_matches_reference(shape, mode, kind, classes, dtype):
    name = _use("cpu")
    bq, bk, symmetric = NATIVE_TILED[shape]
    q, k, labels, q_ids, k_ids, guide = _inputs(
        bq, bk, d=16, dtype=torch.float64, seed=29, classes=classes, labels="perm" if symmetric else "random"
    )
    opts = _options(kind, mode, q_ids, k_ids, guide)
    scale = torch.tensor(SCALE, dtype=torch.float64)
    upstream = torch.rand(bq, generator=torch.Generator().manual_seed(2), dtype=torch.float64) - 0.25
    truth = grads_of_inputs(
        lambda a, b, s: cal_inf_loss(
            a, b, labels, s, symmetric=symmetric, reduction="none", backend="reference", **opts
        ),
        (q, k, scale),
        upstream,
    )
    got = grads_of_inputs(
        lambda a, b, s: cal_inf_loss(a, b, labels, s, symmetric=symmetric, reduction="none", backend=name, **opts),
        (q.to(dtype), k.to(dtype), scale.to(dtype)),
        upstream,
    )
    atol, rtol = TOLERANCE[dtype]
    for what, g, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
        assert_close_verbose(g, t, atol, rtol, f"{shape} {kind} {mode} {classes} {what}")


# Above 16 column groups (Bq > 4096: 256-row tiles, one group each) the native symmetric forward keeps the
# columns' positives per run of column groups, and the threads take whole runs (csrc/softmax_forward.cpp,
# MAX_POSITIVE_GROUPS): 4608 rows are 18 groups in 9 runs of 2.
POSITIVE_RUNS_BATCH = 4608


@pytest.mark.slow
@pytest.mark.parametrize("mode", ("mean", "sum"))
def test_native_positive_runs_match_reference(mode):
    name = _use("cpu")
    b = POSITIVE_RUNS_BATCH
    q, k, labels, q_ids, k_ids, guide = _inputs(b, b, d=16, dtype=torch.float64, seed=37, classes=b // 8)
    opts = _options("both", mode, q_ids, k_ids, guide)
    scale = torch.tensor(SCALE, dtype=torch.float64)
    upstream = torch.rand(b, generator=torch.Generator().manual_seed(3), dtype=torch.float64) - 0.25
    truth, got = (
        grads_of_inputs(
            lambda a, c, s, backend=backend: cal_inf_loss(
                a, c, labels, s, symmetric=True, reduction="none", backend=backend, **opts
            ),
            (q, k, scale),
            upstream,
        )
        for backend in ("reference", name)
    )
    atol, rtol = TOLERANCE[torch.float64]
    for what, g, t in zip(("loss", "dq", "dk", "dscale"), got, truth):
        assert_close_verbose(g, t, atol, rtol, f"{b} {mode} {what}")


@pytest.mark.slow
@pytest.mark.parametrize("batch", (600, POSITIVE_RUNS_BATCH))
@pytest.mark.parametrize("mode", MODES)
def test_native_masks_do_not_depend_on_the_thread_count(mode, batch):
    # The native kernel's row tiles, key tiles and GEMM routes (the guide's included) are fixed by the
    # shapes, so the masked forward, and dq, whose rows each belong to one lane, are the same bits on 1, 2
    # or 3 threads (dk and the scale gradient sum per-lane partials: exact, not bit-identical).
    name = _use("cpu")
    q, k, labels, q_ids, k_ids, guide = _inputs(batch, batch, d=16, seed=31, classes=batch // 2)
    opts = _options("both", mode, q_ids, k_ids, guide)

    def run():
        a, b = q.clone().requires_grad_(), k.clone().requires_grad_()
        loss = cal_inf_loss(a, b, labels, SCALE, symmetric=True, reduction="sum", backend=name, **opts)
        loss.backward()
        return loss.detach(), a.grad

    assert_same_bits_on_thread_counts(run)


# --- input validation ----------------------------------------------------------------------------------

BAD_INPUTS = (
    ({"q_ids": torch.arange(5), "k_ids": torch.arange(6)}, ValueError, r"q_ids must have shape \[6\]"),
    ({"q_ids": torch.arange(6), "k_ids": torch.arange(6)[None]}, ValueError, r"k_ids must have shape \[6\]"),
    ({"q_ids": torch.arange(6.0), "k_ids": torch.arange(6)}, TypeError, "q_ids must be an integer tensor"),
    ({"q_ids": torch.arange(6), "k_ids": torch.ones(6, dtype=torch.bool)}, TypeError, "k_ids must be an integer"),
    ({"q_ids": [0] * 6, "k_ids": torch.arange(6)}, TypeError, "q_ids must be None or an integer tensor"),
    ({"q_ids": torch.arange(6, device="meta"), "k_ids": torch.arange(6)}, ValueError, "q_ids must be on q's device"),
    ({"q_ids": torch.arange(6)}, ValueError, "q_ids was given without k_ids"),
    ({"multi_positive": "mean"}, ValueError, "multi_positive='mean' needs q_ids and k_ids"),
    (
        {"q_ids": torch.arange(6), "k_ids": torch.arange(6), "multi_positive": "max"},
        ValueError,
        "multi_positive must be one of",
    ),
    ({"guide": (torch.randn(5, 3), torch.randn(6, 3))}, ValueError, "guide.0. must have one row per row of q"),
    ({"guide": (torch.randn(6, 3), torch.randn(7, 3))}, ValueError, "guide.1. must have one row per row of k"),
    ({"guide": (torch.randn(6, 3), torch.randn(6, 4))}, ValueError, "same non-zero width"),
    ({"guide": torch.randn(6, 3)}, TypeError, "guide must be None or a pair"),
    ({"guide": (torch.randn(6, 3), torch.randn(6, 3), torch.randn(6, 3))}, TypeError, "guide must be None or a pair"),
    ({"guide": (torch.randn(6), torch.randn(6, 3))}, ValueError, "guide.0. must be 2-d"),
    ({"guide": (torch.randn(6, 3), torch.arange(18).view(6, 3))}, TypeError, "guide.1. must be a floating-point"),
    ({"guide": (torch.randn(6, 3), torch.randn(6, 3, dtype=torch.float64))}, TypeError, "same dtype"),
    ({"guide_margin_strategy": "percent"}, ValueError, "guide_margin_strategy must be one of"),
    ({"guide_margin": "0.1"}, TypeError, "guide_margin must be a real number"),
    ({"guide_margin": float("nan")}, ValueError, "guide_margin must be finite"),
    ({"return_stats": 1}, TypeError, "return_stats must be a bool"),
)


@pytest.mark.parametrize("kwargs,kind,match", BAD_INPUTS, ids=[b[2][:30] for b in BAD_INPUTS])
def test_bad_input_raises_named_error(kwargs, kind, match):
    q, k = torch.randn(6, 4), torch.randn(6, 4)
    with pytest.raises(kind, match=match):
        cal_inf_loss(q, k, **kwargs)


# --- return_stats ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("symmetric", (False, True))
def test_stats_of_the_plain_loss(backend, symmetric):
    q, k, labels, _, _, _ = _inputs(29, 29, dtype=torch.float64, seed=13)
    k[labels] = F.normalize(q + 0.6 * k[labels], dim=-1)  # positives that often, not always, win
    scale = 3.0
    loss, stats = cal_inf_loss(q, k, labels, scale, symmetric=symmetric, backend=_use(backend), return_stats=True)
    assert isinstance(stats, InfLossStats)
    reference = cal_inf_loss(q, k, labels, scale, symmetric=symmetric, backend="reference")
    assert_close_verbose(loss, reference, 1e-10, 1e-10, "loss with stats")
    logits = scale * truth_scores(q, k)  # exactly rounded: the argmax decides as on any CPU
    want = [(logits.argmax(1) == labels).double().mean(), logits.gather(1, labels[:, None]).mean()]
    if symmetric:
        inverse = torch.argsort(labels)
        want += [(logits.T.argmax(1) == inverse).double().mean(), logits.T.gather(1, inverse[:, None]).mean()]
    assert 0 < float(want[0]) < 1, "the batch must have hits and misses for the accuracy to mean anything"
    assert sum(t is not None for t in stats) == len(want)
    for i, (got, expected) in enumerate(zip(stats, want)):
        assert not got.requires_grad
        assert_close_verbose(got, expected, 1e-12, 1e-12, f"stats[{i}] ({stats._fields[i]})")


def _masked_stats_truth(q, k, labels, scale, q_ids, k_ids, mode, guide, margin):
    """(accuracy, positive logit) of the rows, from the row-by-row sets of the masked definition (scores
    exactly rounded: the best column and the guide rule decide as on any CPU)."""
    logits = scale * truth_scores(q, k)
    scores = truth_scores(guide[0], guide[1])
    hits, means = [], []
    for i in range(q.shape[0]):
        same = {j for j in range(k.shape[0]) if q_ids[i] == k_ids[j]}
        positives = {int(labels[i])} if mode is None else same
        if not positives:
            continue
        threshold = scores[i, labels[i]] - margin
        kept = [j for j in range(k.shape[0]) if j in positives or (j not in same and scores[i, j] <= threshold)]
        best = max(kept, key=lambda j: float(logits[i, j]))
        hits.append(float(best in positives))
        means.append(float(logits[i, sorted(positives)].mean()))
    return torch.tensor(hits, dtype=torch.float64).mean(), torch.tensor(means, dtype=torch.float64).mean()


@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_stats_with_masks(backend, mode):
    q, k, labels, q_ids, k_ids, guide = _inputs(31, 31, dtype=torch.float64, seed=17)
    k[labels] = F.normalize(q + 0.6 * k[labels], dim=-1)  # positives that often, not always, win
    opts = _options("both", mode, q_ids, k_ids, guide)
    _, stats = cal_inf_loss(q, k, labels, 3.0, backend=_use(backend), return_stats=True, **opts)
    accuracy, positive_logit = _masked_stats_truth(q, k, labels, 3.0, q_ids, k_ids, mode, guide, opts["guide_margin"])
    assert 0 < float(accuracy) < 1, "the batch must have hits and misses for the accuracy to mean anything"
    assert stats.k2q_accuracy is None and stats.k2q_positive_logit is None
    assert_close_verbose(stats.q2k_accuracy, accuracy, 1e-12, 1e-12, "accuracy")
    assert_close_verbose(stats.q2k_positive_logit, positive_logit, 1e-12, 1e-12, "positive logit")


@pytest.mark.parametrize("env", (None, "cpu", "triton", "torch", "reference"))
def test_auto_picks_a_backend_with_masks(monkeypatch, env):
    if env is None:
        monkeypatch.delenv("INFCL_BACKEND", raising=False)
    else:
        monkeypatch.setenv("INFCL_BACKEND", env)
    if env == "triton" and not TRITON:
        pytest.skip("the Triton kernels cannot run on CPU tensors here")
    if env == "cpu" and NATIVE_REASON is not None:
        pytest.skip(f"native kernel unavailable: {NATIVE_REASON}")
    # Every backend takes the mask options: "auto" picks as for the plain loss (the native kernel for CPU
    # tensors where it is built), INFCL_BACKEND the one it names.
    native = "cpu" if NATIVE_REASON is None else "torch"
    want = native if env is None else env
    assert resolve_backend("auto", torch.device("cpu")) == want
    q, k, labels, q_ids, k_ids, guide = _inputs(8, 8, dtype=torch.float64)
    got = cal_inf_loss(q, k, labels, SCALE, q_ids=q_ids, k_ids=k_ids, multi_positive="mean", guide=guide)
    truth = masked_loss_truth(q, k, labels, SCALE, q_ids=q_ids, k_ids=k_ids, multi_positive="mean", guide=guide)
    assert_close_verbose(got, truth, 1e-10, 1e-10, f"INFCL_BACKEND={env}")


def test_clip_loss_module_takes_the_mask_options():
    q, k, labels, q_ids, k_ids, guide = _inputs(12, 12, dtype=torch.float64, labels="random")
    k_ids = q_ids  # paired images and texts share their ids
    module = InfCLIPLoss(multi_positive="sum", guide_margin=0.2, guide_margin_strategy="relative")
    got = module(q, k, torch.tensor(SCALE, dtype=torch.float64), q_ids=q_ids, k_ids=k_ids, guide=guide)
    want = masked_loss_truth(
        q,
        k,
        None,
        SCALE,
        symmetric=True,
        q_ids=q_ids,
        k_ids=k_ids,
        multi_positive="sum",
        guide=guide,
        guide_margin=0.2,
        guide_margin_strategy="relative",
    )
    assert_close_verbose(got, want, 1e-10, 1e-10, "InfCLIPLoss with masks")
    plain = InfCLIPLoss(backend="torch")
    assert torch.equal(plain(q, k, SCALE, q_ids=torch.arange(12), k_ids=torch.arange(12)), plain(q, k, SCALE)), (
        "distinct ids: the plain loss bit for bit"
    )


@pytest.mark.parametrize("backend", MASK_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
@pytest.mark.parametrize("classes", ("few", "distinct"))  # "distinct": one positive per row in every mode
def test_confident_batch(backend, mode, dtype, classes):
    # Each row's labelled column is the row itself and every other column is at cosine < ~0.5 in D=64:
    # gaps of 20+ logits, so 1 - p at a lone positive is ~1e-9, below float32's spacing near 1. The tiles
    # form it with expm1; the gradients must keep their relative (normwise) precision.
    if backend == "reference":
        pytest.skip("the reference is the vanilla math (lse - S, p - 1): not held to round-off here")
    if backend == "triton" and classes == "distinct":
        pytest.skip("interpreted Triton: distinct ids give its plain loss bit for bit (test_distinct_ids_...)")
    if backend == "triton" and dtype == torch.float64 and mode is not None:
        # The kernels' confident-row formulas are one source for every dtype: float32 runs them for each mode,
        # float64 (its own products and accumulators) for the lone positive.
        pytest.skip("interpreted Triton: float64 with a lone positive only (float32 runs every mode)")
    q, k, labels, q_ids, k_ids, guide = _inputs(17, 17, d=64, dtype=torch.float64, seed=19)
    k[labels] = q
    if classes == "distinct":
        q_ids, k_ids = torch.arange(17), torch.argsort(labels)
    opts = _options("both", mode, q_ids, k_ids, guide)
    scale = torch.tensor(CONFIDENT_SCALE, dtype=torch.float64)
    name = _use(backend)
    for symmetric in (False, True):
        truth = grads_of_inputs(
            lambda a, b, s_, sym=symmetric: masked_loss_truth(a, b, labels, s_, symmetric=sym, reduction="sum", **opts),
            (q, k, scale),
        )
        got = grads_of_inputs(
            lambda a, b, s_, sym=symmetric: cal_inf_loss(
                a, b, labels, s_, symmetric=sym, reduction="sum", backend=name, **opts
            ),
            (q.to(dtype), k.to(dtype), scale.to(dtype)),
        )
        assert_normwise(got, truth, CONFIDENT_BOUND[dtype], f"confident {mode} sym={symmetric}")


# --- the Triton kernels' custom ops ------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.skipif(not TRITON, reason="interpreted Triton")
def test_triton_masked_ops_pass_opcheck():
    """The masked custom ops' schemas, fake impls and mutation declarations hold (torch.library.opcheck)."""
    gen = torch.Generator().manual_seed(41)
    bq, bk, d = 20, 24, 16
    q, k = torch.randn(bq, d, generator=gen), torch.randn(bk, d, generator=gen)
    scale, pos = torch.tensor(SCALE), torch.arange(bq)
    q_ids, k_ids = torch.randint(0, 4, (bq,), generator=gen), torch.randint(0, 4, (bk,), generator=gen)
    gq, gk = torch.randn(bq, 5, generator=gen), torch.randn(bk, 5, generator=gen)
    row_thr, col_thr = torch.randn(bq, generator=gen), torch.randn(bk, generator=gen)
    tiling = _triton_tiny().to_ints()
    masks = (q_ids, k_ids, gq, gk, row_thr, col_thr, "sum")
    torch.library.opcheck(
        torch.ops.infcl.triton_masked_forward_block.default, (q, k, scale, pos, True, *masks, "ieee", tiling)
    )
    stats = torch.stack((torch.full((bq,), 3.0), torch.full((bq,), 0.5)))
    col_stats = torch.stack((torch.full((bk,), 3.0), torch.full((bk,), 0.5)))
    grads = (torch.randn(bq, generator=gen), torch.randn(bk, generator=gen))
    torch.library.opcheck(
        torch.ops.infcl.triton_masked_backward_block.default,
        (
            q,
            k,
            scale,
            pos,
            stats,
            grads[0],
            col_stats,
            grads[1],
            stats,
            col_stats,
            *masks,
            torch.zeros(bq, d),
            torch.zeros(bk, d),
            "ieee",
            tiling,
        ),
    )


@pytest.mark.interpreter
@pytest.mark.skipif(not TRITON, reason="interpreted Triton")
@pytest.mark.parametrize("symmetric", (False, True))
def test_triton_masked_ops_with_kept_sums_pass_opcheck(symmetric):
    """The masked ops with label smoothing's kept sums (forward: [8, n]) and uniform weights (backward)."""
    gen = torch.Generator().manual_seed(43)
    bq, bk, d = 20, 24, 16
    q, k = torch.randn(bq, d, generator=gen), torch.randn(bk, d, generator=gen)
    scale, pos = torch.tensor(SCALE), torch.arange(bq)
    q_ids, k_ids = torch.randint(0, 4, (bq,), generator=gen), torch.randint(0, 4, (bk,), generator=gen)
    gq, gk = torch.randn(bq, 5, generator=gen), torch.randn(bk, 5, generator=gen)
    row_thr = torch.randn(bq, generator=gen)
    col_thr = torch.randn(bk, generator=gen) if symmetric else None
    tiling = _triton_tiny().to_ints()
    masks = (q_ids, k_ids, gq, gk, row_thr, col_thr, "")
    forward = (q, k, scale, pos, symmetric, *masks, "ieee", tiling, True)
    rows, cols = torch.ops.infcl.triton_masked_forward_block(*forward)
    assert rows.shape == (8, bq) and cols.shape == (8, bk if symmetric else 0)
    torch.library.opcheck(torch.ops.infcl.triton_masked_forward_block.default, forward)
    stats = torch.stack((torch.full((bq,), 3.0), torch.full((bq,), 0.5)))
    col_up = (torch.stack((torch.full((bk,), 3.0), torch.full((bk,), 0.5))), torch.randn(bk, generator=gen))
    uniform = (torch.rand(bq, generator=gen), torch.rand(bk, generator=gen) if symmetric else None)
    args = (q, k, scale, pos, stats, torch.randn(bq, generator=gen), *(col_up if symmetric else (None, None)))
    args += (None, None, *masks, torch.zeros(bq, d), torch.zeros(bk, d), "ieee", tiling, *uniform)
    torch.library.opcheck(torch.ops.infcl.triton_masked_backward_block.default, args)


@pytest.mark.interpreter
@pytest.mark.skipif(not TRITON, reason="interpreted Triton")
def test_triton_masked_loss_under_torch_compile():
    """torch.compile traces the masked custom ops (fake impls) and gives the eager result bit for bit (as
    tests/test_triton.py's plain-loss check; fullgraph tracing is the compile gate's, on a GPU target)."""
    q, k, labels, q_ids, k_ids, guide = _inputs(23, 23, dtype=torch.float32, seed=43)
    opts = _options("both", "mean", q_ids, k_ids, guide)
    route = _use("triton")

    def loss(a, b, s):
        return cal_inf_loss(a, b, labels, s, symmetric=True, backend=route, **opts)

    scale = torch.tensor(SCALE)
    eager = grads_of_inputs(loss, (q, k, scale))
    compiled = grads_of_inputs(torch.compile(loss, backend="aot_eager"), (q, k, scale))
    for name, a, b in zip(("loss", "dq", "dk", "dscale"), compiled, eager):
        assert torch.equal(a, b), name
