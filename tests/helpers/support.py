"""Shared test parameters, the float64 ground truth, and a verbose allclose."""

import os

import pytest
import torch
import torch.nn.functional as F

from helpers import open_clip_loss
from helpers.exact_scores import truth_scores
from infcl.backends import unavailable_reason

# Deliberately odd sizes: none is a multiple of a tile; 1 and D=1 are the degenerate ends.
ODD_BATCHES = (1, 7, 129, 257, 1000)
ODD_DIMS = (1, 3, 384, 1000)

# (dtype, atol, rtol) for comparing against the float64 truth. fp32 is held to round-off; the low
# precision dtypes are additionally held to "no worse than torch itself in that dtype" (assert_no_worse).
DTYPE_TOLERANCES = (
    (torch.float64, 1e-10, 1e-10),
    (torch.float32, 1e-5, 1e-5),
    (torch.bfloat16, 5e-3, 2e-2),
    (torch.float16, 1e-3, 5e-3),
)
TOLERANCE = {dtype: (atol, rtol) for dtype, atol, rtol in DTYPE_TOLERANCES}
# Confident rows: the positive beats every negative of its row by this many logits, so 1 - P_pos ~
# exp(-margin) is 1e-11 .. 1e-24 (see margin_features).
MARGINS = (25.0, 55.0)
# Normwise error bounds against exact_softmax_truth: float32 keeps ~|S| * eps (|S| <= 100) relative to each
# term; float64 the same with its own eps.
EXACT_NORMWISE = {torch.float32: 1e-4, torch.float64: 1e-9}


# Source embedded in the memory tests' subprocess probes: ``peak_extra_bytes(step)`` runs ``step()`` and
# returns the resident set's growth to its peak during it. Not ru_maxrss: across fork + exec Linux carries
# the parent's high-water mark into it, so under a pytest process grown past the step's own peak it reads
# no growth at all. VmHWM is the process's own, reset here to the current resident set (clear_refs "5"),
# so neither the parent nor what importing torch or a warm-up left behind can hide the step's peak.
PEAK_PROBE = r"""
def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

def peak_extra_bytes(step):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) * 1024
"""


def features_and_labels(bq, bk, d, label_kind, dtype, seed=0):
    """Unit-norm q [bq, d] and k [bk, d] in ``dtype`` (drawn in float64) and labels: "diag" (None),
    "perm" (a permutation of the rows) or "random" (any column, repeats allowed)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(bq, d, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    k = F.normalize(torch.randn(bk, d, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    if label_kind == "diag":
        labels = None
    elif label_kind == "perm":
        labels = torch.randperm(bq, generator=gen)
    else:
        labels = torch.randint(0, bk, (bq,), generator=gen)
    return q, k, labels


def tiled_backends(device: str = "cpu"):
    """Every non-reference backend that runs natively on ``device`` here.

    Triton counts only on a real GPU: under TRITON_INTERPRET=1 each tile op costs ~1 ms of Python, so
    the interpreter gets its own small matrix in test_triton.py instead of the large shared cases.
    """
    names = ["torch"]
    if unavailable_reason("cpu", torch.device(device)) is None:
        names.append("cpu")
    if unavailable_reason("chunked", torch.device(device)) is None:
        names.append("chunked")  # the chunked route (issue 45): torch passes on CPU tensors, cuBLAS + Triton on CUDA
    if device != "cpu" and not interpreting_triton() and unavailable_reason("triton", torch.device(device)) is None:
        names.append("triton")
    return names


def vanilla_loss(q, k, labels=None, scale=1.0, symmetric=False, reduction="mean"):
    """The vanilla loss by F.cross_entropy on materialized logits, in whatever dtype q and k have."""
    logits = scale * q @ k.T
    if labels is None:
        labels = torch.arange(q.shape[0], device=q.device)
    rows = F.cross_entropy(logits, labels, reduction="none")
    per_item = rows
    if symmetric:
        cols = F.cross_entropy(logits.T, torch.argsort(labels), reduction="none")
        per_item = (rows + cols) / 2
    return {"mean": per_item.mean, "sum": per_item.sum, "none": lambda: per_item}[reduction]()


def grads_of(fn, q, k, scale, upstream=None):
    """(loss, dq, dk, dscale) of ``fn(q, k, scale)`` with the given upstream gradient (default ones)."""
    return grads_of_inputs(fn, (q, k, scale), upstream)


def grads_of_inputs(fn, inputs, upstream=None):
    """(loss, *gradients) of ``fn(*inputs)`` by every input, with the given upstream gradient (default ones)."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    loss = fn(*leaves)
    grad_out = torch.ones_like(loss) if upstream is None else upstream.to(loss.dtype)
    return (loss.detach(), *torch.autograd.grad(loss, leaves, grad_out))


