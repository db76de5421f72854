"""The providers the benchmark compares, for each loss a ``fn(q, k, scale, symmetric) -> 0-d tensor``.

The contrastive (CLIP) loss, ``--loss clip``:
- "vanilla": materialized logits ``scale * q @ k.T`` and ``F.cross_entropy`` (open_clip's ClipLoss),
  O(B^2) memory; the baseline every ratio is taken against.
- "torch", "cpu", "triton": ``infcl.cal_inf_loss(..., backend=name)``.
- "inf-cl": Inf-CL's ``inf_cl.cal_inf_loss`` (CUDA only; the symmetric loss is its two directions
  averaged, as Inf-CL's own ClipLoss does).
- "<backend>+ids", "<backend>+guide" for each backend of :data:`MASKED_BACKENDS` (only with ``--ids`` /
  ``--guide``, never in a preset's default list): that backend with false-negative ids
  (:data:`IDS_PER_CLASS` rows per id) or a guide of width D (margin :data:`GUIDE_MARGIN`), for the cost of
  the mask options against the plain backend in the same run (:func:`plain_of`).
The sigmoid (SigLIP) loss, ``--loss siglip`` (``symmetric`` is ignored; the bias is SIGLIP_BIAS, a leaf
that receives a gradient):
- "vanilla": open_clip's own ``SigLipLoss`` (its loss.py loaded by file), or, without open_clip, the
  same math on materialized logits (``-logsigmoid(z * (scale * q @ k.T + bias)).sum() / B``).
- "torch", "cpu", "triton": ``infcl.cal_siglip_loss(..., backend=name)``; Inf-CL has no sigmoid loss.
A method that cannot run here has an ``unavailable`` reason and is listed as skipped, never dropped.
``gemm_equivalents`` counts the products (each 2 * B^2 * D flops) each method spends per mode on the
contrastive loss, for the GEMM-throughput column: how much of the device's matmul rate its own
products reach.
"""

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from infcl import cal_inf_loss, cal_siglip_loss
from infcl.backends import unavailable_reason

from . import open_clip_loss

Tensor = torch.Tensor

# CLIP's initial logit scale, 1 / 0.07.
LOGIT_SCALE = 1 / 0.07
# Inf-CL's kernels take D in heads of one of these sizes (its docstring: 16, 32, 64, 128 or 256).
INF_CL_HEAD_DIMS = (256, 128, 64, 32, 16)
LOSSES = ("clip", "siglip")
# SigLIP's initial logit bias (its paper's b = -10), used with the same scale as the CLIP loss.
SIGLIP_BIAS = -10.0
# The mask-option methods: duplicates every few rows (a batch with false negatives), and a guide margin
# that excludes some but not most columns of random unit guide features.
IDS_PER_CLASS = 4
GUIDE_MARGIN = 0.1


