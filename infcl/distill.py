"""``cal_distill_loss``: open_clip's ``DistillClipLoss`` distillation term without the B x B logits, and the
``InfDistillClipLoss`` drop-in for ``DistillClipLoss``.

The math and the partials: :mod:`infcl.losses.distill`; the autograd Function: :mod:`infcl.function`; the tiles:
:mod:`infcl.backends.torch_tiles.distill` (native: :mod:`infcl.backends.native.distill`, Triton:
:mod:`infcl.backends.triton.distill`); the loop over k blocks (one process or a ring of ranks):
:mod:`infcl.ring.driver`.
"""

import torch
import torch.distributed as dist

from .api import reduce_losses
from .backends import backend_for
from .checks import check_features, check_reduction, check_rows_like, make_scale
from .function import DistillLossFunction, LossPlan
from .modules import InfCLIPLoss, loss_group, rows_mean, scale_gradient
from .ring.layout import RingLayout, exchange_layout, rejected_everywhere, ring_group, single_layout


def cal_distill_loss(
    student_q: torch.Tensor,
    student_k: torch.Tensor,
    teacher_q: torch.Tensor,
    teacher_k: torch.Tensor,
    scale=None,
    teacher_scale=None,
    *,
    symmetric: bool = True,
    reduction: str = "mean",
    group=None,
    backend: str = "auto",
) -> torch.Tensor:
    """open_clip's distillation term, ``-(softmax(T) * log_softmax(S)).sum(1)`` per row, exact, without S or T.

    Args:
        student_q, student_k: [Bq, D] and [Bk, D] student features (image, text); any float dtype, one
            dtype and device. They get gradients.
        teacher_q, teacher_k: [Bq, D_T] and [Bk, D_T] the teacher's features of the same rows (any width
            D_T and float dtype, on the same device; computed in the student's accumulation dtype). No
            gradient reaches them (as if detached).
        scale: the student's logit scale (as :func:`infcl.cal_inf_loss` takes it; it gets a gradient):
            S = scale * student_q @ student_k.T. None means 1.
        teacher_scale: the teacher's: T = teacher_scale * teacher_q @ teacher_k.T; no gradient.
        symmetric: (q->k + k->q) / 2, open_clip's (needs Bq == Bk); else the rows only.
        reduction: "mean" | "sum" | "none" (per row; symmetric, per pair (row_i + column_i) / 2).
        group: torch.distributed group to ring over (default: the world when initialized): each rank
            passes its shard (student and teacher alike) and gets the loss of its rows (and columns)
            against the global batch; gradients are those of the sum of every rank's loss.
        backend: "auto" (the native kernel for CPU tensors when it is built, else the torch tiles; on CUDA
            the torch tiles until the Triton kernels have run on a GPU, :mod:`infcl.backends.resolve`;
            ``INFCL_BACKEND`` overrides it), "torch", "cpu" or "triton";
            "reference" raises NotImplementedError.

    Returns:
        The loss: 0-d, or [Bq] for reduction="none"; float32 (float64 for float64 students).

    Math, per row: lse_j(S_ij) - sum_j softmax(T)_ij * S_ij, computed as sum_j softmax(T)_ij * (m_i - S_ij)
    + r_i (non-negative terms) in one pass over the tiles; the backward's dS = softmax(S) - softmax(T).
    """
    ring = ring_group(group)
    with rejected_everywhere(ring):
        check_features(student_q, student_k, names=("student_q", "student_k"))
        check_features(teacher_q, teacher_k, names=("teacher_q", "teacher_k"))
        check_rows_like("teacher_q", teacher_q, "student_q", student_q)
        check_rows_like("teacher_k", teacher_k, "student_k", student_k)
        check_reduction(reduction)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        if symmetric and student_q.shape[0] != student_k.shape[0]:
            raise ValueError(
                f"symmetric=True needs as many q rows as k rows: student_q {list(student_q.shape)}, "
                f"student_k {list(student_k.shape)}"
            )
        impl = backend_for(backend, student_q.device, "distill")
        scale_t = make_scale(scale)
        teacher_scale_t = make_scale(teacher_scale, "teacher_scale").detach()
    layout = _layout(ring, student_q, student_k, teacher_q, symmetric)
    row_loss, col_loss = DistillLossFunction.apply(
        student_q,
        student_k,
        scale_t,
        teacher_q,
        teacher_k,
        teacher_scale_t,
        LossPlan(backend=impl, symmetric=symmetric, layout=layout),
    )
    return reduce_losses((row_loss + col_loss) / 2 if symmetric else row_loss, reduction)


