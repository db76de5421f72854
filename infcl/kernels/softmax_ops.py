"""The softmax (InfoNCE / CLIP) loss's Triton block steps as torch.library custom ops, so the dispatcher and
torch.compile see them (each loss registers its own: the sigmoid loss's in :mod:`.sigmoid`, distillation's in
:mod:`.distill`, the ranks' in :mod:`.rank`, top-k's in :mod:`.topk`):
- ``torch.ops.infcl.triton_forward_block(q, k, scale, pos, symmetric, precision, tiling) -> (rows, cols)``
- ``torch.ops.infcl.triton_backward_block(q, k, scale, pos, row_stats, g_row, col_stats, g_col, dq!, dk!,
  precision, tiling) -> dscale`` (accumulates into dq and dk)

With the mask options (ids, guide; :mod:`infcl.masks`), the same steps as their own ops, the masks as optional
tensors and ``multi_positive`` as "" (None), "mean" or "sum":
- ``torch.ops.infcl.triton_masked_forward_block(q, k, scale, pos, symmetric, q_ids, k_ids, guide_q, guide_k,
  row_threshold, col_threshold, multi_positive, precision, tiling, kept_sums=False) -> (rows [6, Bq], cols [6, Bk])``
  (``[8, n]`` with ``kept_sums``: label smoothing's kept logits' sum and number, :mod:`infcl.masks`)
- ``torch.ops.infcl.triton_masked_backward_block(q, k, scale, pos, row_stats, g_row, col_stats, g_col,
  row_positives, col_positives, q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold, multi_positive,
  dq!, dk!, precision, tiling, row_uniform=None, col_uniform=None) -> dscale`` (``row_uniform`` [Bq] /
  ``col_uniform`` [Bk]: label smoothing's weights, subtracted from dS on each kept entry; :mod:`infcl.contract`)

- ``torch.ops.infcl.triton_guide_label_scores(guide_q, guide_k, pos, feature_dtype, precision) -> [Bq]``: each
  row's guide threshold score G[i, pos[i]] by the masked kernels' guide product (:mod:`.softmax_guide_scores`).

``precision`` is tl.dot's input precision for float32 ("ieee", "tf32", "tf32x3"), resolved by the
caller; ``tiling`` is a :class:`Tiling` as ``Tiling.to_ints()``, or ``[]`` for the defaults
(:func:`infcl.kernels.tiling.target_tiling`, or the autotuner under INFCL_AUTOTUNE=1). cols is ``[2, 0]``
(``[6, 0]``) when not wanted.

Registration: :func:`infcl.kernels.registration.register_op`, the one way every block step is registered.
"""

from typing import List, Optional, Tuple

import torch

from ..masks import MaskOptions
from ..op_fakes import dscale_fake, guide_scores_fake, masked_stats_fake, stats_fake
from . import softmax_backward, softmax_forward, softmax_guide_scores
from .configs import Tiling, autotuning
from .registration import register_op, wrap
from .target import target_facts
from .tiling import target_tiling

Tensor = torch.Tensor


def _tiling(
    tiling: List[int], q: Tensor, precision: str, masked: bool = False, guide: bool = False
) -> Tuple[Tiling, bool]:
    """(the Tiling to use, whether to autotune): the autotuner searches the plain kernels' configs only."""
    if tiling:
        return Tiling.from_ints(tiling), False
    return target_tiling("softmax", q.dtype, precision, q.shape[1], masked, guide), autotuning() and not masked


def _run_forward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    symmetric: bool,
    precision: str,
    tiling: List[int],
    masks: Optional[MaskOptions] = None,
    kept_sums: bool = False,
) -> Tuple[Tensor, Tensor]:
    """The forward ops' one body, plain (``masks`` None) or masked (the masked ops' tiling; ``kept_sums``: the
    kept logits' two more rows): the launch, and an empty placeholder for the one-directional loss's column
    partials (an op returns a tensor, never None)."""
    masked = masks is not None
    chosen, autotune = _tiling(tiling, q, precision, masked, masked and masks.has_guide)
    rows, cols = softmax_forward.softmax_forward(
        q,
        k,
        scale,
        pos.contiguous(),
        symmetric,
        chosen,
        precision or None,
        autotune,
        sms=target_facts().sms,
        wrap=wrap,
        masks=masks,
        kept_sums=kept_sums,
    )
    return rows, (cols if cols is not None else rows.new_empty(rows.shape[0] if masked else 2, 0))


def _run_backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    stats: Tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]],
    dq: Tensor,
    dk: Tensor,
    precision: str,
    tiling: List[int],
    masks: Optional[MaskOptions] = None,
    positives: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
    uniform: Tuple[Optional[Tensor], Optional[Tensor]] = (None, None),
) -> Tensor:
    """The backward ops' one body, plain (``masks`` None) or masked: ``stats`` (row_stats, g_row, col_stats,
    g_col), the masked loss's ``positives`` (row, column) and label smoothing's ``uniform`` weights (row,
    column) as :func:`softmax_backward` takes them."""
    masked = masks is not None
    chosen, autotune = _tiling(tiling, q, precision, masked, masked and masks.has_guide)
    row_stats, g_row, col_stats, g_col = stats
    return softmax_backward.softmax_backward(
        q,
        k,
        scale,
        pos.contiguous(),
        row_stats,
        g_row,
        col_stats,
        g_col,
        dq,
        dk,
        chosen,
        precision or None,
        autotune,
        sms=target_facts().sms,
        wrap=wrap,
        masks=masks,
        row_positives=positives[0],
        col_positives=positives[1],
        row_uniform=uniform[0],
        col_uniform=uniform[1],
    )


