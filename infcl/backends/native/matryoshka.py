"""The softmax loss over Matryoshka prefixes (:mod:`infcl.matryoshka`) on the native CPU kernel: every prefix out
of one tiled pass forward (``torch.ops.infcl.matryoshka_forward_block``) and one backward
(``matryoshka_backward_block``); with the mask options their masked twins ``masked_matryoshka_forward_block`` /
``masked_matryoshka_backward_block`` (the tile's masks formed once for every prefix). The ops:
``csrc/softmax_ops.cpp``; the kernels ``csrc/matryoshka_forward.cpp`` and ``csrc/matryoshka_backward.cpp``.
"""

import torch

from ...contract import Block, Tensor
from ...matryoshka import Prefixes
from .softmax import op_masks


class NativeMatryoshka:
    """The Matryoshka softmax loss's block operations (:class:`infcl.losses.matryoshka.MatryoshkaSteps`)."""

    masked_matryoshka = True  # the mask options in the fused pass (infcl.api.fused_matryoshka)

    def matryoshka_forward_block(self, block: Block, prefixes: Prefixes, symmetric: bool):
        """Plain: (row stats [2, K, Bq], row positives [K, Bq], column stats [2, K, Bk] or None). With
        ``block.masks``: (rows [6, K, Bq], columns [6, K, Bk] or None), the masked rows per prefix."""
        dims, renormalize = prefixes.dims, prefixes.renormalize
        if block.masked:
            rows, cols = torch.ops.infcl.masked_matryoshka_forward_block(
                block.q,
                block.k,
                float(block.scale),
                block.pos,
                bool(symmetric),
                dims,
                renormalize,
                *op_masks(block.masks),
            )
            return rows, (cols if symmetric else None)
        rows, cols = torch.ops.infcl.matryoshka_forward_block(
            block.q, block.k, float(block.scale), block.pos, bool(symmetric), dims, renormalize
        )
        return rows[:2], rows[2], (cols if symmetric else None)

    def matryoshka_backward_block(self, block: Block, prefixes: Prefixes, dq: Tensor, dk: Tensor) -> Tensor:
        """dq, dk accumulated in place; returns dscale [2] (rows' part, columns' part)."""
        head = (block.q, block.k, float(block.scale), block.pos, prefixes.dims, prefixes.renormalize, *block.upstream)
        if not block.masked:
            return torch.ops.infcl.matryoshka_backward_block(*head, dq, dk)
        positives = (block.row_pos_count, block.row_pos_stats, block.col_pos_count, block.col_pos_stats)
        return torch.ops.infcl.masked_matryoshka_backward_block(*head, *op_masks(block.masks), *positives, dq, dk)