def assert_same_bits_on_thread_counts(run, counts=(1, 2, 3)):
    """``run()`` -> (loss, dq) on each intra-op thread count of ``counts`` (restored after): the same bits on every
    count (a native kernel whose tiles and routes are fixed by the shapes, and dq's rows each one lane's)."""
    outputs, before = [], torch.get_num_threads()
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            outputs.append(run())
    finally:
        torch.set_num_threads(before)
    for threads, (loss, dq) in zip(counts[1:], outputs[1:]):
        assert torch.equal(loss, outputs[0][0]), f"{threads} threads: loss differs"
        assert torch.equal(dq, outputs[0][1]), f"{threads} threads: dq differs"


def assert_close_verbose(actual, expected, atol, rtol, what="", magnitude=None):
    """torch.testing-style check that prints the worst offending entries when it fails.

    ``rtol`` is relative to ``|expected|``, or to ``magnitude`` where given: the sum of the absolute
    values of the terms that make up each expected entry (see :func:`siglip_magnitudes`).
    """
    actual = actual.detach().to(torch.float64).cpu()
    expected = expected.detach().to(torch.float64).cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN pattern differs ({int(nan_a.sum())} vs {int(nan_e.sum())} NaNs)"
    err = (actual - expected).abs().nan_to_num(0.0)
    base = expected.abs() if magnitude is None else magnitude.detach().to(torch.float64).cpu()
    bound = atol + rtol * base.nan_to_num(0.0)
    bad = err > bound
    if bad.any():
        flat = (err - bound).flatten()
        worst = torch.topk(flat, min(5, flat.numel())).indices
        lines = []
        for i in worst.tolist():
            idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), actual.shape)) if actual.dim() else ()
            lines.append(f"  at {idx}: got {actual.flatten()[i]:.8g}, expected {expected.flatten()[i]:.8g}")
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} entries beyond atol={atol} rtol={rtol}; "
            f"max abs err {err.max():.3g}\n" + "\n".join(lines)
        )


def assert_ring_matches(ranks, key, truth, atol, rtol, what):
    """Every rank's loss, dq, dk and own dscale of the run ``key`` (``results["cases"][key]`` per rank)
    against the float64 ``truth`` (tests/helpers/ring_cases.py's Truth), and the dscale summed over ranks against
    the full derivative of the sum of every rank's loss."""
    for r, results in enumerate(ranks):
        got = results["cases"][key]
        for name, want in (("loss", truth.loss), ("dq", truth.dq), ("dk", truth.dk), ("dscale", truth.dscale)):
            assert_close_verbose(got[name], want[r], atol, rtol, f"{what} rank={r} {name}")
    total = sum(results["cases"][key]["dscale"].double() for results in ranks)
    assert_close_verbose(total, truth.dscale_full, atol, rtol, f"{what} sum of dscale")


def assert_no_worse(ours, torch_lowp, truth, atol, rtol, what=""):
    """Low precision: |ours - truth| <= |torch_in_dtype - truth| + (atol + rtol*|truth|), elementwise."""
    ours, torch_lowp, truth = (t.detach().to(torch.float64).cpu() for t in (ours, torch_lowp, truth))
    slack = (torch_lowp - truth).abs() + atol + rtol * truth.abs()
    err = (ours - truth).abs()
    bad = err > slack
    if bad.any():
        i = int(torch.argmax((err - slack).flatten()))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} entries worse than torch's own low-precision error; "
            f"worst: ours err {err.flatten()[i]:.3g} vs torch err {(torch_lowp - truth).abs().flatten()[i]:.3g}"
        )


def interpreting_triton() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def open_clip_loss_module():
    """open_clip's loss module loaded by file (helpers/open_clip_loss.py); skips the test without open_clip."""
    module = open_clip_loss.load()
    if module is None:
        pytest.skip("open_clip is not installed")
    return module


