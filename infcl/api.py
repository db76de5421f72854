"""The public entry point: ``cal_inf_loss`` (and ``cal_inf_loss_reference``, the same call on the
materializing reference)."""

from typing import Optional

import torch

from .backends import backend_object, call_backend
from .checks import (
    check_features,
    check_head_dim,
    check_label_smoothing,
    check_reduction,
    global_labels,
    local_labels,
    make_masks,
    make_scale,
)
from .function import InfLossFunction, LossPlan, MatryoshkaLossFunction
from .masks import MaskOptions
from .matryoshka import Prefixes, make_prefixes, prefix_features
from .reference import masked_reference_losses, reference_losses
from .ring.layout import RingLayout, exchange_layout, rejected_everywhere, ring_group, single_layout
from .stats import HAS_POS, loss_stats, reduce_masked


def cal_inf_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    labels=None,
    scale=None,
    head_dim=None,
    *,
    symmetric: bool = False,
    reduction: str = "mean",
    q_ids=None,
    k_ids=None,
    multi_positive=None,
    guide=None,
    guide_margin=0.0,
    guide_margin_strategy: str = "absolute",
    label_smoothing=0.0,
    matryoshka=None,
    group=None,
    backend="auto",
    return_stats: bool = False,
):
    """Contrastive (InfoNCE / CLIP) loss over S = scale * q @ k.T, exact, without materializing S.

    Args:
        q: [Bq, D] query (image) features; any float dtype, any strides.
        k: [Bk, D] key (text) features, same dtype and device as q. Bk > Bq is allowed: the extra
            columns are hard negatives.
        labels: [Bq] integer column index of each row's positive; None means the diagonal (Bq == Bk).
            Under a ring (see ``group``) these are global column indices.
        scale: logit scale (inverse temperature): None (1.0), a Python or NumPy number, or a floating
            tensor with one element (0-d, or open_clip's [1]) such as ``logit_scale.exp()``, which
            receives a gradient in its own shape and dtype.
        head_dim: accepted for compatibility with Inf-CL's ``cal_inf_loss`` and ignored.
        symmetric: return (q->k + k->q) / 2, the CLIP loss, in one fused pass. Needs Bq == Bk and,
            with labels, a permutation (the k->q direction uses its inverse).
        reduction: "mean" | "sum" | "none" (per row; for symmetric, per pair (row_i + column_i) / 2).
            With ``multi_positive``, a row (or column) without a positive has no loss: NaN under "none",
            left out of "sum" and out of "mean"'s count (the mean over the rows and columns that have
            one; 0 if none has).
        q_ids, k_ids: [Bq] and [Bk] integer ids (the same item, or the same class), both or neither, on
            the features' device; under a ring each rank passes its local ones. A column with the row's
            id that is not its positive is a false negative: left out of the row's softmax.
        multi_positive: None (one positive per row: ``labels``), "mean" or "sum": every column with the
            row's id is a positive, and the row loss is the mean over them of lse - S[i, p] ("mean",
            SupCon's L_out) or lse - logsumexp of the positives ("sum", MIL-NCE). Needs the ids.
        guide: None or (guide_q [Bq, D'], guide_k [Bk, D']): another model's features (no gradient; any
            width and float dtype) scoring G = guide_q @ guide_k.T. A column that is not a positive and
            scores G[i, j] > G[i, labels[i]] - guide_margin ("absolute") or > G[i, labels[i]] *
            (1 - guide_margin) ("relative", ``guide_margin_strategy``) is left out (GISTEmbedLoss's rule;
            its relative form is G - |G| * margin, which equals this one where G[i, labels[i]] >= 0).
        label_smoothing: eps in [0, 1], ``F.cross_entropy``'s: the target puts 1 - eps on the positive and
            eps / n on each of the row's n columns (the column's n rows for the k->q direction), so
            row loss_i = lse_i - (1 - eps) * S[i, labels_i] - eps * mean_j S[i, j]. With the mask options
            the uniform part spreads over the columns that stay in the denominator (those a guide or the
            ids leave out get nothing) and the positives' target keeps 1 - eps: the loss is (1 - eps) * the
            masked loss + eps * (lse - the mean logit over the kept columns) for every ``multi_positive``
            ("sum": -log of the positives' total probability). With a guide the call runs on the torch
            tiles (whose masked tiles sum the kept logits) whatever ``backend`` names, "reference" apart.
            See :mod:`infcl.losses.smoothing` and docs/options.md.
        matryoshka: None, an :class:`infcl.Matryoshka` (prefix dims, weights, renormalize) or a sequence of
            prefix dims (weights 1, renormalized): the loss becomes sum_k w_k * loss(S^k), S^k the logits of
            the features' first m_k columns (each prefix divided by its norm where renormalized, as
            sentence-transformers' MatryoshkaLoss does), all K out of one tiled pass forward and one
            backward on the native kernel ("cpu", and "auto" on CPU tensors), the "torch" tiles and "triton"
            (:mod:`infcl.matryoshka`); the other backends run their block operations once per prefix in each
            ring step. With the mask options (ids, ``multi_positive``, ``guide``) the pass stays fused on the
            native kernel, the torch tiles and Triton (each tile's masks formed once for every prefix); the
            chunked route then runs one call per prefix, and so does every backend with label smoothing.
            Dims: distinct integers in [1, D], any order; the guide features are never truncated.
            With return_stats the stats are a dict {dim: InfLossStats}.
        group: torch.distributed process group for the ring over ranks. When torch.distributed is
            initialized and the group (default: the world) has more than one rank, each rank passes
            its local shard and gets the loss of its local rows against the global batch. ``"local"``:
            this rank's batch alone, with no ring, even under an initialized torch.distributed.
        backend: "auto" | "torch" | "cpu" | "triton" | "chunked" | "reference" (see :mod:`infcl.backends`),
            or a backend object with its options, e.g. ``infcl.backends.ChunkedBackend(budget_mb=512)``;
            the environment variable INFCL_BACKEND overrides "auto". The ids, ``multi_positive`` and
            ``guide`` run on every backend.
        return_stats: also return an :class:`infcl.stats.InfLossStats` (top-1 accuracy and mean positive
            logit per direction), read off the loss's own statistics.

    Returns:
        The loss: a 0-d tensor, or [Bq] for reduction="none". It is float32 for float32, bfloat16 and
        float16 inputs (the accumulation dtype) and float64 for float64 inputs. With return_stats,
        ``(loss, stats)``.

    Math: row loss_i = logsumexp_j S[i, j] - S[i, labels_i]; column loss_j = logsumexp_i S[i, j] - S[inv_j, j].
    The mask options change which columns are positives and which are left out: see :mod:`infcl.masks`.
    """
    ring = ring_group(group)
    with rejected_everywhere(ring):
        check_features(q, k)
        check_reduction(reduction)
        check_head_dim(head_dim)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        if not isinstance(return_stats, bool):
            raise TypeError(f"return_stats must be a bool, got {type(return_stats).__name__}")
        masks = make_masks(q, k, q_ids, k_ids, multi_positive, guide, guide_margin, guide_margin_strategy)
        eps = check_label_smoothing(label_smoothing)
        prefixes = make_prefixes(matryoshka, q.shape[1])
        kind = "guided" if masks is not None and masks.has_guide else "softmax"
        # "auto" takes the chunked route for a plain loss where a GPU measured it faster (none yet).
        name, block_backend = call_backend(backend, q.device, kind, operands=(q, k) if masks is None else None)
        scale_t = make_scale(scale)
        labels_t = local_labels(labels, q)
    layout = call_layout(ring, q, k, labels_t, masks)
    labels_t = global_labels(labels_t, q, layout, symmetric)
    options = (symmetric, layout, masks, eps, name, block_backend, reduction)
    if prefixes is not None:
        return matryoshka_loss(q, k, scale_t, labels_t, prefixes, options, return_stats)
    loss, row_info, col_info = _one_loss(q, k, scale_t, labels_t, *options, return_stats)
    return (loss, loss_stats(row_info, col_info)) if return_stats else loss