def make_inputs(batch: int, dim: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Leaf tensors (q [B, D], k [B, D] L2-normalized rows in ``dtype``; 0-d fp32 scale), all requiring grad."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def feats():
        x = F.normalize(torch.randn(batch, dim, generator=gen), dim=-1)
        return x.to(device=device, dtype=dtype).requires_grad_(True)

    q, k = feats(), feats()
    return q, k, torch.tensor(LOGIT_SCALE, device=device, requires_grad=True)


def _diagonal(q: Tensor) -> Tensor:
    return torch.arange(q.shape[0], device=q.device)


def vanilla_loss(q: Tensor, k: Tensor, scale: Tensor, symmetric: bool) -> Tensor:
    """The loss as users write it: [B, B] logits in the inputs' dtype, then F.cross_entropy."""
    logits = scale * q @ k.T
    labels = _diagonal(q)
    rows = F.cross_entropy(logits, labels)
    return (rows + F.cross_entropy(logits.T, labels)) / 2 if symmetric else rows


_GUIDES = {}  # (B, D, device, dtype) -> guide features, made once outside the timed calls


def _mask_options(q: Tensor, option: str) -> dict:
    """cal_inf_loss keywords of the mask option ("ids" or "guide") for inputs shaped like q."""
    batch = q.shape[0]
    if option == "ids":
        ids = torch.arange(batch, device=q.device) // IDS_PER_CLASS
        return {"q_ids": ids, "k_ids": ids}
    key = (batch, q.shape[1], q.device, q.dtype)
    if key not in _GUIDES:
        gen = torch.Generator(device="cpu").manual_seed(1)
        feats = [F.normalize(torch.randn(batch, q.shape[1], generator=gen), dim=-1).to(q.device, q.dtype) for _ in "qk"]
        _GUIDES.clear()
        _GUIDES[key] = tuple(feats)
    return {"guide": _GUIDES[key], "guide_margin": GUIDE_MARGIN}


def _masked_loss(backend: str, option: str) -> Callable[[Tensor, Tensor, Tensor, bool], Tensor]:
    def loss(q: Tensor, k: Tensor, scale: Tensor, symmetric: bool) -> Tensor:
        return cal_inf_loss(q, k, scale=scale, symmetric=symmetric, backend=backend, **_mask_options(q, option))

    return loss


def _infcl_loss(backend: str) -> Callable[[Tensor, Tensor, Tensor, bool], Tensor]:
    def loss(q: Tensor, k: Tensor, scale: Tensor, symmetric: bool) -> Tensor:
        return cal_inf_loss(q, k, scale=scale, symmetric=symmetric, backend=backend)

    return loss


def _siglip_bias(scale: Tensor) -> Tensor:
    """The sigmoid loss's bias: a fresh leaf per call (it receives a gradient, like the scale)."""
    return torch.full((), SIGLIP_BIAS, dtype=scale.dtype, device=scale.device, requires_grad=True)


def siglip_vanilla_loss(q: Tensor, k: Tensor, scale: Tensor, symmetric: bool) -> Tensor:
    """open_clip's SigLipLoss (materialized [B, B] logits and labels in the inputs' dtype), or its math."""
    bias = _siglip_bias(scale)
    module = open_clip_loss.load()
    if module is not None:
        return module.SigLipLoss()(q, k, scale, bias)
    logits = scale * q @ k.T + bias
    signs = 2 * torch.eye(q.shape[0], dtype=q.dtype, device=q.device) - 1
    return -F.logsigmoid(signs * logits).sum() / q.shape[0]


def _infcl_siglip(backend: str) -> Callable[[Tensor, Tensor, Tensor, bool], Tensor]:
    def loss(q: Tensor, k: Tensor, scale: Tensor, symmetric: bool) -> Tensor:
        return cal_siglip_loss(q, k, scale, _siglip_bias(scale), backend=backend)

    return loss


def _siglip_with_ids(backend: str) -> Callable[[Tensor, Tensor, Tensor, bool], Tensor]:
    """cal_siglip_loss with ids (every text of the image's class a positive: IDS_PER_CLASS per class)."""

    def loss(q: Tensor, k: Tensor, scale: Tensor, symmetric: bool) -> Tensor:
        ids = _mask_options(q, "ids")
        return cal_siglip_loss(q, k, scale, _siglip_bias(scale), backend=backend, **ids)

    return loss


def _inf_cl_head_dim(dim: int) -> Optional[int]:
    return next((h for h in INF_CL_HEAD_DIMS if dim % h == 0), None)


def _one_rank_group() -> None:
    """Inf-CL's autograd calls ``dist.get_rank()`` and all-reduces dk even on one GPU, so it needs an
    initialized process group: a one-rank NCCL group on a free local port, as its own example sets up."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def inf_cl_loss(q: Tensor, k: Tensor, scale: Tensor, symmetric: bool) -> Tensor:
    """Inf-CL's own call; imported lazily because it is an optional, CUDA-only package."""
    from inf_cl import cal_inf_loss as inf_cl_cal_inf_loss

    _one_rank_group()

    labels, head_dim = _diagonal(q), _inf_cl_head_dim(q.shape[1])
    rows = inf_cl_cal_inf_loss(q, k, labels, scale, head_dim)
    return (rows + inf_cl_cal_inf_loss(k, q, labels, scale, head_dim)) / 2 if symmetric else rows


def inf_cl_unavailable(device: torch.device, dim: int) -> Optional[str]:
    if device.type != "cuda":
        return "Inf-CL's inf_cl package runs on CUDA only"
    if importlib.util.find_spec("inf_cl") is None:
        return "Inf-CL's inf_cl package is not installed"
    if _inf_cl_head_dim(dim) is None:
        return f"Inf-CL needs D divisible by one of {INF_CL_HEAD_DIMS}, got D={dim}"
    return None


@dataclass(frozen=True)
class Method:
    name: str
    loss: Callable[[Tensor, Tensor, Tensor, bool], Tensor]
    unavailable: Callable[[torch.device, int], Optional[str]]  # (device, D) -> None or why not
    tiled: bool  # memory linear in B: runs the large memory-only configurations
    siglip: Optional[Callable[[Tensor, Tensor, Tensor, bool], Tensor]] = None  # the sigmoid loss, if it has one

    def loss_fn(self, loss: str) -> Callable[[Tensor, Tensor, Tensor, bool], Tensor]:
        return self.siglip if loss == "siglip" else self.loss

    def unavailable_for(self, loss: str, device: torch.device, dim: int) -> Optional[str]:
        if loss == "siglip" and self.siglip is None:
            return f"{self.name} has no sigmoid (SigLIP) loss"
        return self.unavailable(device, dim)


def _infcl_method(backend: str) -> Method:
    return Method(
        backend,
        _infcl_loss(backend),
        lambda device, dim: unavailable_reason(backend, device),
        tiled=True,
        siglip=_infcl_siglip(backend),
    )


def _tiled_gemms(device, dtype, dim):  # the torch tiles and the native kernel: S; S again, dq, dk
    return 1, 3


def _triton_gemms(device, dtype, dim, masked=False, guide=False):
    from infcl.kernels.kernel_args import torch_matmul_precision
    from infcl.kernels.softmax_ops import gemm_equivalents

    precision = torch_matmul_precision()
    return gemm_equivalents(dim, dtype, device, precision, masked, guide)


MASKED_BACKENDS = ("torch", "cpu", "triton")  # the backends with "+ids" / "+guide" methods (all take masks)

# (forward, backward) GEMM-equivalents of one direction; the symmetric loss costs the same except for
# Inf-CL, which runs each direction separately. A guide of width D adds one product wherever S is formed.
_GEMMS = {
    **{f"{backend}+ids": _tiled_gemms for backend in ("torch", "cpu")},
    **{f"{backend}+guide": lambda device, dtype, dim: (2, 4) for backend in ("torch", "cpu")},
    "triton+ids": lambda device, dtype, dim: _triton_gemms(device, dtype, dim, masked=True),
    "triton+guide": lambda device, dtype, dim: _triton_gemms(device, dtype, dim, masked=True, guide=True),
    "vanilla": lambda device, dtype, dim: (1, 2),  # logits; dq and dk from the logits' gradient
    "torch": _tiled_gemms,
    "cpu": _tiled_gemms,
    "triton": _triton_gemms,
    "inf-cl": lambda device, dtype, dim: (1, 4),  # S; S for dq, dq, S for dk, dk
}


def gemm_equivalents(
    name: str, loss: str, mode: str, device: torch.device, dtype: torch.dtype, dim: int, symmetric: bool
) -> Optional[int]:
    """The products ``name`` spends on the contrastive loss in ``mode`` (None for the sigmoid loss)."""
    if loss != "clip":
        return None
    forward, backward = _GEMMS[name](device, dtype, dim)
    total = {"forward": forward, "backward": backward, "forward+backward": forward + backward}[mode]
    return total * (2 if symmetric and name == "inf-cl" else 1)


METHODS = {
    m.name: m
    for m in (
        Method("vanilla", vanilla_loss, lambda device, dim: None, tiled=False, siglip=siglip_vanilla_loss),
        _infcl_method("torch"),
        _infcl_method("cpu"),
        _infcl_method("triton"),
        Method("inf-cl", inf_cl_loss, inf_cl_unavailable, tiled=True),
        *(
            Method(
                f"{backend}+{option}",
                _masked_loss(backend, option),
                lambda device, dim, backend=backend: unavailable_reason(backend, device),
                tiled=True,
                siglip=_siglip_with_ids(backend) if option == "ids" else None,
            )
            for backend in MASKED_BACKENDS
            for option in ("ids", "guide")
        ),
    )
}
BASELINE = "vanilla"
PLAIN = "torch"  # the plain backend the mask options run on when the method list names none of them
MASK_METHODS = tuple(f"{b}+{option}" for b in MASKED_BACKENDS for option in ("ids", "guide"))  # --ids / --guide


def plain_of(name: str) -> str:
    """The plain method a mask-option method's cost is taken against ("cpu+ids" -> "cpu")."""
    return name.split("+")[0]