def siglip_magnitudes(q, k, scale, bias, labels=None, reduction="mean", upstream=None, ids=None):
    """For the sigmoid loss's (loss, dq, dk, dscale, dbias): each entry's sum of |terms|, in float64.

    Every output of the sigmoid loss is a sum over Bk (or Bq) terms, each carrying the rounding of its
    logit, and the feature gradients' terms cancel (sigmoid's derivative has no row-sum-to-one like
    softmax's), so in float32 no algorithm -- torch's own materialized loss included -- keeps a small
    error relative to such a result; the forward error of a sum is bounded relative to the sum of its
    terms' magnitudes. Tolerances for these outputs are taken relative to that (loss: the terms are
    positive, so it is the loss itself). ``ids``: (q_ids, k_ids) in place of ``labels`` (:func:`siglip_signs`).
    """
    q, k = q.double(), k.double()
    scale, bias = torch.as_tensor(scale, dtype=torch.float64), torch.as_tensor(bias, dtype=torch.float64)
    bq = q.shape[0]
    raw = q @ k.T
    logits = scale * raw + bias
    signs = siglip_signs(logits, labels, ids)
    g = torch.ones(()) if upstream is None else upstream.double()
    g = (g.abs() / (bq if reduction == "mean" else 1)).expand(bq)
    ds = g[:, None] * torch.sigmoid(-signs * logits)  # |d loss / d logit|
    loss = siglip_truth(q, k, scale, bias, labels, reduction, ids).abs()
    return loss, scale.abs() * ds @ k.abs(), scale.abs() * ds.T @ q.abs(), (ds * raw.abs()).sum(), ds.sum()


def siglip_signs(logits, labels=None, ids=None):
    """z [Bq, Bk]: +1 at each row's label (None: the diagonal) or, with ``ids`` (q_ids, k_ids), wherever the
    row's and the column's ids are equal; -1 elsewhere."""
    if ids is not None:
        return torch.where(ids[0][:, None] == ids[1][None, :], 1.0, -1.0).to(logits)
    if labels is None:
        labels = torch.arange(logits.shape[0], device=logits.device)
    return torch.full_like(logits, -1.0).scatter_(1, labels[:, None], 1.0)


def siglip_truth(q, k, scale, bias, labels=None, reduction="mean", ids=None):
    """The sigmoid loss on materialized logits in q's dtype: sum_j -logsigmoid(z_ij * L_ij) per row (z:
    :func:`siglip_signs`)."""
    logits = scale * q @ k.T + bias
    signs = siglip_signs(logits, labels, ids)
    rows = -F.logsigmoid(signs * logits).sum(dim=1)
    return {"mean": rows.mean, "sum": rows.sum, "none": lambda: rows}[reduction]()


def _exact_direction(s: torch.Tensor, labels: torch.Tensor):
    """Row losses and g-free dS = P - Y of one direction of the softmax loss, without cancellation.

    Relative to the positive logit (d_j = s_j - s_pos) and to c = max(0, max_j d_j):
    rest = sum_{j != pos} exp(d_j - c), loss = log1p(rest) when c = 0 (the positive is the maximum),
    else c + log(exp(-c) + rest); P_j = exp(d_j - c) / (exp(-c) + rest) off the positive and
    1 - P_pos = rest / (exp(-c) + rest). Nothing is ever formed as 1 + tiny or 1 - p, so a confident
    row's loss (~1e-20) and its gradient keep float64's relative precision.
    """
    n = s.shape[0]
    onehot = torch.zeros_like(s, dtype=torch.bool)
    onehot[torch.arange(n), labels] = True
    d = s - s[onehot][:, None]
    c = d.masked_fill(onehot, float("-inf")).amax(dim=1, keepdim=True).clamp(min=0.0)
    e = torch.exp(d - c).masked_fill(onehot, 0.0)
    rest = e.sum(dim=1, keepdim=True)
    top = torch.exp(-c)  # the positive's own term, exactly 1 where it is the maximum
    loss = torch.where(c == 0, torch.log1p(rest), c + torch.log(top + rest))[:, 0]
    ds = torch.where(onehot, -rest / (top + rest), e / (top + rest))
    return loss, ds


