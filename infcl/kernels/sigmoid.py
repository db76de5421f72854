"""The sigmoid (SigLIP) loss's block math as fused Triton kernels (``backend="triton"``).

With raw = q @ k.T, logits L = scale * raw + bias and the margin t = -z * L (z = +1 at the row's
positive, -1 elsewhere; with ids, z = +1 wherever the row's and the column's ids match: HAS_IDS, read off
whether the launch passes the ids), the loss of an entry is softplus(t) and its derivative by L is -z * sigmoid(t).
Both come from one e = exp(-|t|) in (0, 1]: softplus(t) = max(t, 0) + log1p(e) and
sigmoid(t) = (t >= 0 ? 1 : e) / (1 + e), so no logit overflows and a tiny loss term keeps its digits.

Forward (:func:`siglip_forward`): one program per BLOCK_M rows of q walks k in BLOCK_N blocks, builds
each raw tile (:func:`infcl.kernels.score_tiles.score_tile`, 1 GEMM), and adds sum_j softplus(t) to its
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

import torch
import triton
import triton.language as tl

from .configs import Tiling
from .kernel_args import COMPILE_OPTIONS, launch_options, tf32_operands
from .score_tiles import MIN_DOT, dot_operand, load_tile, score_tile, tile_dot
from .tiling import SIGMOID_TILINGS, target_tiling

# The tilings used when the backend pins none: infcl.kernels.tiling.sigmoid_tiling. ``DEFAULT_TILINGS`` is the
# tiling module's per-class table itself (bench.static's --tile siglip=... overrides it in place).
DEFAULT_TILINGS = SIGMOID_TILINGS


def _pick(tiling, dtype, precision):
    """The caller's tiling, else the active target's (:func:`infcl.kernels.tiling.target_tiling`)."""
    return tiling if tiling is not None else target_tiling("sigmoid", dtype, precision)


@triton.jit
def _log1p_unit(u):
    """log(1 + u) for u in [0, 1], to full relative precision for tiny u: log(w) * u / (w - 1), w = 1 + u
    (the rounding of w cancels in the ratio); u itself where w rounds to 1."""
    w = 1.0 + u
    tiny = w == 1.0
    return tl.where(tiny, u, tl.log(w) * (u / tl.where(tiny, 1.0, w - 1.0)))


@triton.jit
def _softplus(t):
    return tl.maximum(t, 0.0) + _log1p_unit(tl.exp(-tl.abs(t)))


@triton.jit
def _sigmoid(t):
    e = tl.exp(-tl.abs(t))
    return tl.where(t >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def _margins(raw, is_pos, scale, bias):
    """t = -z * (scale * raw + bias): the logits with their sign flipped at the positives."""
    logits = raw * scale + bias
    return tl.where(is_pos, -logits, logits)


@triton.jit
def _add_rows(dst_ptr, rows, feats, n_rows, D, stride0, stride1, value):
    """dst[rows, feats] += value, masked to the matrix; only the program owning ``rows`` calls it."""
    mask = (rows[:, None] < n_rows) & (feats[None, :] < D)
    ptrs = dst_ptr + rows[:, None] * stride0 + feats[None, :] * stride1
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
    tl.static_assert(BLOCK_M >= MIN_DOT and BLOCK_N >= MIN_DOT and BLOCK_D >= MIN_DOT)
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
        raw = score_tile(
            q_ptr,
            k_ptr,
            rows,
            cols,
            n_q,
            n_k,
            D,
            stride_q0,
            stride_q1,
            stride_k0,
            stride_k1,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            True,
            True,
            True,
            ACC,
            UPCAST,
            PRECISION,
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
    tl.static_assert(BLOCK_M >= MIN_DOT and BLOCK_N >= MIN_DOT and BLOCK_D >= MIN_DOT)
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_own
    scale = tl.load(params_ptr)
    bias = tl.load(params_ptr + 1)
    HAS_IDS: tl.constexpr = own_ids_ptr is not None  # the positives: the ids' matches, else pos
    if HAS_IDS:
        own_ids = tl.load(own_ids_ptr + rows, mask=row_ok, other=-1)
    elif OWNS_Q:
        row_pos = tl.load(pos_ptr + rows, mask=row_ok, other=-1)
    if OWNS_Q:
        row_g = tl.load(g_ptr + rows, mask=row_ok, other=0.0)
    dscale = tl.zeros([BLOCK_M], dtype=ACC)
    dbias = tl.zeros([BLOCK_M], dtype=ACC)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC)  # the owned rows' gradient when ONE_CHUNK
    for n0 in range(0, n_other, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        col_ok = cols < n_other
        raw = score_tile(
            own_ptr,
            other_ptr,
            rows,
            cols,
            n_own,
            n_other,
            D,
            stride_own0,
            stride_own1,
            stride_other0,
            stride_other1,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            True,
            True,
            True,
            ACC,
            UPCAST,
            PRECISION,
        )
        if HAS_IDS:
            is_pos = own_ids[:, None] == tl.load(other_ids_ptr + cols, mask=col_ok, other=-1)[None, :]
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
        dl_op = dot_operand(dl, other_ptr.dtype.element_ty, PRECISION)  # the products' operand (tensor cores)
        if ONE_CHUNK:
            feats = tl.arange(0, BLOCK_D).to(tl.int64)
            other_tile = load_tile(other_ptr, cols, feats, n_other, D, stride_other0, stride_other1, True, True)
            acc = tile_dot(dl_op, other_tile, acc, UPCAST, PRECISION)
        else:
            for d0 in range(0, D, BLOCK_D):
                feats = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
                other_tile = load_tile(other_ptr, cols, feats, n_other, D, stride_other0, stride_other1, True, True)
                part = tile_dot(dl_op, other_tile, tl.zeros([BLOCK_M, BLOCK_D], dtype=ACC), UPCAST, PRECISION)
                _add_rows(grad_ptr, rows, feats, n_own, D, stride_grad0, stride_grad1, scale * part)
    if ONE_CHUNK:
        feats = tl.arange(0, BLOCK_D).to(tl.int64)
        _add_rows(grad_ptr, rows, feats, n_own, D, stride_grad0, stride_grad1, scale * acc)
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
    q, k, scale, pos, bias, tiling: Tiling = None, precision=None, wrap=lambda kernel: kernel, q_ids=None, k_ids=None
):
    """Row losses [Bq] (accumulation dtype): sum_j softplus(-z_ij * (scale * q_i.k_j + bias)).

    q [Bq, D], k [Bk, D] (any strides, one dtype), scale a 0-d tensor on q's device, pos [Bq] int64: each
    row's positive column in k, -1 for none; bias a 0-d tensor like scale (the argument order of every block
    operation: q, k, scale, pos, then the loss's own). ``tiling`` overrides the default
    (:func:`infcl.kernels.tiling.sigmoid_tiling`; the interpreter's big tiles under TRITON_INTERPRET=1);
    ``precision`` picks tl.dot's input precision for float32 ("ieee", "tf32"; None follows torch's,
    kernel_args.torch_matmul_precision); ``wrap`` wraps the kernel before its launch (``torch.library.wrap_triton``
    inside a triton_op). ``q_ids`` [Bq], ``k_ids`` [Bk] (both or neither): every column with the row's id is a
    positive, pos unread.
    """
    opts = launch_options(q.dtype, precision)
    q, k = tf32_operands(opts["PRECISION"], q, k)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_q, dim = q.shape
    tiling = _pick(tiling, q.dtype, opts["PRECISION"])
    cfg = tiling.forward
    out = torch.empty(n_q, dtype=acc, device=q.device)
    wrap(_siglip_forward_kernel)[(triton.cdiv(n_q, cfg.block_m),)](
        q_ptr=q,
        k_ptr=k,
        pos_ptr=pos.contiguous(),
        q_ids_ptr=_ids(q_ids),
        k_ids_ptr=_ids(k_ids),
        params_ptr=_params(scale, bias, acc),
        out_ptr=out,
        n_q=n_q,
        n_k=k.shape[0],
        D=dim,
        stride_q0=q.stride(0),
        stride_q1=q.stride(1),
        stride_k0=k.stride(0),
        stride_k1=k.stride(1),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_D=tiling.block_d(dim),
        **cfg.launch_options(),
        **opts,
        **COMPILE_OPTIONS,
    )
    return out


def siglip_backward(
    q,
    k,
    scale,
    pos,
    bias,
    g_row,
    dq,
    dk,
    tiling: Tiling = None,
    precision=None,
    wrap=lambda kernel: kernel,
    q_ids=None,
    k_ids=None,
) -> torch.Tensor:
    """Accumulate dq [Bq, D] and dk [Bk, D] in place (accumulation dtype, any strides); return the
    (scale, bias) gradients [2]. g_row [Bq]: the upstream gradient of each row's loss; the rest as in
    :func:`siglip_forward`."""
    opts = launch_options(q.dtype, precision)
    q, k = tf32_operands(opts["PRECISION"], q, k)
    acc = dq.dtype
    n_q, dim = q.shape
    n_k = k.shape[0]
    tiling = _pick(tiling, q.dtype, opts["PRECISION"])
    cfg = tiling.dq
    chunk = tiling.block_d(dim)
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
            own_ptr=owner,
            other_ptr=other,
            own_ids_ptr=own_ids,
            other_ids_ptr=other_ids,
            grad_ptr=grad,
            n_own=n_own,
            n_other=n_other,
            stride_own0=owner.stride(0),
            stride_own1=owner.stride(1),
            stride_other0=other.stride(0),
            stride_other1=other.stride(1),
            stride_grad0=grad.stride(0),
            stride_grad1=grad.stride(1),
            OWNS_Q=owns_q,
            **common,
        )
    return partials.sum(dim=0)
