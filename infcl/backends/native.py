"""The native CPU backend: the fused C++ block kernel (the repository's ``csrc/``).

The kernel registers the custom ops ``torch.ops.infcl.forward_block`` and ``torch.ops.infcl.backward_block``, their
masked twins ``masked_forward_block`` / ``masked_backward_block`` (the mask options of :mod:`infcl.masks`: the
plain ops stay as they were, so a loss without masks pays nothing for them), and the sigmoid loss's
``sigmoid_forward_block`` / ``sigmoid_backward_block``; the loader registers their
fake impls, so that ``torch.compile`` can trace them, right after the library loads. It is compiled
just-in-time on first use, or ahead of time by ``python -m infcl build``, and cached per machine and version of the
sources: :mod:`infcl.backends.native_build` finds the sources (shipped inside the package), builds, caches and
loads them, and says why the backend is unavailable when it is (turned off by ``INFCL_NATIVE=0``, no compiler,
no ninja): ``backend="auto"`` then uses the pure-PyTorch tiles (after one warning for a failure) and an
explicit ``backend="cpu"`` raises a RuntimeError with the reason.

Block contract and math: :mod:`infcl.backends.base`. Kernel layout, tiling and determinism: docs/kernels.md
("Native CPU kernel"); the ops are ``csrc/softmax_ops.cpp`` (phases in ``csrc/softmax_forward.cpp`` and
``csrc/softmax_backward.cpp``).
"""

from typing import Optional, Tuple

import torch

from .base import Block, Tensor
from .native_build import load_error


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the native kernel can run on ``device`` (CPU, extension built), else a sentence saying why."""
    if torch.device(device).type != "cpu":
        return f"backend 'cpu' runs on CPU tensors only, got a tensor on {device}"
    return load_error()


class NativeBackend:
    """The block contract (:mod:`infcl.backends.base`) on the custom ops; the scale goes in as a host float
    (reading a CPU tensor costs no device sync)."""

    name = "cpu"

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]:
        if block.masked:
            rows, cols = torch.ops.infcl.masked_forward_block(
                block.q,
                block.k,
                float(block.scale),
                block.pos,
                bool(symmetric),
                block.multi_positive,
                block.q_ids,
                block.k_ids,
                block.guide_q,
                block.guide_k,
                block.row_threshold,
                block.col_threshold,
            )
        else:
            rows, cols = torch.ops.infcl.forward_block(block.q, block.k, float(block.scale), block.pos, bool(symmetric))
        return rows, (cols if symmetric else None)

    def guide_label_scores(self, guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype) -> Tensor:
        """``[Bq]`` G[i, pos[i]] (contract: infcl.backends.base), read off the kernel's own guide tiles."""
        return torch.ops.infcl.guide_label_scores(guide_q, guide_k, pos)

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        if block.masked:
            return torch.ops.infcl.masked_backward_block(
                block.q,
                block.k,
                float(block.scale),
                block.pos,
                block.row_stats,
                block.g_row,
                block.col_stats,
                block.g_col,
                block.multi_positive,
                block.q_ids,
                block.k_ids,
                block.guide_q,
                block.guide_k,
                block.row_threshold,
                block.col_threshold,
                block.row_pos_count,
                block.row_pos_stats,
                block.col_pos_count,
                block.col_pos_stats,
                dq,
                dk,
            )
        return torch.ops.infcl.backward_block(
            block.q,
            block.k,
            float(block.scale),
            block.pos,
            block.row_stats,
            block.g_row,
            block.col_stats,
            block.g_col,
            dq,
            dk,
        )

    # --- the sigmoid (SigLIP) loss: csrc/infcl_siglip.cpp (contract: infcl.backends.base) ------------

    def sigmoid_forward_block(self, block: Block) -> Tensor:
        return torch.ops.infcl.sigmoid_forward_block(block.q, block.k, float(block.scale), block.pos, float(block.bias))

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        return torch.ops.infcl.sigmoid_backward_block(
            block.q, block.k, float(block.scale), block.pos, float(block.bias), block.g_row, dq, dk
        )


BACKEND = NativeBackend()
