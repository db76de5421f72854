"""The sigmoid (SigLIP) loss's block math as fused Triton kernels (``backend="triton"``).

With raw = q @ k.T, logits L = scale * raw + bias and the margin t = -z * L (z = +1 at the row's
positive, -1 elsewhere; with ids, z = +1 wherever the row's and the column's ids match: HAS_IDS, read off
whether the launch passes the ids), the loss of an entry is softplus(t) and its derivative by L is -z * sigmoid(t).
Both come from one e = exp(-|t|) in (0, 1]: softplus(t) = max(t, 0) + log1p(e) and
sigmoid(t) = (t >= 0 ? 1 : e) / (1 + e), so no logit overflows and a tiny loss term keeps its digits.

Forward (:func:`siglip_forward`): one program per BLOCK_M rows of q walks k in BLOCK_N blocks, builds
each raw tile (:func:`infcl.kernels.score_tiles.score_chunks`, 1 GEMM), and adds sum_j softplus(t) to its
rows' sums in registers; only the [Bq] row losses are written.

Backward (:func:`siglip_backward`): deterministic, without atomics, as the fused-attention backward:
two launches of one kernel, each program owning BLOCK_M rows of one side.
- q-owning pass: a program walks every k block, recomputes the tile, forms dL = g * -z * sigmoid(t) in
  registers and accumulates its rows of dq = scale * dL @ k. It also writes its partial sums of
  dL * raw and dL (the scale and bias gradients) to its own slot of a [programs, 2] buffer, which torch
  sums in a fixed order.
- k-owning pass: a program walks every q block, recomputes the transposed tile k @ q.T and accumulates
  its rows of dk = scale * dL.T @ q.
When D fits one feature chunk (BLOCK_D >= D) a program's dq (dk) rows stay in registers for the whole
walk and are added to memory once; for larger D they are read, added and written back per block and
chunk -- still only by the program that owns those rows.

GEMM-equivalents per block (each 2 * Bq * Bk * D flops): forward 1, backward 4 (each pass recomputes the
tile), 5 in all, against 4 for the torch and native backends: the price of a backward without atomics.
On a GPU dL is rounded to the inputs' dtype before the products (tensor-core operands, as torch does in
that dtype); under the interpreter see :mod:`infcl.kernels.score_tiles` (UPCAST).
"""

from typing import List, Optional

import torch
import triton
import triton.language as tl

from ..op_fakes import dscale_fake, row_fake
from .configs import Tiling
from .kernel_args import COMPILE_OPTIONS, launch_args, launch_options, matrix_args, tf32_operands
from .registration import register_op, wrap
from .score_tiles import PTX, Dot, Matrix, Tile, dot_operand, load_tile, score_chunks, tile_dot
from .tiling import SIGMOID_TILINGS, target_tiling

Tensor = torch.Tensor

# The tilings used when the backend pins none: infcl.kernels.tiling.sigmoid_tiling. ``DEFAULT_TILINGS`` is the
# tiling module's per-class table itself (bench.static's --tile siglip=... overrides it in place).
DEFAULT_TILINGS = SIGMOID_TILINGS


def _pinned(tiling: List[int]) -> Optional[Tiling]:
    """The op's ``tiling`` argument (:meth:`Tiling.to_ints`, [] for none) as the caller's pinned tiling, or None."""
    return Tiling.from_ints(tiling) if tiling else None