def exact_softmax_truth(q, k, scale, labels=None, symmetric=False):
    """(row losses, dq, dk, dscale) of ``cal_inf_loss(..., reduction="none")`` under an upstream gradient of
    ones, in float64 and free of cancellation (see :func:`_exact_direction`): exact to float64 round-off
    even where 1 - P_pos is 1e-24, where the materialized float64 loss rounds log(1 + rest) and P to 1.

    q [Bq, D], k [Bk, D], scale a number or 0-d tensor; labels [Bq] (None: the diagonal), a permutation
    for ``symmetric``, whose loss i is (row_i + column_i) / 2, column i's positive being row labels^-1[i].
    """
    q, k = q.detach().double().cpu(), k.detach().double().cpu()
    scale = torch.as_tensor(scale, dtype=torch.float64).detach().cpu()
    labels = torch.arange(q.shape[0]) if labels is None else labels.cpu()
    raw = q @ k.T
    s = scale * raw
    loss, ds = _exact_direction(s, labels)
    if symmetric:
        col_loss, col_ds = _exact_direction(s.T, torch.argsort(labels))
        loss, ds = (loss + col_loss) / 2, (ds + col_ds.T) / 2
    return loss, scale * ds @ k, scale * ds.T @ q, (ds * raw).sum()


def margin_features(b, d, scale, symmetric, seed):
    """(q, k, labels) in float64 where every row's positive logit beats the row's largest negative by a
    margin in MARGINS (and, symmetric, every column's likewise).

    Row i's positive k[labels[i]] is a noisy copy of u_i, q_i = u_i times a factor (a margin is linear in
    it). One-directional: a factor per row, its margin drawn uniformly from MARGINS. Symmetric: one
    factor for all rows, so that the columns stay confident too (per-row factors would lift some rows'
    negatives above other columns' positives), the largest row or column margin MARGINS[1] and the
    smallest about 35.
    """
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randperm(b, generator=gen)
    u = F.normalize(torch.randn(b, d, generator=gen, dtype=torch.float64), dim=1)
    k = torch.empty_like(u)
    k[labels] = F.normalize(u + 0.1 * torch.randn(b, d, generator=gen, dtype=torch.float64) / d**0.5, dim=1)
    s = scale * u @ k.T
    onehot = torch.zeros_like(s, dtype=torch.bool)
    onehot[torch.arange(b), labels] = True
    negatives = s.masked_fill(onehot, float("-inf"))
    rows = s[onehot] - negatives.amax(dim=1)
    if symmetric:
        cols = s.T[onehot.T] - negatives.amax(dim=0)
        factor = MARGINS[1] / torch.cat((rows, cols)).max()
    else:
        factor = (MARGINS[0] + (MARGINS[1] - MARGINS[0]) * torch.rand(b, generator=gen, dtype=torch.float64)) / rows
        factor = factor[:, None]
    return u * factor, k, labels


def assert_normwise(got, truth, bound, what="", names=("loss", "dq", "dk", "dscale")):
    """||got - truth|| <= bound * ||truth|| (Frobenius) for each output."""
    for name, a, t in zip(names, got, truth):
        err = float((a.detach().double().cpu() - t).norm() / t.norm())
        assert err <= bound, f"{what} {name}: normwise error {err:.3g} > {bound:g}"


# --- the mask options (issue 23): an independent float64 truth, row by row with Python sets ---------------


