"""Issue 31: a column whose guide features duplicate a row's labelled column ties its threshold exactly.

At ``guide_margin=0`` the rule ``G[i, j] > G[i, label] - margin`` keeps such a duplicate (the same text
twice in a batch) in the softmax, as sentence-transformers' GISTEmbedLoss does (both scores come from one
matrix there). The thresholds come from each backend's own guide-tile arithmetic
(``guide_label_scores``), so a tie cannot split; before, a separate dot product dropped the duplicate
in ~40% of rows (the row's loss went from ~log 2 to ~0).

Each backend is held to the float64 truth of the rule (support.masked_loss_truth) on exactly rounded guide
scores (tests/helpers/exact_scores.py), where a duplicate ties wherever it sits on any CPU, not to the
reference backend, whose one BLAS matrix may round a duplicate's column differently from its original's.
The data keep every other guide score clear of its threshold, so the backends' float32 guide scores decide
as the float64 truth does.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.exact_scores import truth_scores
from helpers.support import TOLERANCE, assert_close_verbose, grads_of_inputs, masked_loss_truth
from infcl import cal_inf_loss
from infcl.backends import unavailable_reason
from infcl.backends.torch_tiles import TorchTilesBackend

NATIVE = unavailable_reason("cpu", torch.device("cpu")) is None
TRITON = unavailable_reason("triton", torch.device("cpu")) is None
BACKENDS = ("torch", "torch-tiny") + (("cpu",) if NATIVE else ()) + (("triton",) if TRITON else ())
TINY_TILES = (3, 5)  # duplicates and their labelled columns fall in different tiles
# A guide score that is not an exact tie lies at least this far from its threshold: float32 guide scores
# (~1e-6 off at D = 384) then fall on the truth's side of it.
CLEAR_OF_TIES = 1e-4


def _backend(name):
    if name == "torch-tiny":
        return TorchTilesBackend(TINY_TILES[0], TINY_TILES[1])  # the torch tiles at these sizes, passed by the call
    return name


def issue_repro(seed=1, b=8, guide_dim=384, guide_dtype=torch.float32):
    """The issue's case: k[1] duplicates k[0] and its guide features gk[1] duplicate gk[0]."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, 16, generator=gen), dim=1)
    k = q.clone()
    k[1] = k[0]
    gq = F.normalize(torch.randn(b, guide_dim, generator=gen), dim=1)
    gk = F.normalize(gq + torch.randn(b, guide_dim, generator=gen), dim=1)
    gk[1] = gk[0]
    return q, k, (gq.to(guide_dtype), gk.to(guide_dtype))


def _with_duplicates(b, seed, guide_dim=24, pairs=((1, 0),)):
    """Paired features with several columns duplicating others (features and guide), across tile edges."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, 8, generator=gen), dim=1)
    k = F.normalize(q + 0.3 * torch.randn(b, 8, generator=gen), dim=1)
    gq = F.normalize(torch.randn(b, guide_dim, generator=gen), dim=1)
    gk = F.normalize(gq + torch.randn(b, guide_dim, generator=gen), dim=1)
    for dst, src in pairs:
        k[dst], gk[dst] = k[src], gk[src]
        q[dst], gq[dst] = q[src], gq[src]  # the same text on both sides: the symmetric direction ties too
    return q, k, (gq, gk)


def _assert_clear_of_ties(guide, symmetric, margin):
    """Every guide score equals its row's threshold exactly or lies CLEAR_OF_TIES from it (both directions)."""
    scores = truth_scores(*guide)
    for g in (scores, scores.T) if symmetric else (scores,):
        gap = (g - (g.diagonal()[:, None] - margin)).abs()
        assert bool(((gap == 0) | (gap > CLEAR_OF_TIES)).all()), f"a guide score within {CLEAR_OF_TIES} of a tie"


