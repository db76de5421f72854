"""The softmax loss over Matryoshka prefixes (:mod:`infcl.matryoshka`) on the native CPU kernel: every prefix out
of one tiled pass forward (``torch.ops.infcl.matryoshka_forward_block``) and one backward
(``matryoshka_backward_block``). The ops: ``csrc/softmax_ops.cpp``; the kernels ``csrc/matryoshka_forward.cpp`` and
``csrc/matryoshka_backward.cpp``.
"""

from typing import Optional, Tuple

import torch

from ...contract import Block, Tensor
from ...matryoshka import Prefixes


class NativeMatryoshka:
    """The Matryoshka softmax loss's block operations (:class:`infcl.losses.matryoshka.MatryoshkaSteps`)."""

    def matryoshka_forward_block(
        self, block: Block, prefixes: Prefixes, symmetric: bool
    ) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(row stats [2, K, Bq], row positives [K, Bq], column stats [2, K, Bk] or None)."""
        rows, cols = torch.ops.infcl.matryoshka_forward_block(
            block.q, block.k, float(block.scale), block.pos, bool(symmetric), prefixes.dims, prefixes.renormalize
        )
        return rows[:2], rows[2], (cols if symmetric else None)

    def matryoshka_backward_block(self, block: Block, prefixes: Prefixes, dq: Tensor, dk: Tensor) -> Tensor:
        """dq, dk accumulated in place; returns dscale [2] (rows' part, columns' part)."""
        return torch.ops.infcl.matryoshka_backward_block(
            block.q,
            block.k,
            float(block.scale),
            block.pos,
            prefixes.dims,
            prefixes.renormalize,
            *block.upstream,
            dq,
            dk,
        )
