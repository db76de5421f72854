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

    Under torch.distributed each rank passes its local features and gets its local loss, with
    gradients equal to open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)``. The
    open_clip constructor arguments ``local_loss``, ``gather_with_grad``, ``cache_labels``, ``rank``,
    ``world_size`` and ``use_horovod`` are accepted for drop-in use and ignored: rank and world come
    from ``group``, and the loss is always local with exact gathered gradients.

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
        return {"contrastive_loss": loss} if output_dict else loss


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
