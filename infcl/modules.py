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

    ``InfCLIPLoss()(image_features, text_features, logit_scale, output_dict=False)`` where
    ``logit_scale`` is the already-exponentiated scale (as open_clip's models return it).

    Under torch.distributed each rank passes its local features and gets its local loss, with
    gradients equal to open_clip's ``ClipLoss(local_loss=True, gather_with_grad=True)``. The
    open_clip constructor arguments ``local_loss``, ``gather_with_grad``, ``cache_labels``, ``rank``,
    ``world_size`` and ``use_horovod`` are accepted for drop-in use and ignored: rank and world come
    from ``group``, and the loss is always local with exact gathered gradients.
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
    ):
        super().__init__()
        if use_horovod:
            raise ValueError("InfCLIPLoss runs its ring over torch.distributed; use_horovod=True is not supported")
        self.group = group
        self.backend = backend

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale, output_dict: bool = False):
        loss = cal_inf_loss(
            image_features, text_features, scale=logit_scale, symmetric=True, group=self.group, backend=self.backend
        )
        return {"contrastive_loss": loss} if output_dict else loss


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
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: Optional[str] = None,
        *,
        group=None,
        backend: str = "auto",
    ):
        super().__init__()
        if dist_impl not in SIGLIP_DIST_IMPLS:
            raise ValueError(f"dist_impl must be one of {SIGLIP_DIST_IMPLS}, got {dist_impl!r}")
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

    def forward(self, image_features: torch.Tensor, text_features: torch.Tensor, logit_scale, logit_bias, output_dict: bool = False):
        self._check_ring()
        loss = cal_siglip_loss(
            image_features, text_features, logit_scale, logit_bias, group=self.group, backend=self.backend
        )
        return {"contrastive_loss": loss} if output_dict else loss
