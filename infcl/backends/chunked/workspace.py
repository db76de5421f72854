"""The chunked route's buffers for one block and phase, allocated once (flat) and viewed per chunk: a chunk's
float32 scores S (written there by the product itself), its dS (phases that take a gradient), the torch passes'
two float32 scratch buffers (CPU), and the products' float32 results where dq and dk do not accumulate inside
the GEMM. :mod:`.plan` counts every one of them in the budget; nothing else of size C x Bk is allocated."""

from typing import List, Optional

import torch

from ...contract import Tensor
from .plan import ChunkPlan


class Workspace:
    """``grad``: the phase forms dS and its products (the backward; the sigmoid loss's forward with its gradient)."""

    def __init__(self, plan: ChunkPlan, n_k: int, dim: int, device: torch.device, grad: bool):
        self.n_k, self.dim = n_k, dim
        size = plan.rows * n_k
        self.raw = torch.empty(size, device=device)
        self.ds = torch.empty(size, dtype=plan.ds_dtype, device=device) if grad else None
        self.scratch = [] if plan.triton_passes else [torch.empty(size, device=device) for _ in range(2)]
        products = grad and not plan.in_gemm
        self._dq = torch.empty(plan.rows * dim, device=device) if products else None
        self.dk_product = torch.empty(n_k, dim, device=device) if products else None

    def _view(self, buf: Optional[Tensor], n: int, width: int) -> Optional[Tensor]:
        return None if buf is None else buf[: n * width].view(n, width)

    def scores(self, n: int) -> Tensor:
        """S of a chunk of ``n`` rows: [n, Bk] float32."""
        return self._view(self.raw, n, self.n_k)

    def grad(self, n: int) -> Tensor:
        """dS of a chunk of ``n`` rows: [n, Bk] in the plan's dS dtype."""
        return self._view(self.ds, n, self.n_k)

    def scratch_views(self, n: int) -> List[Tensor]:
        """The torch passes' two [n, Bk] float32 buffers (none for the Triton passes)."""
        return [self._view(b, n, self.n_k) for b in self.scratch]

    def dq_product(self, n: int) -> Tensor:
        """The dq product's float32 result for ``n`` rows, [n, D] (plans whose GEMMs do not accumulate)."""
        return self._view(self._dq, n, self.dim)
