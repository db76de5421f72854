"""The tiled pure-PyTorch backend: runs anywhere torch runs (CPU, CUDA, MPS), no compiler needed.

Walks S = scale * q @ k.T in TILE_Q x TILE_K tiles. The forward keeps running row (and column)
log-sum-exps merged with :func:`infcl.lse.lse_merge`; the backward recomputes each tile and
accumulates dq, dk and the scale gradient. Extra memory: the float32 (float64) copies of q and k
plus a few tiles, O((Bq + Bk) * D + TILE_Q * TILE_K), never O(Bq * Bk).

GEMM count per block (each a 2*Bq*Bk*D-flop product): forward 1 (S), backward 3 (S again, dq, dk),
whether the loss is one-directional or symmetric.
"""

from typing import Optional, Tuple

import torch

from ..lse import empty_lse, lse_merge
from .base import Tensor, accum_dtype

# Tile sizes, measured with `python -m bench.tile_sizes` (B=4096, D=512, fp32, symmetric fwd+bwd, 2 threads,
# 2026-11-22): 256 x 1024 (1 MiB fp32 tiles) ran at 1.59x the 4-GEMM bound, within the VM's noise of the
# best point (512 x 2048, 1.49x, with 4x the tile memory); tiles of 64 rows or 256 columns were 1.9-3.4x.
TILE_Q = 256
TILE_K = 1024


def _tile(buf: Tensor, rows: int, cols: int) -> Tensor:
    """A contiguous [rows, cols] view at the start of a preallocated flat buffer."""
    return buf[: rows * cols].view(rows, cols)


class TorchTilesBackend:
    name = "torch"

    def __init__(self, tile_q: int = TILE_Q, tile_k: int = TILE_K):
        self.tile_q = tile_q
        self.tile_k = tile_k

    def forward_block(self, q: Tensor, k: Tensor, scale: float, want_cols: bool) -> Tuple[Tensor, Optional[Tensor]]:
        acc = accum_dtype(q.dtype)
        qa, ka = q.to(acc), k.to(acc)
        bq, bk = qa.shape[0], ka.shape[0]
        row_lse = empty_lse(bq, acc, q.device)
        col_lse = empty_lse(bk, acc, q.device) if want_cols else None
        buf = torch.empty(min(bq, self.tile_q) * min(bk, self.tile_k), dtype=acc, device=q.device)
        for i0 in range(0, bq, self.tile_q):
            qi = qa[i0 : i0 + self.tile_q]
            for j0 in range(0, bk, self.tile_k):
                kj = ka[j0 : j0 + self.tile_k]
                s = _tile(buf, qi.shape[0], kj.shape[0])
                torch.mm(qi, kj.T, out=s)
                s.mul_(scale)
                lse_merge(row_lse[i0 : i0 + qi.shape[0]], torch.logsumexp(s, dim=1))
                if want_cols:
                    lse_merge(col_lse[j0 : j0 + kj.shape[0]], torch.logsumexp(s, dim=0))
        return row_lse, col_lse

    def backward_block(
        self,
        q: Tensor,
        k: Tensor,
        scale: float,
        row_lse: Tensor,
        g_row: Tensor,
        col_lse: Optional[Tensor],
        g_col: Optional[Tensor],
        dq: Tensor,
        dk: Tensor,
    ) -> Tuple[Tensor, Tensor]:
        acc = accum_dtype(q.dtype)
        qa, ka = q.to(acc), k.to(acc)
        bq, bk = qa.shape[0], ka.shape[0]
        both = col_lse is not None
        dscale_row = torch.zeros((), dtype=acc, device=q.device)
        dscale_col = torch.zeros((), dtype=acc, device=q.device)
        numel = min(bq, self.tile_q) * min(bk, self.tile_k)
        raw_buf, s_buf, ds_buf = (torch.empty(numel, dtype=acc, device=q.device) for _ in range(3))
        col_buf = torch.empty(numel, dtype=acc, device=q.device) if both else None
        for i0 in range(0, bq, self.tile_q):
            qi = qa[i0 : i0 + self.tile_q]
            ni = qi.shape[0]
            lse_i = row_lse[i0 : i0 + ni, None]
            g_i = g_row[i0 : i0 + ni, None]
            for j0 in range(0, bk, self.tile_k):
                kj = ka[j0 : j0 + self.tile_k]
                nj = kj.shape[0]
                raw = _tile(raw_buf, ni, nj)
                torch.mm(qi, kj.T, out=raw)
                s = torch.mul(raw, scale, out=_tile(s_buf, ni, nj))
                ds = torch.sub(s, lse_i, out=_tile(ds_buf, ni, nj)).exp_().mul_(g_i)
                dscale_row += torch.dot(ds.view(-1), raw.view(-1))
                if both:
                    pc = torch.sub(s, col_lse[None, j0 : j0 + nj], out=_tile(col_buf, ni, nj))
                    pc.exp_().mul_(g_col[None, j0 : j0 + nj])
                    dscale_col += torch.dot(pc.view(-1), raw.view(-1))
                    ds.add_(pc)
                dq[i0 : i0 + ni].addmm_(ds, kj, alpha=scale)
                dk[j0 : j0 + nj].addmm_(ds.T, qi, alpha=scale)
        return dscale_row, dscale_col


TORCH_TILES = TorchTilesBackend()