def _compare(backend, q, k, guide, symmetric=False, margin=0.0):
    """Loss and gradients of ``backend`` against the float64 truth of the rule (labels: the diagonal)."""
    _assert_clear_of_ties(guide, symmetric, margin)
    atol, rtol = TOLERANCE[torch.float32]

    def ours(q_, k_):
        return cal_inf_loss(
            q_, k_, None, 10.0, symmetric=symmetric, guide=guide, guide_margin=margin, reduction="none", backend=backend
        )

    def truth(q_, k_):
        return masked_loss_truth(
            q_, k_, None, 10.0, symmetric=symmetric, reduction="none", guide=guide, guide_margin=margin
        )

    upstream = torch.linspace(0.5, 1.5, q.shape[0])
    for name, got, want in zip(
        ("loss", "dq", "dk"),
        grads_of_inputs(ours, (q, k), upstream),
        grads_of_inputs(truth, (q.double(), k.double()), upstream),
    ):
        assert_close_verbose(got, want, atol, rtol, f"{backend} {name}")


@pytest.mark.parametrize("guide_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("backend", BACKENDS)
def test_issue_repro_keeps_the_duplicate(backend, guide_dtype):
    be = _backend(backend)
    for seed in range(1, 6 if backend != "triton" else 3):
        q, k, guide = issue_repro(seed, guide_dtype=guide_dtype)
        row0 = cal_inf_loss(q, k, None, 10.0, guide=guide, reduction="none", backend=be)[0]
        # Rows 0 and 1 hold the same logit for columns 0 and 1, the rest below: >= log 2 when the tie is kept
        # (the other kept columns add a little), ~0 when it is dropped.
        assert row0.item() >= math.log(2) - 1e-5, (seed, row0.item())
        _compare(be, q, k, guide)


@pytest.mark.parametrize("symmetric", (False, True))
@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicates_across_tiles_match_reference(backend, symmetric):
    be = _backend(backend)
    b = 23 if backend != "triton" else 19
    for seed in range(3):
        q, k, guide = _with_duplicates(b, seed, pairs=((1, 0), (7, 2), (b - 1, 4), (12, 11)))
        _compare(be, q, k, guide, symmetric=symmetric)


def test_reference_rule_keeps_ties_and_drops_them_at_positive_margin():
    """The rule itself, from one matrix: margin 0 keeps the duplicate (loss ~log 2), a margin drops it."""
    q, k, guide = issue_repro(1)
    kept = cal_inf_loss(q, k, None, 10.0, guide=guide, reduction="none", backend="reference")[0]
    dropped = cal_inf_loss(q, k, None, 10.0, guide=guide, guide_margin=1e-3, reduction="none", backend="reference")[0]
    assert kept.item() >= math.log(2) - 1e-5 and dropped.item() < 1e-2, (kept, dropped)


def test_gist_embed_loss_keeps_a_duplicate_text_like_sentence_transformers():
    """GISTEmbedLoss with the same positive text twice in a batch, at its default margin 0: infcl's loss and
    gradients are sentence-transformers' (which keeps the tie: one matrix)."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import losses as st_losses

    import infcl.sentence_transformers as infcl_losses
    from helpers.st_models import features, loss_and_grads, sentences, tiny_model

    model, guide = tiny_model(), tiny_model(seed=7)
    model.eval()
    guide.eval()
    anchors, positives = sentences(8, 2, seed=3)
    positives[1] = positives[0]
    anchors[5] = anchors[4]
    batch = features(model, [anchors, positives])
    with torch.random.fork_rng():
        theirs = loss_and_grads(st_losses.GISTEmbedLoss(model, guide=guide), model, batch)
        ours = loss_and_grads(infcl_losses.GISTEmbedLoss(model, guide=guide), model, batch)
    assert_close_verbose(ours[0], theirs[0], 0.0, 1e-5, "loss")
    for name, ref in theirs[1].items():
        assert_close_verbose(ours[1][name], ref, 1e-5 * float(ref.abs().max()) + 1e-9, 1e-4, name)
