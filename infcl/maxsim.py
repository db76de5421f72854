"""The MaxSim (late-interaction, ColBERT-style) contrastive loss: ``cal_maxsim_loss``.

Every query is scored against every document by MaxSim, and the loss is the softmax cross-entropy over those
scores, exact and tile by tile (:mod:`infcl.backends.torch_tiles.maxsim`, :mod:`infcl.kernels.maxsim`): never the
[Bq, Bk, Lq, Lk] token scores, nor the [Bq, Bk] scores. Under a ring the documents travel with their token masks
(:mod:`infcl.losses.maxsim`).
"""

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .api import reduce_losses
from .backends import call_backend
from .checks import (
    TOKENS,
    check_features,
    check_reduction,
    global_labels,
    local_labels,
    make_masks,
    make_scale,
    shape_text,
)
from .contract import accum_dtype
from .function import LossPlan, MaxSimLossFunction
from .losses.maxsim import MaxSimSteps
from .ring.layout import exchange_layout, rejected_everywhere, ring_group, single_layout
from .stats import loss_stats


def cal_maxsim_loss(
    q: torch.Tensor,
    docs: torch.Tensor,
    labels=None,
    scale=None,
    *,
    q_mask=None,
    docs_mask=None,
    length_normalize: bool = False,
    reduction: str = "mean",
    q_ids=None,
    k_ids=None,
    group=None,
    backend: str = "auto",
    return_stats: bool = False,
):
    """Contrastive loss over MaxSim scores S = scale * R, exact, without the token scores or S whole.

    R[i, j] = sum_t w[i, t] * max_{u : docs_mask[j, u]} <q[i, t], docs[j, u]>, with w[i, t] = q_mask[i, t] (1 for
    a real query token, 0 for a masked one), divided by the query's real token count with ``length_normalize``
    (MeanMaxSim; a count of 0 divides by 1). Row loss_i = logsumexp_j S[i, j] - S[i, labels_i].

    Args:
        q: [Bq, Lq, D] query token embeddings; float32, bfloat16, float16 or float64, any strides.
        docs: [Bk, Lk, D] document token embeddings, same dtype, device and D as q. Bk > Bq is allowed: with
            ``labels``, the extra documents are negatives (sentence-transformers' query-major layout of N documents
            per query is ``labels = arange(Bq) * N``).
        labels: [Bq] integer index of each query's positive document; None means the diagonal (Bq == Bk). Under a
            ring these are global document indices.
        scale: logit scale (1 / temperature): None (1.0), a number, or a one-element floating tensor, which
            receives its gradient.
        q_mask: None (every token real) or [Bq, Lq] bool, integer or float tensor: nonzero marks a real token. A
            masked query token adds nothing to a score and gets no gradient.
        docs_mask: None or [Bk, Lk] likewise: a masked document token never wins a max and gets no gradient.
        length_normalize: divide each query's score by its real token count (MeanMaxSim).
        reduction: "mean" | "sum" | "none" (per query).
        q_ids, k_ids: [Bq] and [Bk] integer ids, both or neither: a document with the query's id that is not its
            positive is a false negative, left out of the query's softmax. Under a ring, each rank's own.
        group: torch.distributed process group for the ring (default: the world when initialized; "local": none).
            Each rank passes its own queries and documents (any sizes, any Lk: shorter documents are padded to the
            ring's longest, as masked tokens).
        backend: "auto" (the torch tiles, on any device, for now) | "torch" | "triton" (the Triton kernels: CUDA
            tensors, or CPU tensors under TRITON_INTERPRET=1; docs/maxsim.md), or a backend object of those.
        return_stats: also return an :class:`infcl.stats.InfLossStats` (top-1 accuracy, mean positive score S).

    Returns:
        The loss: 0-d, or [Bq] for reduction="none"; float32 for float32/bfloat16/float16 inputs, float64 for
        float64. With return_stats, ``(loss, stats)``.

    Rules: every score accumulates in float32 (float64 for float64 inputs). The gradient of a max goes to one
    document token per (query token, document): the lowest index among equal maxima. A document with no real token
    scores -inf against every query with a real token (the max over no token): it is no negative, and a query
    whose positive it is has an infinite loss; a query with no real token scores 0 against every document (the
    empty sum), so its loss is log of the number of documents it sees and its tokens get no gradient. NaN in a
    real token makes every score it enters NaN (and so the losses and gradients it reaches); a NaN in a masked
    token is never read.
    """
    ring = ring_group(group)
    with rejected_everywhere(ring):
        check_features(q, docs, ("q", "docs"), TOKENS)
        check_reduction(reduction)
        for name, flag in (("length_normalize", length_normalize), ("return_stats", return_stats)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        q_real = _token_mask(q_mask, "q_mask", q, "q")
        docs_real = _token_mask(docs_mask, "docs_mask", docs, "docs")
        firsts = (q[:, 0], docs[:, 0])  # [B, D] views: what the batch-level checks and the layout read
        ids = make_masks(*firsts, q_ids, k_ids, None, None, 0.0, "absolute")
        _, block_backend = call_backend(backend, q.device, "maxsim")
        scale_t = make_scale(scale)
        labels_t = local_labels(labels, q)
    if ring is None:
        layout = single_layout(q.shape[0], docs.shape[0], labels_t)
    else:
        layout = exchange_layout(*firsts, ring, labels_t, ids)
        docs, docs_real = _pad_to_ring(docs, docs_real, ring)
    labels_t = global_labels(labels_t, firsts[0], layout, False, ("q", "docs"))

    weight = _query_weights(q, q_real, length_normalize)
    steps = MaxSimSteps(weight, docs_real, ids)
    plan = LossPlan(backend=block_backend, symmetric=False, layout=layout)
    row_loss, row_info = MaxSimLossFunction.apply(q, docs, scale_t, labels_t, plan, steps)
    loss = reduce_losses(row_loss, reduction)
    return (loss, loss_stats(row_info, None)) if return_stats else loss


def _token_mask(mask, name: str, tokens: torch.Tensor, tokens_name: str) -> Optional[torch.Tensor]:
    """``mask``: None or a [B, L] bool / integer / float tensor on the tokens' device; returned as bool (nonzero)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be None or a tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool, integer or float tensor, got {mask.dtype}")
    if tuple(mask.shape) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"{name} must have shape [{tokens.shape[0]}, {tokens.shape[1]}] (one entry per token of {tokens_name} "
            f"{shape_text(tokens)}), got {shape_text(mask)}"
        )
    if mask.device != tokens.device:
        raise ValueError(f"{name} must be on {tokens_name}'s device {tokens.device}, got {mask.device}")
    return mask != 0


def _query_weights(q: torch.Tensor, real: Optional[torch.Tensor], length_normalize: bool) -> torch.Tensor:
    """[Bq, Lq] in the accumulation dtype: 1 (or 1 / the real token count, at least 1) for a real token, 0 else."""
    acc = accum_dtype(q.dtype)
    if real is None:
        real = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device)
    weight = real.to(acc)
    if length_normalize:
        weight = weight / weight.sum(dim=1, keepdim=True).clamp(min=1)
    return weight.contiguous()


def _pad_to_ring(docs: torch.Tensor, real: Optional[torch.Tensor], ring):
    """The documents padded (as masked tokens) to the ring's longest Lk, with their mask: every rank's block then
    has one shape per document, and every rank sends a mask. Differentiable (the pad's gradient is a slice)."""
    lk = torch.tensor([docs.shape[1]], dtype=torch.int64, device=docs.device)
    dist.all_reduce(lk, op=dist.ReduceOp.MAX, group=ring)
    pad = int(lk) - docs.shape[1]
    if real is None:
        real = torch.ones(docs.shape[:2], dtype=torch.bool, device=docs.device)
    if pad == 0:
        return docs, real
    return F.pad(docs, (0, 0, 0, pad)), F.pad(real, (0, pad), value=False)