def _layout(ring, q, k, teacher_q, symmetric: bool) -> RingLayout:
    """The ring layout (sizes exchanged); under a ring also checks that every rank's teacher has one width
    and that symmetric shards are square."""
    if ring is None:
        return single_layout(q.shape[0], k.shape[0])
    layout = exchange_layout(q, k, ring)
    mine = torch.tensor([teacher_q.shape[1]], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(layout.world)]
    dist.all_gather(every, mine, group=ring)
    widths = [int(w) for w in every]
    if len(set(widths)) > 1:
        raise ValueError(f"the teacher's feature width must be the same on every rank, got {widths} (by rank)")
    if symmetric and layout.q_sizes != layout.k_sizes:
        raise ValueError(
            f"symmetric=True needs as many q rows as k rows on every rank: q {layout.q_sizes}, k {layout.k_sizes}"
        )
    return layout


class InfDistillClipLoss(InfCLIPLoss):
    """Drop-in for open_clip's ``DistillClipLoss``: the CLIP loss and the distillation term, without B x B logits.

    ``forward(image_features, text_features, logit_scale, dist_image_features, dist_text_features,
    dist_logit_scale, output_dict=False)`` returns ``(contrastive_loss, distill_loss)``, or
    ``{"contrastive_loss": ..., "distill_loss": ...}`` with ``output_dict``, as open_clip's does; the
    scales are the exponentiated ones its models return. The contrastive loss is
    :func:`infcl.cal_inf_loss` (symmetric), the distillation term :func:`cal_distill_loss` (symmetric).
    The teacher ("dist_") gets no gradient (open_clip's training loop runs the teacher under no_grad).
    ``backend`` chooses the backend of both terms ("reference": the distillation term on the torch tiles).

    The constructor arguments and defaults are those of :class:`infcl.InfCLIPLoss`: open_clip's (``rank`` and
    ``world_size`` choosing the local loss or the ring as ``DistillClipLoss`` does; ``cache_labels`` ignored)
    and infcl's ``group``, ``backend`` and mask options (the mask options apply to the contrastive loss).
    ``local_loss`` and ``gather_with_grad`` select what both terms compute, as :class:`infcl.InfCLIPLoss`
    says. What equals open_clip's ``DistillClipLoss`` with the same arguments, exactly: both loss values on
    every rank, and the image and text features' gradients on every rank. ``logit_scale``'s gradient on each
    rank is that of this rank's own terms: equal to open_clip's with ``local_loss=True``; with
    ``local_loss=False`` open_clip gives every rank the global terms' gradient, which differs from this
    rank's (by up to 30 % on a ring of 3 in the tests), and the average over the ranks, which DDP applies, is
    equal.
    """

    def _distill_backend(self) -> str:
        # "reference" (the contrastive loss's materializing check) has no distillation twin: the torch tiles.
        return "torch" if self.backend == "reference" else self.backend

    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale,
        dist_image_features: torch.Tensor,
        dist_text_features: torch.Tensor,
        dist_logit_scale,
        output_dict: bool = False,
    ):
        contrastive = super().forward(image_features, text_features, logit_scale)  # checks the flags
        group = loss_group(self, "InfDistillClipLoss")
        ring = ring_group(group)
        world = 1 if ring is None else dist.get_world_size(ring)
        student = (image_features, text_features)
        if world > 1 and not self.gather_with_grad:  # the global loss through this rank's features only
            student = tuple(scale_gradient(x, 1.0 / world) for x in student)
        distill = cal_distill_loss(
            *student,
            dist_image_features,
            dist_text_features,
            logit_scale,
            dist_logit_scale,
            symmetric=True,
            group=group,
            backend=self._distill_backend(),
        )
        if world > 1 and not self.local_loss:  # the value open_clip's global-by-global logits give
            distill = distill + (rows_mean(distill.detach(), image_features.shape[0], ring) - distill.detach())
        if output_dict:
            return {"contrastive_loss": contrastive, "distill_loss": distill}
        return contrastive, distill


__all__ = ["cal_distill_loss", "InfDistillClipLoss"]