@triton.jit
def _div_unit(a, b):
    """a / b for float32 b in [2**-126, 2**126] (here 1 + e in [1, 2] and its rounding's w - 1 in [2**-24, 1]).
    On a GPU ``div.approx.f32``, a * rcp(b): what ``/`` (``div.full.f32``) computes in that range, without its
    range tests and scalings for huge and subnormal b (6 instructions per division). The interpreter: ``/``."""
    if PTX:
        y = tl.inline_asm_elementwise(
            "div.approx.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        y = a / b
    return y


@triton.jit
def _log1p_unit(u):
    """log(1 + u) for u in [0, 1], to full relative precision for tiny u: log(w) * u / (w - 1), w = 1 + u
    (the rounding of w cancels in the ratio); u itself where w rounds to 1."""
    w = 1.0 + u
    tiny = w == 1.0
    return tl.where(tiny, u, tl.log(w) * _div_unit(u, tl.where(tiny, 1.0, w - 1.0)))


@triton.jit
def _softplus(t):
    return tl.maximum(t, 0.0) + _log1p_unit(tl.exp(-tl.abs(t)))


@triton.jit
def _sigmoid(t):
    e = tl.exp(-tl.abs(t))
    return _div_unit(tl.where(t >= 0, 1.0, e), 1.0 + e)


@triton.jit
def _margins(raw, is_pos, scale, bias):
    """t = -z * (scale * raw + bias): the logits with their sign flipped at the positives."""
    logits = raw * scale + bias
    return tl.where(is_pos, -logits, logits)


@triton.jit
def _add_rows(dst, rows, feats, value):
    """dst[rows, feats] += value (``dst`` a :class:`Matrix`), masked to the matrix; only the program owning
    ``rows`` calls it."""
    mask = (rows[:, None] < dst.n) & (feats[None, :] < dst.d)
    ptrs = dst.ptr + rows[:, None] * dst.stride_r + feats[None, :] * dst.stride_c
    tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + value, mask=mask)


@triton.jit
def _siglip_forward_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    q_ids_ptr,
    k_ids_ptr,
    params_ptr,
    out_ptr,
    n_q,
    n_k,
    D,
    stride_q0,
    stride_q1,
    stride_k0,
    stride_k1,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    HAS_IDS: tl.constexpr = q_ids_ptr is not None  # the positives: the ids' matches, else pos
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_q
    if HAS_IDS:
        row_ids = tl.load(q_ids_ptr + rows, mask=row_ok, other=-1)
    else:
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
    # Tensors, not launch arguments: a Python float would be rounded to float32.
    scale = tl.load(params_ptr)
    bias = tl.load(params_ptr + 1)
    total = tl.zeros([BLOCK_M], dtype=ACC)
    for n0 in range(0, n_k, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        raw = score_chunks(
            Matrix(q_ptr, n_q, D, stride_q0, stride_q1),
            Matrix(k_ptr, n_k, D, stride_k0, stride_k1),
            rows,
            cols,
            Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True),
            Dot(ACC, UPCAST, PRECISION),
        )
        if HAS_IDS:
            is_pos = row_ids[:, None] == tl.load(k_ids_ptr + cols, mask=cols < n_k, other=-1)[None, :]
        else:
            is_pos = cols[None, :] == pos[:, None]
        t = _margins(raw, is_pos, scale, bias)
        total += tl.sum(tl.where(cols[None, :] < n_k, _softplus(t), 0.0), axis=1)
    tl.store(out_ptr + rows, total, mask=row_ok)


