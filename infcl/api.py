"""The public entry point: ``cal_inf_loss`` (and ``cal_inf_loss_reference``, the same call on the
materializing reference)."""

import torch

from .backends import block_backend, resolve_backend
from .checks import check_features, check_head_dim, check_reduction, global_labels, local_labels, make_scale
from .function import InfLossFunction, LossPlan
from .reference import reference_losses
from .ring.layout import RingLayout, exchange_layout, rejected_everywhere, ring_group, single_layout


def cal_inf_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    labels=None,
    scale=None,
    head_dim=None,
    *,
    symmetric: bool = False,
    reduction: str = "mean",
    group=None,
    backend: str = "auto",
) -> torch.Tensor:
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
        group: torch.distributed process group for the ring over ranks. When torch.distributed is
            initialized and the group (default: the world) has more than one rank, each rank passes
            its local shard and gets the loss of its local rows against the global batch.
        backend: "auto" | "torch" | "cpu" | "triton" | "reference" (see :mod:`infcl.backends`);
            the environment variable INFCL_BACKEND overrides "auto".

    Returns:
        The loss: a 0-d tensor, or [Bq] for reduction="none". It is float32 for float32, bfloat16 and
        float16 inputs (the accumulation dtype) and float64 for float64 inputs.

    Math: row loss_i = logsumexp_j S[i, j] - S[i, labels_i]; column loss_j = logsumexp_i S[i, j] - S[inv_j, j].
    """
    ring = ring_group(group)
    with rejected_everywhere(ring):
        check_features(q, k)
        check_reduction(reduction)
        check_head_dim(head_dim)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        name = resolve_backend(backend, q.device)
        scale_t = make_scale(scale)
        labels_t = local_labels(labels, q)
    layout = call_layout(ring, q, k, labels_t)
    labels_t = global_labels(labels_t, q, layout, symmetric)

    if name == "reference":
        row_loss, col_loss = reference_losses(q, k, scale_t, labels_t, symmetric, layout)
    else:
        plan = LossPlan(backend=block_backend(name), symmetric=symmetric, layout=layout)
        row_loss, col_loss = InfLossFunction.apply(q, k, scale_t, labels_t, plan)
    return reduce_losses((row_loss + col_loss) / 2 if symmetric else row_loss, reduction)


def cal_inf_loss_reference(q: torch.Tensor, k: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """:func:`cal_inf_loss` with ``backend="reference"``: the same arguments (but ``backend``) and validation,
    computed on materialized logits (:mod:`infcl.reference`, O(Bq * Bk) memory), for tests and A/B checks."""
    return cal_inf_loss(q, k, *args, backend="reference", **kwargs)


def call_layout(ring, q: torch.Tensor, k: torch.Tensor, labels) -> RingLayout:
    """This call's ring layout: a single process, or every rank's sizes exchanged over ``ring``."""
    if ring is None:
        return single_layout(q.shape[0], k.shape[0], labels)
    return exchange_layout(q, k, ring, labels)


def reduce_losses(per_item: torch.Tensor, reduction: str) -> torch.Tensor:
    """The local reduction: mean or sum over this rank's items, or the items themselves ("none")."""
    if reduction == "mean":
        return per_item.mean()
    if reduction == "sum":
        return per_item.sum()
    return per_item
