"""``nn.Module`` wrappers over :func:`infcl.cal_inf_loss` and :func:`infcl.cal_siglip_loss`."""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .api import cal_inf_loss
from .ring.layout import ring_group
from .siglip import cal_siglip_loss

# open_clip's SigLipLoss(dist_impl=...) choices (None means its default, "bidir").
SIGLIP_DIST_IMPLS = (None, "bidir", "shift", "reduce", "gather")


class InfCLIPLoss(nn.Module):
    """Drop-in for open_clip's ``ClipLoss``: the symmetric CLIP loss, without the B x B logits.

    ``InfCLIPLoss()(image_features, text_features, logit_scale, logit_bias=None, output_dict=False)``
    where ``logit_scale`` is the already-exponentiated scale (as open_clip's models return it), so that
    open_clip's training code can pass ``**model_out``.

    ``logit_bias`` (a scalar tensor or None), as in open_clip's ``ClipLoss``: the logits become
    ``logit_scale * image @ text.T + logit_bias``. A bias shared by every logit cancels in each row's
    and column's softmax, so the loss and the feature and scale gradients are those without it, and the
    bias gets its exact gradient, zero. It stays in the autograd graph (its ``.grad`` is a zero tensor,
    as with open_clip, not None) and a NaN or infinite bias makes the loss NaN, as it does upstream.

    Under torch.distributed each rank passes its local features; the ring (``group``, default the
    world) gives every rank's rows every rank's columns. open_clip's ``local_loss`` and
    ``gather_with_grad`` select what it computes, as in open_clip's ``ClipLoss``:

    - ``gather_with_grad=True`` (the defaults here): this rank's local loss (its rows and its columns
      against the whole batch) with exact gathered gradients: image and text features get the gradient
      of the sum of every rank's loss, ``logit_scale`` that of this rank's. ``local_loss=False`` only
      changes the value returned: the global loss (every rank's, averaged by rank sizes), as open_clip's
      global-by-global matrix gives it; the gradients are the same, so DDP's averaging gives the gradient
      of the global loss either way.
    - ``gather_with_grad=False, local_loss=False`` (open_clip's own defaults): the global loss, whose
      gradient open_clip takes through this rank's own features only: ``1 / world`` of the gathered
      gradient for the features, as here; ``logit_scale``'s DDP average is the same as open_clip's.
    - ``gather_with_grad=False, local_loss=True`` with more than one rank raises ValueError: open_clip's
      gradient then drops the other ranks' terms of this rank's own loss, which the ring does not compute.

    ``cache_labels``, ``rank`` and ``world_size`` are accepted for drop-in use and ignored (rank and world
    come from ``group``); ``use_horovod=True`` raises.

    The mask options of :func:`infcl.cal_inf_loss` (:mod:`infcl.masks`): ``multi_positive``,
    ``guide_margin`` and ``guide_margin_strategy`` are set here; the per-batch ``q_ids`` / ``k_ids`` (one id
    per image / text) and ``guide`` (guide features of the images and texts) are passed to ``forward``.
    """

    def __init__(
        self,
        local_loss: bool = True,
        gather_with_grad: bool = True,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
        *,
        group=None,
        backend: str = "auto",
        multi_positive: Optional[str] = None,
        guide_margin: float = 0.0,
        guide_margin_strategy: str = "absolute",
    ):
        super().__init__()
        if use_horovod:
            raise ValueError("InfCLIPLoss runs its ring over torch.distributed; use_horovod=True is not supported")
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self.group = group
        self.backend = backend
        self.multi_positive = multi_positive
        self.guide_margin = guide_margin
        self.guide_margin_strategy = guide_margin_strategy

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale,
        logit_bias: Optional[torch.Tensor] = None,
        output_dict: bool = False,
        *,
        q_ids: Optional[torch.Tensor] = None,
        k_ids: Optional[torch.Tensor] = None,
        guide=None,
    ):
        ring = ring_group(self.group)
        world = 1 if ring is None else dist.get_world_size(ring)
        if world > 1 and not self.gather_with_grad:
            if self.local_loss:
                raise ValueError(
                    "InfCLIPLoss(local_loss=True, gather_with_grad=False) on more than one rank: open_clip's gradient "
                    "then leaves out the other ranks' terms of this rank's loss, which infcl's ring does not compute; "
                    "use gather_with_grad=True (open_clip's --gather-with-grad)"
                )
            image_features, text_features = (scale_gradient(x, 1.0 / world) for x in (image_features, text_features))
        loss = cal_inf_loss(
            image_features,
            text_features,
            scale=logit_scale,
            symmetric=True,
            group=self.group,
            backend=self.backend,
            q_ids=q_ids,
            k_ids=k_ids,
            multi_positive=self.multi_positive,
            guide=guide,
            guide_margin=self.guide_margin,
            guide_margin_strategy=self.guide_margin_strategy,
        )
        if logit_bias is not None:
            loss = loss + _cancelled_bias(logit_bias, loss)
        if world > 1 and not self.local_loss:
            loss = loss + (rows_mean(loss.detach(), image_features.shape[0], ring) - loss.detach())
        return {"contrastive_loss": loss} if output_dict else loss


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` itself, whose gradient is multiplied by ``factor`` on the way back."""
    return _GradScale.apply(x, factor)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def rows_mean(loss: torch.Tensor, rows: int, ring) -> torch.Tensor:
    """Every rank's local (mean) loss averaged with its number of rows as weight: the global mean loss."""
    total = torch.stack([loss.double() * rows, torch.tensor(float(rows), dtype=torch.float64, device=loss.device)])
    dist.all_reduce(total, group=ring)
    return (total[0] / total[1]).to(loss.dtype)


def _cancelled_bias(logit_bias, loss: torch.Tensor) -> torch.Tensor:
    """The softmax loss's exact dependence on a logit bias shared by every entry: none. Returned as a
    0-d term (0 for a finite bias, NaN otherwise) that keeps ``logit_bias`` in the graph with gradient 0."""
    if not torch.is_tensor(logit_bias):
        logit_bias = torch.as_tensor(logit_bias)
    if logit_bias.numel() != 1:
        raise ValueError(
            f"logit_bias must be a scalar (one element, shared by every logit), got shape {tuple(logit_bias.shape)}"
        )
    if not (logit_bias.is_floating_point()):
        raise TypeError(f"logit_bias must be a floating-point tensor, got {logit_bias.dtype}")
    return (logit_bias.reshape(()) * 0).to(device=loss.device, dtype=loss.dtype)


class InfSigLipLoss(nn.Module):
    """Drop-in for open_clip's ``SigLipLoss``: the sigmoid loss, without the B x B logits.

    ``InfSigLipLoss()(image_features, text_features, logit_scale, logit_bias, output_dict=False)`` with
    the already-exponentiated ``logit_scale`` and the ``logit_bias`` that open_clip's SigLIP models return
    (``logit_bias=None``: no bias). The loss is :func:`infcl.cal_siglip_loss` with its defaults: each
    row against every text, diagonal positives, the sum divided by the local batch size.

    Under torch.distributed each rank passes its local features and gets exactly open_clip's
    ``SigLipLoss(rank=r, world_size=W)`` value, its rows against every rank's text, with the same
    gradients: image and text features get the gradient of the sum of all ranks' losses, logit_scale
    and logit_bias that of this rank's own loss, so DDP's averaging gives the global-mean gradient.

    open_clip's constructor arguments are accepted for drop-in use:
    - ``cache_labels``: ignored; no label matrix is ever built.
    - ``rank``, ``world_size``: the ring runs over ``group`` (default: the world group when
      torch.distributed is initialized) with that group's own rank and size. With ``world_size > 1``
      they are checked against it at each call, and a mismatch raises ValueError. The default
      ``world_size=1`` is not checked: under an initialized group of several ranks the loss still spans
      the group (open_clip's SigLipLoss with world_size=1 would compare local features only).
    - ``dist_impl``: one of open_clip's ``None``, "bidir", "shift", "reduce", "gather" (anything else
      raises ValueError) and otherwise ignored: all four give the same loss and gradients, and infcl
      always uses its own ring, which passes text blocks to rank + 1 while it computes the current one.
    - ``chunk_size`` (newer open_clip releases: how many logits to compute at a time): accepted and
      checked (None or a positive int), and otherwise unneeded: infcl's tiles never hold the B x B logits,
      whatever the chunk.
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: Optional[str] = None,
        chunk_size: Optional[int] = None,
        *,
        group=None,
        backend: str = "auto",
    ):
        super().__init__()
        if dist_impl not in SIGLIP_DIST_IMPLS:
            raise ValueError(f"dist_impl must be one of {SIGLIP_DIST_IMPLS}, got {dist_impl!r}")
        positive_int = isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 1
        if chunk_size is not None and not positive_int:
            raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.rank, self.world_size = rank, world_size
        self.group = group
        self.backend = backend

    def _check_ring(self) -> None:
        if self.world_size <= 1:
            return
        ring = ring_group(self.group)
        world, rank = (1, 0) if ring is None else (dist.get_world_size(ring), dist.get_rank(ring))
        if (world, rank) != (self.world_size, self.rank):
            raise ValueError(
                f"InfSigLipLoss(rank={self.rank}, world_size={self.world_size}) does not match the process group: "
                f"this process is rank {rank} of {world}"
                + ("" if ring is not None else " (torch.distributed is not initialized, or the group has one rank)")
            )

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale,
        logit_bias,
        output_dict: bool = False,
    ):
        self._check_ring()
        loss = cal_siglip_loss(
            image_features, text_features, logit_scale, logit_bias, group=self.group, backend=self.backend
        )
        return {"contrastive_loss": loss} if output_dict else loss