def _forward(
    q: Tensor, k: Tensor, scale: Tensor, pos: Tensor, symmetric: bool, precision: str, tiling: List[int]
) -> Tuple[Tensor, Tensor]:
    return _run_forward(q, k, scale, pos, symmetric, precision, tiling)


def _backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    row_stats: Tensor,
    g_row: Tensor,
    col_stats: Optional[Tensor],
    g_col: Optional[Tensor],
    dq: Tensor,
    dk: Tensor,
    precision: str,
    tiling: List[int],
) -> Tensor:
    return _run_backward(q, k, scale, pos, (row_stats, g_row, col_stats, g_col), dq, dk, precision, tiling)


def _contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _mask_options(q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold, multi_positive: str) -> MaskOptions:
    """The masked ops' flat arguments (the schema torch.library needs; the caller flattened them with
    :func:`infcl.backends.triton.softmax.op_masks`) back as the one :class:`MaskOptions` value the launchers
    take. The kernels read ids and thresholds with stride 1: a view (``meta[:, 1]``, ``ids[::2]``, an
    expanded id) is copied (O(B)); the guide features go with their strides."""
    return MaskOptions(
        q_ids=_contiguous(q_ids),
        k_ids=_contiguous(k_ids),
        multi_positive=multi_positive or None,
        guide_q=guide_q,
        guide_k=guide_k,
        row_threshold=_contiguous(row_threshold),
        col_threshold=_contiguous(col_threshold),
    )


def _masked_forward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    symmetric: bool,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    guide_q: Optional[Tensor],
    guide_k: Optional[Tensor],
    row_threshold: Optional[Tensor],
    col_threshold: Optional[Tensor],
    multi_positive: str,
    precision: str,
    tiling: List[int],
    kept_sums: bool = False,
) -> Tuple[Tensor, Tensor]:
    masks = _mask_options(q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold, multi_positive)
    return _run_forward(q, k, scale, pos, symmetric, precision, tiling, masks, kept_sums)


def _masked_backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    row_stats: Tensor,
    g_row: Tensor,
    col_stats: Optional[Tensor],
    g_col: Optional[Tensor],
    row_positives: Optional[Tensor],
    col_positives: Optional[Tensor],
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    guide_q: Optional[Tensor],
    guide_k: Optional[Tensor],
    row_threshold: Optional[Tensor],
    col_threshold: Optional[Tensor],
    multi_positive: str,
    dq: Tensor,
    dk: Tensor,
    precision: str,
    tiling: List[int],
    row_uniform: Optional[Tensor] = None,
    col_uniform: Optional[Tensor] = None,
) -> Tensor:
    masks = _mask_options(q_ids, k_ids, guide_q, guide_k, row_threshold, col_threshold, multi_positive)
    stats, positives = (row_stats, g_row, col_stats, g_col), (row_positives, col_positives)
    uniform = (row_uniform, col_uniform)
    return _run_backward(q, k, scale, pos, stats, dq, dk, precision, tiling, masks, positives, uniform)


def _guide_label_scores(
    guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype, precision: str
) -> Tensor:
    return softmax_guide_scores.guide_label_scores(guide_q, guide_k, pos, feature_dtype, precision or None, wrap=wrap)


forward_block = register_op("triton_forward_block", _forward, stats_fake(3, 2))
backward_block = register_op("triton_backward_block", _backward, dscale_fake, ("dq", "dk"))
# kept_sums: argument 12 after q and k (after scale, pos, symmetric, 6 mask tensors, multi_positive, precision, tiling).
masked_forward_block = register_op("triton_masked_forward_block", _masked_forward, masked_stats_fake(12))
masked_backward_block = register_op("triton_masked_backward_block", _masked_backward, dscale_fake, ("dq", "dk"))
guide_label_scores = register_op("triton_guide_label_scores", _guide_label_scores, guide_scores_fake)


def gemm_equivalents(
    dim: int,
    dtype: torch.dtype,
    device: torch.device,
    precision: str = "ieee",
    masked: bool = False,
    guide: bool = False,
) -> Tuple[int, int]:
    """(forward, backward) GEMM-equivalents (each 2 * Bq * Bk * D flops) with the device's default tiling,
    for either loss: forward 1 (S once; the column stats come from the same tiles), backward S once per
    dq (dk) slice and the product once: 4 while D fits one slice (256 columns by default). ``masked``: the
    masked kernels' tiling; a ``guide`` (of width D) adds its scores' product wherever S is formed."""
    tiling = target_tiling("softmax", dtype, precision, dim, masked, guide)
    slices = [-(-dim // tiling.block_out(config, dim)) for config in (tiling.dq, tiling.dk)]
    per_score = 2 if guide else 1
    return per_score, sum(slices) * per_score + 2