@triton.jit
def _siglip_backward_kernel(
    own_ptr,
    other_ptr,
    pos_ptr,
    own_ids_ptr,
    other_ids_ptr,
    g_ptr,
    params_ptr,
    grad_ptr,
    partials_ptr,
    n_own,
    n_other,
    D,
    stride_own0,
    stride_own1,
    stride_other0,
    stride_other1,
    stride_grad0,
    stride_grad1,
    OWNS_Q: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """grad[own rows] += scale * dL @ other, where own/other are q/k (OWNS_Q) or k/q. ``pos`` and ``g``
    are per q row: the owned rows' (OWNS_Q) or the walked ones'; the ids (HAS_IDS) go with own and other.
    ONE_CHUNK: D <= BLOCK_D."""
    _siglip_backward_rows(
        Matrix(own_ptr, n_own, D, stride_own0, stride_own1),
        Matrix(other_ptr, n_other, D, stride_other0, stride_other1),
        Matrix(grad_ptr, n_own, D, stride_grad0, stride_grad1),
        (pos_ptr, own_ids_ptr, other_ids_ptr),
        g_ptr,
        params_ptr,
        partials_ptr,
        Tile(BLOCK_M, BLOCK_N, BLOCK_D, True, True, True, ONE_CHUNK),
        Dot(ACC, UPCAST, PRECISION),
        OWNS_Q,
    )


@triton.jit
def _siglip_backward_rows(own, other, grad, labels, g_ptr, params_ptr, partials_ptr, tile, dot, OWNS_Q: tl.constexpr):
    """The backward program's rows of ``own`` (:class:`Matrix`, as ``other`` and ``grad``): their gradient
    slices and, OWNS_Q, their dscale / dbias partials; ``labels``: (pos_ptr, own_ids_ptr, other_ids_ptr)."""
    BLOCK_M: tl.constexpr = tile.BLOCK_M
    BLOCK_N: tl.constexpr = tile.BLOCK_N
    BLOCK_D: tl.constexpr = tile.BLOCK_D
    ACC: tl.constexpr = dot.ACC
    pos_ptr = labels[0]
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < own.n
    scale = tl.load(params_ptr)
    bias = tl.load(params_ptr + 1)
    HAS_IDS: tl.constexpr = labels[1] is not None  # the positives: the ids' matches, else pos
    if HAS_IDS:
        own_ids = tl.load(labels[1] + rows, mask=row_ok, other=-1)
    elif OWNS_Q:
        row_pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
    if OWNS_Q:
        row_g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    dscale = tl.zeros([BLOCK_M], dtype=ACC)
    dbias = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)  # the owned rows' gradient when ONE_CHUNK
    for n0 in range(0, other.n, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < other.n
        raw = score_chunks(own, other, rows, cols, tile, dot)
        if HAS_IDS:
            is_pos = own_ids[:, None] == tl.load(labels[2] + cols, mask=col_ok, other=-1)[None, :]
        elif OWNS_Q:
            is_pos = cols[None, :] == row_pos[:, None]
        else:
            is_pos = rows[:, None] == tl.load(pos_ptr + cols, mask=col_ok, other=-1)[None, :]
        if OWNS_Q:
            g = row_g[:, None]
        else:
            g = tl.load(g_ptr + cols, mask=col_ok, other=0.0)[None, :]
        s = _sigmoid(_margins(raw, is_pos, scale, bias))
        # Zero outside the block explicitly: a padded entry must not add to any sum, whatever it holds.
        dl = tl.where(row_ok[:, None] & col_ok[None, :], g * tl.where(is_pos, -s, s), 0.0)
        if OWNS_Q:
            dscale += tl.sum(dl * raw, axis=1)
            dbias += tl.sum(dl, axis=1)
        dl_op = dot_operand(dl, other.ptr.dtype.element_ty, dot.PRECISION)  # the products' operand (tensor cores)
        if tile.ONE_CHUNK:
            feats = tl.arange(0, BLOCK_D).to(tl.int64)
            other_tile = load_tile(other, cols, feats, True, True)
            acc = tile_dot(dl_op, other_tile, acc, dot.UPCAST, dot.PRECISION)
        else:
            for d0 in range(0, own.d, BLOCK_D):
                feats = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
                other_tile = load_tile(other, cols, feats, True, True)
                zero = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)
                _add_rows(grad, rows, feats, scale * tile_dot(dl_op, other_tile, zero, dot.UPCAST, dot.PRECISION))
    if tile.ONE_CHUNK:
        _add_rows(grad, rows, tl.arange(0, BLOCK_D).to(tl.int64), scale * acc)
    if OWNS_Q:
        tl.store(partials_ptr + 2 * pid, tl.sum(dscale, axis=0))
        tl.store(partials_ptr + 2 * pid + 1, tl.sum(dbias, axis=0))