def _masked_direction_truth(logits, labels, ids, other_ids, scores, multi_positive, margin, strategy):
    """Row losses of one direction (NaN where a row has no positive), from sets built entry by entry."""
    n, m = logits.shape
    losses = []
    for i in range(n):
        label = int(labels[i])
        same = set() if ids is None else {j for j in range(m) if int(ids[i]) == int(other_ids[j])}
        positives = {label} if multi_positive is None else same
        excluded = same - positives
        if scores is not None:
            pos_score = float(scores[i, label])
            threshold = pos_score - margin if strategy == "absolute" else pos_score * (1 - margin)
            excluded |= {j for j, g in enumerate(scores[i].tolist()) if g > threshold} - positives
        if not positives:
            losses.append(logits.new_tensor(float("nan")))
            continue
        kept = [j for j in range(m) if j not in excluded]
        pos = logits[i, sorted(positives)]
        # lse(kept) - (the positives' term) without cancellation, so that a confident row's ~1e-12 loss
        # keeps its digits: relative to the positives' lse ("sum") or to the largest positive, log1p of
        # the rest (positives are never excluded, so they are among the kept columns).
        # (A lone positive adds no shift term at all: its +1 and -1 would meet in the gradient of S_pos
        # beside the tiny -tail / (1 + tail) and round it.)
        if multi_positive == "sum":
            rest = [j for j in kept if j not in positives]
            ref, shift = torch.logsumexp(pos, dim=0), None
        else:
            top = max(positives, key=lambda j: float(logits[i, j].detach()))
            rest = [j for j in kept if j != top]
            ref, shift = logits[i, top], (logits[i, top] - pos.mean()) if len(positives) > 1 else None
        tail = torch.exp(logits[i, rest] - ref).sum()  # 0, in the graph, when nothing is left
        losses.append(torch.log1p(tail) if shift is None else torch.log1p(tail) + shift)
    return torch.stack(losses)


def masked_truth_directions(
    q,
    k,
    labels=None,
    scale=1.0,
    *,
    symmetric=False,
    q_ids=None,
    k_ids=None,
    multi_positive=None,
    guide=None,
    guide_margin=0.0,
    guide_margin_strategy="absolute",
):
    """Issue 23's row losses [Bq] and, symmetric, column losses [Bk] (else None) in float64, differentiable
    in q, k and a tensor scale; NaN where a row (column) has no positive."""
    q, k = q.double(), k.double()
    scale = scale.double() if torch.is_tensor(scale) else scale
    logits = scale * q @ k.T
    labels = torch.arange(q.shape[0]) if labels is None else labels.cpu()
    scores = None if guide is None else truth_scores(guide[0], guide[1])  # exactly rounded: duplicates tie
    ids = (None, None) if q_ids is None else (q_ids.cpu(), k_ids.cpu())
    args = (multi_positive, guide_margin, guide_margin_strategy)
    rows = _masked_direction_truth(logits, labels, ids[0], ids[1], scores, *args)
    if not symmetric:
        return rows, None
    scores_t = None if scores is None else scores.T
    return rows, _masked_direction_truth(logits.T, torch.argsort(labels), ids[1], ids[0], scores_t, *args)


def reduce_masked_truth(rows, cols, reduction):
    """Rows (and columns) without a positive (NaN): NaN under "none", left out of "sum" and of "mean"'s
    count; symmetric "mean" is the mean over the rows and columns that have a positive."""
    parts = [rows] if cols is None else [rows, cols]
    if reduction == "none":
        return sum(parts) / len(parts)
    kept = [torch.where(torch.isnan(p), 0.0, p) for p in parts]
    total = sum(p.sum() for p in kept) / len(parts)
    if reduction == "sum":
        return total
    count = sum(int((~torch.isnan(p)).sum()) for p in parts) / len(parts)
    return total / max(count, 1)


def masked_loss_truth(q, k, labels=None, scale=1.0, *, symmetric=False, reduction="mean", **options):
    """The loss of issue 23's definition in float64 (differentiable in q, k and a tensor scale); ``options``:
    q_ids, k_ids, multi_positive, guide, guide_margin, guide_margin_strategy as ``cal_inf_loss`` takes them."""
    rows, cols = masked_truth_directions(q, k, labels, scale, symmetric=symmetric, **options)
    return reduce_masked_truth(rows, cols, reduction)


# The bfloat16 GEMM routes of csrc/common.h (INFCL_BF16_GEMM forces one; "auto" picks by CPU).
BF16_ROUTES = ("mkl", "brgemm", "float32")


def force_bf16_route(monkeypatch, route, probe):
    """Force the native kernels' bfloat16 ``route``, or skip where the kernel says this CPU / torch build cannot
    take it: ``probe()`` runs one tiny bfloat16 op, which raises naming INFCL_BF16_GEMM then."""
    monkeypatch.setenv("INFCL_BF16_GEMM", route)
    try:
        probe()
    except RuntimeError as error:
        if f"INFCL_BF16_GEMM={route}:" not in str(error):
            raise
        pytest.skip(str(error).splitlines()[0])
