"""The public entry point of the sigmoid (SigLIP) loss: ``cal_siglip_loss``."""

import torch

from .api import call_layout, reduce_losses
from .backends import call_backend
from .checks import (
    check_features,
    check_reduction,
    global_labels,
    local_labels,
    make_bias,
    make_scale,
    make_sigmoid_ids,
)
from .function import LossPlan, SigmoidLossFunction, SigmoidOnePassFunction, one_pass_sigmoid
from .reference import sigmoid_reference_losses
from .ring.layout import rejected_everywhere, ring_group

NAMES = ("image", "text")  # what the error messages call the two feature arguments


def cal_siglip_loss(
    image: torch.Tensor,
    text: torch.Tensor,
    scale,
    bias,
    labels=None,
    *,
    q_ids=None,
    k_ids=None,
    reduction: str = "mean",
    group=None,
    backend="auto",
) -> torch.Tensor:
    """Sigmoid (SigLIP) loss over L = scale * image @ text.T + bias, exact, without materializing L.

    Args:
        image: [Bq, D] image features; float32 / bfloat16 / float16 / float64, any strides.
        text: [Bk, D] text features, same dtype and device. Bk > Bq is allowed: the extra rows are
            extra negatives (pass ``labels``).
        scale: logit scale, e.g. ``logit_scale.exp()``: a float, or a 0-d / one-element floating tensor
            (it receives a gradient in its own shape); None means 1.
        bias: logit bias, e.g. open_clip's ``logit_bias``: as ``scale``; None means no bias (0).
        labels: [Bq] integer column of each row's positive; None is the diagonal (Bq == Bk). Under a
            ring (see ``group``) these are global column indices.
        q_ids, k_ids: [Bq] and [Bk] integer ids (both or neither, on the features' device; not with
            ``labels``): every column whose id equals the row's is a positive (z = +1), every other column a
            negative (several captions of one image, SigLIP with grouped positives). Under a ring each rank
            passes its local ones; Bq and Bk may then differ on any rank. O(B): the ids travel with their
            rows, the positives are formed inside the tiles.
        reduction: "mean" (the sum over the local rows divided by their count, open_clip's
            ``-logsigmoid(...).sum() / B``), "sum", or "none" (the [Bq] row losses).
        group: torch.distributed process group for the ring over ranks (default: the world group when
            torch.distributed is initialized). Each rank passes its local shard and gets the loss of
            its local rows against every rank's text, as open_clip's ``SigLipLoss(rank, world_size)``.
        backend: "auto" | "torch" | "cpu" | "triton" | "chunked" | "reference" (materialized logits), or a
            backend object with its options (``infcl.backends.ChunkedBackend(budget_mb=512)``), as for
            ``cal_inf_loss``; INFCL_BACKEND overrides "auto".

    Returns:
        0-d, or [Bq] for reduction="none"; float32 for float32/bfloat16/float16 inputs, float64 for float64.

    Math: with z_ij = +1 where j is row i's positive (with ids: where q_ids[i] == k_ids[j]) and -1 elsewhere,
    loss_i = sum_j -log sigmoid(z_ij * L_ij) = sum_j softplus(-z_ij * L_ij) over every global column j.
    Gradients: under a ring, image and text receive the gradient of the sum of every rank's loss, and
    scale and bias the gradient of this rank's own loss (DDP's averaging then gives the global mean).
    """
    ring = ring_group(group)
    with rejected_everywhere(ring):
        check_features(image, text, NAMES)
        check_reduction(reduction)
        plain = q_ids is None and k_ids is None  # where "auto" may take the chunked route (measured_route)
        name, block_backend = call_backend(backend, image.device, "sigmoid", operands=(image, text) if plain else None)
        scale_t = make_scale(scale)
        bias_t = make_bias(bias)
        labels_t = local_labels(labels, image)
        masks = make_sigmoid_ids(image, text, q_ids, k_ids, labels_t, NAMES)
    layout = call_layout(ring, image, text, labels_t, masks)
    if masks is None:
        labels_t = global_labels(labels_t, image, layout, symmetric=False, names=NAMES)
    else:  # the ids name the positives: no row's positive is found by its label
        labels_t = torch.full((image.shape[0],), -1, dtype=torch.int64, device=image.device)
    if name == "reference":
        rows = sigmoid_reference_losses(image, text, scale_t, bias_t, labels_t, layout, masks)
        return reduce_losses(rows, reduction)
    plan = LossPlan(backend=block_backend, symmetric=False, layout=layout, masks=masks)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (image, text, scale_t, bias_t))
    if one_pass_sigmoid(block_backend, reduction, needs_grad, layout):  # the chunked route: loss and gradient at once
        return SigmoidOnePassFunction.apply(image, text, scale_t, bias_t, labels_t, plan, reduction)
    rows = SigmoidLossFunction.apply(image, text, scale_t, bias_t, labels_t, plan)
    return reduce_losses(rows, reduction)
