"""The softmax loss over Matryoshka prefixes on the Triton kernels (:mod:`infcl.kernels.matryoshka`; the ring
steps: :mod:`infcl.losses.matryoshka`; the math: :mod:`infcl.matryoshka`), through the custom ops
``torch.ops.infcl.triton_matryoshka_forward_block`` / ``triton_matryoshka_backward_block``: every prefix out of
one walk of the tiles forward and one backward. The prefixes' factors (1 / |x[:m_k]| where renormalized) are
formed here, O(B * D), and the renormalization's own gradient, -a^2 c x[:m_k], is applied here from the
kernels' per-line sums. With the mask options the ops ``triton_masked_matryoshka_forward_block`` /
``triton_masked_matryoshka_backward_block`` (the masked kernels: each tile's masks formed once for every prefix)."""

from typing import Tuple

import torch

from ...contract import Block, Tensor, accum_dtype
from ...kernels.matryoshka_ops import backward_op, forward_op, masked_backward_op, masked_forward_op
from ...matryoshka import Prefixes, prefix_factors
from .options import FALLBACK, TritonOptions, on_torch_tiles
from .softmax import _dtypes, op_masks


def _prefix_args(block: Block, prefixes: Prefixes) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, k in the accumulation dtype, bounds [K + 1] int32 on the device, q's factors [K, Bq], k's [K, Bk])."""
    acc = accum_dtype(block.q.dtype)
    q, k = block.q.to(acc), block.k.to(acc)
    bounds = torch.tensor((0, *prefixes.dims), dtype=torch.int32, device=block.q.device)
    return q, k, bounds, prefix_factors(q, prefixes), prefix_factors(k, prefixes)


class TritonMatryoshka(TritonOptions):
    """The Matryoshka loss's block operations on the kernels (:class:`infcl.losses.matryoshka.MatryoshkaSteps`
    finds them by name), with the mask options too (:class:`~infcl.losses.matryoshka.MaskedMatryoshkaSteps`:
    each tile's positives and exclusions formed once for every prefix)."""

    masked_matryoshka = True  # the mask options in the fused pass (infcl.api.fused_matryoshka)

    def matryoshka_forward_block(self, block: Block, prefixes: Prefixes, symmetric: bool):
        """Plain: (row stats [2, K, Bq], row positives [K, Bq], column stats [2, K, Bk] or None). With
        ``block.masks``: (rows [6, K, Bq], columns [6, K, Bk] or None), the rows of :mod:`infcl.masks` per prefix."""
        if on_torch_tiles(*_dtypes(block)):
            return FALLBACK.matryoshka_forward_block(block, prefixes, symmetric)
        _, _, bounds, q_factors, k_factors = _prefix_args(block, prefixes)
        if block.masked:
            rows, cols = masked_forward_op(
                block.q,
                block.k,
                block.scale,
                block.pos,
                bounds,
                q_factors,
                k_factors,
                symmetric,
                *op_masks(block.masks, symmetric),
                self._options()[0],
            )
            return rows, (cols if symmetric else None)
        rows, cols = forward_op(
            block.q, block.k, block.scale, block.pos, bounds, q_factors, k_factors, symmetric, self._options()[0]
        )
        return rows[:2], rows[2], (cols[:2] if symmetric else None)

    def matryoshka_backward_block(self, block: Block, prefixes: Prefixes, dq: Tensor, dk: Tensor) -> Tensor:
        """dq, dk accumulated in place; returns dscale [2] (rows' part, columns' part). ``block.row_stats``
        [2, K, Bq] and ``block.g_row`` [K, Bq] (symmetric: ``col_stats``, ``g_col`` likewise) per prefix; with
        ``block.masks`` also the positives' count [K, n] ("mean") or stats [2, K, n] ("sum") per prefix."""
        if on_torch_tiles(*_dtypes(block)):
            return FALLBACK.matryoshka_backward_block(block, prefixes, dq, dk)
        q, k, bounds, q_factors, k_factors = _prefix_args(block, prefixes)
        head = (block.q, block.k, block.scale, block.pos, bounds, q_factors, k_factors, *block.upstream)
        if block.masked:
            multi_positive = block.masks.multi_positive
            if multi_positive == "sum":
                positives = (block.row_pos_stats, block.col_pos_stats)
            elif multi_positive == "mean":
                positives = (block.row_pos_count, block.col_pos_count)
            else:  # one positive per row: pos
                positives = (None, None)
            row_sums, col_sums = masked_backward_op(
                *head,
                positives[0],
                positives[1] if block.symmetric else None,
                *op_masks(block.masks, block.symmetric),
                dq,
                dk,
                prefixes.sign_only(0),
                self._options()[0],
            )
        else:
            row_sums, col_sums = backward_op(*head, dq, dk, prefixes.sign_only(0), self._options()[0])
        # The normalization's own gradient, per renormalized prefix: -a_i^2 c_i q_i[:m] with
        # c_i = sum_j dS_ij S_ij = scale * (the row's two sums); columns alike. A one-wide renormalized prefix has
        # none (Prefixes.sign_only: the kernels left it out of the products too); its sums still give dscale.
        for i, (m, renorm) in enumerate(zip(prefixes.dims, prefixes.renormalize)):
            if renorm and not prefixes.sign_only(i):
                c_q = (row_sums[0, i] + row_sums[1, i]) * block.scale
                c_k = (col_sums[0, i] + col_sums[1, i]) * block.scale
                dq[:, :m].sub_(q[:, :m] * (q_factors[i] * q_factors[i] * c_q)[:, None])
                dk[:, :m].sub_(k[:, :m] * (k_factors[i] * k_factors[i] * c_k)[:, None])
        return row_sums.sum(dim=(1, 2))
