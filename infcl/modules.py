"""``nn.Module`` wrappers over :func:`infcl.cal_inf_loss` and :func:`infcl.cal_siglip_loss`."""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .api import cal_inf_loss
from .ring.layout import LOCAL, ring_group
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

    The defaults are open_clip's, and so are the loss values and gradients they give. As with
    ``ClipLoss``, the batch the loss sees is set by ``rank`` and ``world_size``:

    - ``world_size=1`` (the default) and no ``group``: this rank's features only, with no ring, even under an
      initialized torch.distributed: what ``ClipLoss()`` computes there (each rank's local loss; DDP averages
      the gradients). Changing ``ClipLoss()`` to ``InfCLIPLoss()`` changes nothing in training.
    - ``world_size > 1`` (open_clip's trainer passes ``rank=args.rank, world_size=args.world_size``): the ring
      over the world group, whose size and this process's rank must equal them (else ValueError).
    - ``group=...`` (infcl's own argument): the ring over that group whatever ``world_size`` says (checked
      against it when it is above 1).

    On a ring, ``local_loss`` and ``gather_with_grad`` select what it computes, as in ``ClipLoss``. What
    equals open_clip's, exactly: the loss value on every rank, and the image and text features' gradients on
    every rank. ``logit_scale``'s gradient on each rank is that of this rank's local loss (its rows and
    columns against the whole batch); open_clip's equals it with ``local_loss=True``, and with
    ``local_loss=False`` (global-by-global logits) it is the global loss's on every rank. Their averages over
    the ranks, what DDP applies, are equal in every setting (with equal local batches, as DDP has).

    - ``gather_with_grad=True``: this rank's local loss with exact gathered gradients: the features get the
      gradient of the sum of every rank's loss. ``local_loss=False`` returns the global loss (every rank's,
      averaged by rank sizes) instead of the local one, with the same feature gradients.
    - ``gather_with_grad=False, local_loss=False`` (open_clip's defaults): the global loss, whose gradient
      open_clip takes through this rank's own features only: ``1 / world`` of the gathered gradient for the
      features, as here. So a ring of W ranks trains at 1 / W of ``gather_with_grad=True``'s feature
      gradients, as open_clip does.
    - ``gather_with_grad=False, local_loss=True`` with more than one rank raises ValueError: open_clip's
      gradient then drops the other ranks' terms of this rank's own loss, which the ring does not compute.

    ``cache_labels`` is accepted for drop-in use and ignored (no label matrix is built); ``use_horovod=True``
    raises.

    The mask options of :func:`infcl.cal_inf_loss` (:mod:`infcl.masks`): ``multi_positive``,
    ``guide_margin`` and ``guide_margin_strategy`` are set here; the per-batch ``q_ids`` / ``k_ids`` (one id
    per image / text) and ``guide`` (guide features of the images and texts) are passed to ``forward``.
    ``label_smoothing`` and ``matryoshka`` (prefix dims, or an :class:`infcl.Matryoshka`): those of
    :func:`infcl.cal_inf_loss`.
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
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
        label_smoothing: float = 0.0,
        matryoshka=None,
    ):
        super().__init__()
        if use_horovod:
            raise ValueError("InfCLIPLoss runs its ring over torch.distributed; use_horovod=True is not supported")
        self.local_loss, self.gather_with_grad = local_loss, gather_with_grad
        self.rank, self.world_size = rank, world_size
        self.group = group
        self.backend = backend
        self.multi_positive = multi_positive
        self.guide_margin = guide_margin
        self.guide_margin_strategy = guide_margin_strategy
        self.label_smoothing = label_smoothing
        self.matryoshka = matryoshka

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
        group = loss_group(self, "InfCLIPLoss")
        ring = ring_group(group)
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
            group=group,
            backend=self.backend,
            q_ids=q_ids,
            k_ids=k_ids,
            multi_positive=self.multi_positive,
            guide=guide,
            guide_margin=self.guide_margin,
            guide_margin_strategy=self.guide_margin_strategy,
            label_smoothing=self.label_smoothing,
            matryoshka=self.matryoshka,
        )
        if logit_bias is not None:
            loss = loss + _cancelled_bias(logit_bias, loss)
        if world > 1 and not self.local_loss:
            loss = loss + (rows_mean(loss.detach(), image_features.shape[0], ring) - loss.detach())
        return {"contrastive_loss": loss} if output_dict else loss


def loss_group(module: nn.Module, name: str):
    """The ``group`` argument a drop-in passes to its loss, from open_clip's ``rank`` and ``world_size`` and
    infcl's ``group`` (the module's attributes): :data:`infcl.ring.layout.LOCAL` for ``world_size=1`` without
    a group (open_clip's default: this rank's features only), else the group, checked against ``rank`` and
    ``world_size`` when ``world_size > 1``."""
    if module.group is None and module.world_size <= 1:
        return LOCAL
    if module.world_size > 1:
        ring = ring_group(module.group)
        world, rank = (1, 0) if ring is None else (dist.get_world_size(ring), dist.get_rank(ring))
        if (world, rank) != (module.world_size, module.rank):
            raise ValueError(
                f"{name}(rank={module.rank}, world_size={module.world_size}) does not match the process group: "
                f"this process is rank {rank} of {world}"
                + ("" if ring is not None else " (torch.distributed is not initialized, or the group has one rank)")
            )
    return module.group


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
    row against every text, diagonal positives, the sum divided by the local batch size. infcl's keywords
    ``q_ids`` / ``k_ids`` (per batch, this rank's rows: :func:`infcl.cal_siglip_loss`) make every text with
    the image's id a positive (several captions per image).

    The defaults are open_clip's, and so are the loss values and gradients they give: ``world_size=1`` (the
    default) without a ``group`` compares this rank's features only, even under an initialized
    torch.distributed, as ``SigLipLoss()`` does there. With ``world_size > 1`` (open_clip's trainer passes
    ``rank=args.rank, world_size=args.world_size``) each rank passes its local features and gets exactly
    open_clip's ``SigLipLoss(rank=r, world_size=W)`` value, its rows against every rank's text, with the
    same gradients: image and text features get the gradient of the sum of all ranks' losses, logit_scale
    and logit_bias that of this rank's own loss, so DDP's averaging gives the global-mean gradient.

    open_clip's constructor arguments are accepted for drop-in use:
    - ``cache_labels``: ignored; no label matrix is ever built.
    - ``rank``, ``world_size``: with ``world_size > 1`` the ring runs over ``group`` (default: the world
      group), whose size and this process's rank must equal them at each call (else ValueError).
      ``group=...`` (infcl's own argument) rings over that group whatever ``world_size`` says.
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

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale,
        logit_bias,
        output_dict: bool = False,
        *,
        q_ids: Optional[torch.Tensor] = None,
        k_ids: Optional[torch.Tensor] = None,
    ):
        group = loss_group(self, "InfSigLipLoss")
        loss = cal_siglip_loss(
            image_features,
            text_features,
            logit_scale,
            logit_bias,
            q_ids=q_ids,
            k_ids=k_ids,
            group=group,
            backend=self.backend,
        )
        return {"contrastive_loss": loss} if output_dict else loss
