"""open_clip's own trainer with infcl's losses: one switch on the command line.

    torchrun --nproc_per_node 8 -m infcl.open_clip_train <open_clip_train.main's arguments>

runs ``open_clip_train.main.main`` unchanged except for its loss: where open_clip's ``create_loss`` builds
``ClipLoss`` / ``SigLipLoss`` / ``CoCaLoss`` (which hold the B x B logits, B the global batch), this builds
:class:`infcl.InfCLIPLoss` / :class:`infcl.InfSigLipLoss` / :class:`InfCoCaLoss` from the same arguments
and, for distillation (``--distill-model`` with ``--distill-pretrained``), ``DistillClipLoss`` by
:class:`infcl.distill.InfDistillClipLoss` (:func:`infcl_loss` says which).
``INFCL_BACKEND`` picks the backend (:mod:`infcl.backends`).

Importing this module imports neither open_clip nor open_clip_train (so ``import infcl`` stays free of
them); :func:`main` imports ``open_clip_train.main``, which needs open_clip and torchvision.
"""

import sys
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .distill import InfDistillClipLoss
from .modules import InfCLIPLoss, InfSigLipLoss

# open_clip's CoCaLoss default pad_id: the pad token of open_clip's own tokenizer (create_loss keeps it).
COCA_PAD_ID = 0


class InfCoCaLoss(nn.Module):
    """open_clip's ``CoCaLoss`` with the contrastive part from :class:`infcl.InfCLIPLoss`.

    ``forward(image_features, text_features, logits, labels, logit_scale, output_dict=False)`` returns
    ``(clip_loss_weight * contrastive, caption_loss_weight * caption)`` (or the dict open_clip's trainer
    asks for), the caption loss being the token cross-entropy that ignores ``pad_id``, as open_clip's.
    """

    def __init__(
        self,
        caption_loss_weight: float,
        clip_loss_weight: float,
        pad_id: int = COCA_PAD_ID,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        **clip_kwargs,
    ):
        super().__init__()
        self.clip_loss_weight, self.caption_loss_weight, self.pad_id = clip_loss_weight, caption_loss_weight, pad_id
        self.clip = InfCLIPLoss(local_loss=local_loss, gather_with_grad=gather_with_grad, **clip_kwargs)

    def forward(self, image_features, text_features, logits, labels, logit_scale, output_dict: bool = False):
        if self.clip_loss_weight:
            clip_loss = self.clip_loss_weight * self.clip(image_features, text_features, logit_scale)
        else:
            clip_loss = torch.tensor(0, device=logits.device)
        caption_loss = F.cross_entropy(logits.permute(0, 2, 1), labels, ignore_index=self.pad_id)
        caption_loss = caption_loss * self.caption_loss_weight
        if output_dict:
            return {"contrastive_loss": clip_loss, "caption_loss": caption_loss}
        return clip_loss, caption_loss


def infcl_loss(args) -> nn.Module:
    """infcl's loss for ``open_clip_train``'s parsed ``args``, chosen as open_clip's ``create_loss`` chooses.

    Arguments read, as open_clip's ``create_loss`` reads them: ``distill``, ``model`` (CoCa when its name
    holds "coca"), ``coca_caption_loss_weight``, ``coca_contrastive_loss_weight``, ``siglip``,
    ``loss_dist_impl``, ``local_loss``, ``gather_with_grad``, ``rank``, ``world_size``, ``horovod``.
    ``--horovod`` raises ValueError: infcl's ring runs over torch.distributed.
    """
    if args.horovod:
        raise ValueError("infcl.open_clip_train: --horovod is not supported; infcl's ring runs over torch.distributed")
    clip_flags = {
        "local_loss": args.local_loss,
        "gather_with_grad": args.gather_with_grad,
        "rank": args.rank,
        "world_size": args.world_size,
    }
    if args.distill:
        return InfDistillClipLoss(cache_labels=True, **clip_flags)
    if "coca" in args.model.lower():
        return InfCoCaLoss(
            caption_loss_weight=args.coca_caption_loss_weight,
            clip_loss_weight=args.coca_contrastive_loss_weight,
            **clip_flags,
        )
    if args.siglip:
        return InfSigLipLoss(rank=args.rank, world_size=args.world_size, dist_impl=args.loss_dist_impl)
    return InfCLIPLoss(**clip_flags)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``open_clip_train.main.main(argv)`` (default: this process's arguments) with :func:`infcl_loss` as its
    ``create_loss``."""
    from open_clip_train import main as trainer

    trainer.create_loss = infcl_loss  # main() looks the name up in its module when it builds the loss
    trainer.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
