"""``nn.Module`` wrappers over :func:`infcl.cal_inf_loss`."""

import torch
from torch import nn

from .api import cal_inf_loss


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
