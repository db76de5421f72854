"""The guide score of each row's labelled column, G[i, pos[i]], by the masked kernels' own guide product.

A row's guide threshold is compared with the guide scores the masked kernels form in every tile
(:func:`infcl.kernels.softmax_mask_tiles.block_masks`). For a tie to compare equal (a column that duplicates the
labelled one, at margin 0), the threshold must come from the same arithmetic: the same
:func:`infcl.kernels.score_tiles.score_chunks` over D' in the same BLOCK_G chunks, at the same dot precision and
accumulation dtype (all from :func:`infcl.kernels.kernel_args.mask_kernel_args`). Each program forms the
tile gq[rows] @ gk[pos[rows]].T and keeps its diagonal (every other entry is replaced by 0 before the
sum, so the diagonal is read exactly); a dot's entry does not depend on where it sits in the tile.

Cost: Bq * BLOCK_ROWS * D' multiply-adds per block, BLOCK_ROWS / Bk of one guide GEMM.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ..contract import MaskOptions
from .configs import MIN_DOT
from .kernel_args import COMPILE_OPTIONS, mask_kernel_args, matrix_args
from .score_tiles import Dot, Matrix, Tile, load_vector, score_chunks

Tensor = torch.Tensor

# Rows per program: the diagonal of a BLOCK_ROWS x BLOCK_ROWS tile is kept, so small (the waste grows with
# it), but 64: a warpgroup MMA (sm_90) needs 64 rows, and the masked kernels' guide dots, whose tiles
# have at least 64 rows on a GPU, take that instruction family: the same per-entry arithmetic.
BLOCK_ROWS = max(64, MIN_DOT)


@triton.jit
def _guide_label_scores_kernel(
    gq_ptr,
    gk_ptr,
    pos_ptr,
    out_ptr,
    n_q,
    n_k,
    DG,
    stride_gq0,
    stride_gq1,
    stride_gk0,
    stride_gk1,
    stride_pos,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_G: tl.constexpr,
    GUIDE_ACC: tl.constexpr,
    GUIDE_PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = load_vector(pos_ptr, rows, n_q, stride_pos, -1, not EVEN_M)
    cols = tl.where(pos >= 0, pos, 0)  # a row whose labelled column is in another block reads column 0
    scores = score_chunks(
        Matrix(gq_ptr, n_q, DG, stride_gq0, stride_gq1),
        Matrix(gk_ptr, n_k, DG, stride_gk0, stride_gk1),
        rows,
        cols,
        Tile(BLOCK_M, BLOCK_M, BLOCK_G, not EVEN_M, False, not EVEN_G),
        Dot(GUIDE_ACC, False, GUIDE_PRECISION),
    )
    diagonal = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, BLOCK_M)[None, :]
    score = tl.sum(tl.where(diagonal, scores, 0.0), axis=1)
    score = tl.where(pos >= 0, score, 0.0)
    tl.store(out_ptr + rows.to(tl.int64), score, mask=rows < n_q)


def guide_label_scores(
    guide_q: Tensor,
    guide_k: Tensor,
    pos: Tensor,
    dtype: torch.dtype,
    precision: Optional[str],
    wrap=lambda kernel: kernel,
) -> Tensor:
    """``[Bq]`` G[i, pos[i]] (0 where pos[i] < 0) in the guide's accumulation dtype, as the masked kernels
    for features of ``dtype`` at ``precision`` compute it; guide_q [Bq, D'], guide_k [Bk, D'] in that dtype,
    any strides; pos [Bq] integer, any stride."""
    args = mask_kernel_args(MaskOptions(guide_q=guide_q, guide_k=guide_k), dtype, precision)
    n_q = guide_q.shape[0]
    out = torch.empty(n_q, dtype=guide_q.dtype, device=guide_q.device)
    wrap(_guide_label_scores_kernel)[(triton.cdiv(n_q, BLOCK_ROWS),)](
        pos_ptr=pos,
        out_ptr=out,
        n_q=n_q,
        n_k=guide_k.shape[0],
        DG=args["DG"],
        **matrix_args("gq", guide_q),
        **matrix_args("gk", guide_k),
        stride_pos=pos.stride(0),
        BLOCK_M=BLOCK_ROWS,
        BLOCK_G=args["BLOCK_G"],
        EVEN_M=n_q % BLOCK_ROWS == 0,
        EVEN_G=args["EVEN_G"],
        GUIDE_ACC=tl.float64 if guide_q.dtype == torch.float64 else tl.float32,
        GUIDE_PRECISION=args["GUIDE_PRECISION"],
        **COMPILE_OPTIONS,
    )
    return out