def _one_loss(q, k, scale_t, labels_t, symmetric, layout, masks, eps, name, block_backend, reduction, with_info):
    """(loss, row info, column info or None) of one call, validated; the infos may be None unless ``with_info``.
    ``name``, ``block_backend``: the call's backend (:func:`infcl.backends.call_backend`; None for "reference")."""
    row_info = col_info = None
    if name == "reference" and masks is None:
        row_loss, col_loss = reference_losses(q, k, scale_t, labels_t, symmetric, layout, eps)
        if with_info:
            with torch.no_grad():
                (_, row_info), (_, col_info) = masked_reference_losses(q, k, scale_t, labels_t, symmetric, layout, None)
    elif name == "reference":
        (row_loss, row_info), (col_loss, col_info) = masked_reference_losses(
            q, k, scale_t, labels_t, symmetric, layout, masks, eps
        )
    else:
        block_backend = smoothing_backend(block_backend, masks, eps)
        plan = LossPlan(block_backend, symmetric, layout, masks, label_smoothing=eps)
        row_loss, col_loss, row_info, col_info = InfLossFunction.apply(q, k, scale_t, labels_t, plan)
        col_info = col_info if symmetric else None
    return _reduced(row_loss, col_loss, row_info, col_info, symmetric, masks, reduction), row_info, col_info