def _params(scale: torch.Tensor, bias: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """(scale, bias) as one 2-element tensor on the features' device, read by the kernels."""
    return torch.stack((scale, bias)).to(acc)


def _ids(ids):
    """Ids as the kernels read them (stride 1: a view is copied, O(B)), or None."""
    return None if ids is None else ids.contiguous()


def siglip_forward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    bias: Tensor,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    precision: str,
    tiling: List[int],
) -> Tensor:
    """Row losses [Bq] (accumulation dtype): sum_j softplus(-z_ij * (scale * q_i.k_j + bias)).

    q [Bq, D], k [Bk, D] (any strides, one dtype), scale a 0-d tensor on q's device, pos [Bq] int64: each
    row's positive column in k, -1 for none; bias a 0-d tensor like scale (the argument order of every block
    operation: q, k, scale, pos, then the loss's own). ``q_ids`` [Bq], ``k_ids`` [Bk] (both or neither, else
    None): every column with the row's id is a positive, pos unread. ``precision`` picks tl.dot's input
    precision for float32 ("ieee", "tf32"; "" follows torch's, kernel_args.torch_matmul_precision); ``tiling``
    (:meth:`Tiling.to_ints`) overrides the default (:func:`infcl.kernels.tiling.sigmoid_tiling`; the
    interpreter's big tiles under TRITON_INTERPRET=1), [] for none.
    """
    args, chosen = launch_args(q, k, precision or None, "sigmoid", _pinned(tiling))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_q = q.shape[0]
    out = torch.empty(n_q, dtype=acc, device=q.device)
    wrap(_siglip_forward_kernel)[(triton.cdiv(n_q, chosen.forward.block_m),)](
        pos_ptr=pos.contiguous(),
        q_ids_ptr=_ids(q_ids),
        k_ids_ptr=_ids(k_ids),
        params_ptr=_params(scale, bias, acc),
        out_ptr=out,
        **args,
    )
    return out


def siglip_backward(
    q: Tensor,
    k: Tensor,
    scale: Tensor,
    pos: Tensor,
    bias: Tensor,
    q_ids: Optional[Tensor],
    k_ids: Optional[Tensor],
    g_row: Tensor,
    dq: Tensor,
    dk: Tensor,
    precision: str,
    tiling: List[int],
) -> Tensor:
    """Accumulate dq [Bq, D] and dk [Bk, D] in place (accumulation dtype, any strides); return the
    (scale, bias) gradients [2]. g_row [Bq]: the upstream gradient of each row's loss; the rest as in
    :func:`siglip_forward`."""
    opts = launch_options(q.dtype, precision or None)
    q, k = tf32_operands(opts["PRECISION"], q, k)
    acc = dq.dtype
    n_q, dim = q.shape
    n_k = k.shape[0]
    chosen = _pinned(tiling) or target_tiling("sigmoid", q.dtype, opts["PRECISION"])
    cfg = chosen.dq
    chunk = chosen.block_d(dim)
    params, pos, g_row = _params(scale, bias, acc), pos.contiguous(), g_row.to(acc).contiguous()
    programs = triton.cdiv(n_q, cfg.block_m)
    partials = torch.zeros(programs, 2, dtype=acc, device=q.device)
    common = dict(
        pos_ptr=pos,
        g_ptr=g_row,
        params_ptr=params,
        partials_ptr=partials,
        D=dim,
        ONE_CHUNK=dim <= chunk,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=chunk,
        **cfg.launch_options(),
        **opts,
        **COMPILE_OPTIONS,
    )
    q_ids, k_ids = _ids(q_ids), _ids(k_ids)
    sides = ((q, k, dq, q_ids, k_ids, n_q, n_k, True), (k, q, dk, k_ids, q_ids, n_k, n_q, False))
    for owner, other, grad, own_ids, other_ids, n_own, n_other, owns_q in sides:
        wrap(_siglip_backward_kernel)[(triton.cdiv(n_own, cfg.block_m),)](
            own_ids_ptr=own_ids,
            other_ids_ptr=other_ids,
            n_own=n_own,
            n_other=n_other,
            **matrix_args("own", owner),
            **matrix_args("other", other),
            **matrix_args("grad", grad),
            OWNS_Q=owns_q,
            **common,
        )
    return partials.sum(dim=0)


# The launchers as the custom ops ``torch.ops.infcl.triton_sigmoid_*`` (:func:`.registration.register_op`):
# triton_sigmoid_forward_block(q, k, scale, pos, bias, q_ids, k_ids, precision, tiling) -> rows;
# triton_sigmoid_backward_block(q, k, scale, pos, bias, q_ids, k_ids, g_row, dq!, dk!, precision, tiling) -> dparams
# (accumulates into dq and dk). ``precision`` and ``tiling`` as the softmax ops take them (:mod:`.softmax_ops`).
sigmoid_forward_block = register_op("triton_sigmoid_forward_block", siglip_forward, row_fake)
sigmoid_backward_block = register_op("triton_sigmoid_backward_block", siglip_backward, dscale_fake, ("dq", "dk"))