def _reduced(row_loss, col_loss, row_info, col_info, symmetric: bool, masks, reduction: str) -> torch.Tensor:
    """One loss's reduction: the plain one, or with mask options over the rows (columns) that have a positive."""
    if masks is None:
        return reduce_losses((row_loss + col_loss) / 2 if symmetric else row_loss, reduction)
    col_valid = col_info[HAS_POS] > 0 if symmetric else None
    return reduce_masked(row_loss, col_loss if symmetric else None, row_info[HAS_POS] > 0, col_valid, reduction)


def smoothing_backend(block_backend, masks, eps: float):
    """The backend of a call's blocks: ``block_backend``, but label smoothing with a guide runs on the torch tiles
    where the backend's masked tiles do not sum the kept logits (``kept_sums``: the torch tiles, the native
    kernel, the Triton kernels and the chunked route, whose masked blocks are the fused kernels', all do; a
    backend object of the user's without it does not; :mod:`infcl.losses.smoothing`), so that one backend's
    guide arithmetic decides both the thresholds and the exclusions."""
    if not eps or masks is None or not masks.has_guide or getattr(block_backend, "kept_sums", False):
        return block_backend
    return backend_object("torch")


def cal_inf_loss_reference(q: torch.Tensor, k: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """:func:`cal_inf_loss` with ``backend="reference"``: the same arguments (but ``backend``) and validation,
    computed on materialized logits (:mod:`infcl.reference`, O(Bq * Bk) memory), for tests and A/B checks."""
    return cal_inf_loss(q, k, *args, backend="reference", **kwargs)


def call_layout(ring, q: torch.Tensor, k: torch.Tensor, labels, masks: Optional[MaskOptions] = None) -> RingLayout:
    """This call's ring layout: a single process, or every rank's sizes (and mask options) exchanged over ``ring``."""
    if ring is None:
        return single_layout(q.shape[0], k.shape[0], labels)
    return exchange_layout(q, k, ring, labels, masks)


def reduce_losses(per_item: torch.Tensor, reduction: str) -> torch.Tensor:
    """The local reduction: mean or sum over this rank's items, or the items themselves ("none")."""
    if reduction == "mean":
        return per_item.mean()
    if reduction == "sum":
        return per_item.sum()
    return per_item


def fused_matryoshka(block_backend, masks: Optional[MaskOptions], eps: float, name: str) -> bool:
    """Whether a Matryoshka call runs all its prefixes in one pass (:class:`MatryoshkaLossFunction`): not on
    "reference", not with label smoothing, and with mask options only on a backend whose ``masked_matryoshka``
    attribute says it holds the fused masked block operations."""
    if name == "reference" or eps:
        return False
    return masks is None or getattr(block_backend, "masked_matryoshka", False)


def matryoshka_loss(q, k, scale_t, labels_t, prefixes: Prefixes, options, return_stats):
    """sum_k w_k * (prefix k's loss, reduced), and with return_stats {dim: InfLossStats} in the order given.

    :class:`MatryoshkaLossFunction` (:func:`fused_matryoshka`): the plain loss (one fused pass on the native
    kernel, the torch tiles and Triton; the other backends' block operations once per prefix inside each ring
    step) and the mask options on a backend with fused masked blocks (``masked_matryoshka``: the torch tiles,
    the native kernel and Triton). Otherwise (label smoothing; masks on the chunked route; "reference"): one call
    per prefix on the prefix's features."""
    symmetric, layout, masks, eps, name, block_backend, reduction = options
    if fused_matryoshka(block_backend, masks, eps, name):
        plan = LossPlan(block_backend, symmetric, layout, masks, prefixes=prefixes)
        row_loss, col_loss, row_info, col_info = MatryoshkaLossFunction.apply(q, k, scale_t, labels_t, plan)
        losses, infos = [], []
        for i in range(prefixes.count):
            infos.append((row_info[i], col_info[i] if symmetric else None))
            losses.append(_reduced(row_loss[i], col_loss[i], *infos[-1], symmetric, masks, reduction))
    else:
        results = [
            _one_loss(*prefix_features(q, k, prefixes, i), scale_t, labels_t, *options, return_stats)
            for i in range(prefixes.count)
        ]
        losses, infos = [r[0] for r in results], [r[1:] for r in results]
    loss = sum(w * part for w, part in zip(prefixes.weights, losses))
    if not return_stats:
        return loss
    stats = {}
    for position in range(prefixes.count):  # the user's order
        i = prefixes.order.index(position)
        stats[prefixes.dims[i]] = loss_stats(*infos[i])
    return loss, stats
