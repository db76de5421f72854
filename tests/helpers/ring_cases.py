"""The ring test cases: their inputs (identical in every worker and in pytest) and the float64 truth.

A case describes a global batch split over ``world`` ranks. Every process rebuilds the same global
tensors from a seed, so a worker slices out its shard and pytest computes the truth on the whole batch
in one process, in float64:
    L_s                 rank s's local loss (its rows; for symmetric also its columns), reduced locally
    total               sum_s <upstream_s, L_s>
    dq_r, dk_r          d total / d (rank r's q and k)
    dscale_r            d <upstream_r, L_r> / d scale          (rank r's own loss only)
    dscale_full         d total / d scale                       (computed separately, with one shared scale)
"""

import functools
import zlib
from dataclasses import dataclass, replace
from typing import List, Tuple

import torch
import torch.nn.functional as F

# Local batch sizes: uneven on purpose (the last batch of an epoch), and q/k pairs with Bk > Bq
# (hard negatives) for the one-directional loss.
EVEN_SIZE = 4
UNEVEN_Q = {2: (3, 6), 3: (5, 9, 4), 4: (5, 2, 7, 4)}
HARD_NEG_K = {2: (5, 7), 3: (7, 10, 6), 4: (6, 4, 9, 5)}
DIM = 6
SCALE = 7.0  # a CLIP-like logit scale on unit features: logits in [-7, 7]
# Torch tiles shrunk so that even these small blocks span several tiles inside one ring step.
TINY_TILES = (2, 3)


@dataclass(frozen=True)
class RingCase:
    name: str
    world: int
    q_sizes: Tuple[int, ...]
    k_sizes: Tuple[int, ...]
    symmetric: bool
    labels: str  # "default" (diagonal) | "custom" (global column indices; a permutation when symmetric)
    reduction: str
    dtype: torch.dtype
    upstream: str  # "unit" | "scaled" (a different non-unit gradient per rank; random per row for "none")
    noncontig: bool = False  # pass q and k as transposed (non-contiguous) views

    @property
    def q_offsets(self):
        return tuple(sum(self.q_sizes[:r]) for r in range(self.world))

    @property
    def k_offsets(self):
        return tuple(sum(self.k_sizes[:r]) for r in range(self.world))


def ring_cases(world: int) -> List[RingCase]:
    even, uneven, hard = (EVEN_SIZE,) * world, UNEVEN_Q[world], HARD_NEG_K[world]
    base = RingCase("", world, even, even, True, "default", "mean", torch.float32, "unit")
    return [
        replace(base, name="sym-default-mean"),
        replace(
            base,
            name="sym-perm-uneven-sum",
            q_sizes=uneven,
            k_sizes=uneven,
            labels="custom",
            reduction="sum",
            upstream="scaled",
            noncontig=True,
        ),
        replace(
            base, name="sym-default-uneven-none", q_sizes=uneven, k_sizes=uneven, reduction="none", upstream="scaled"
        ),
        replace(
            base,
            name="sym-perm-uneven-mean-f64",
            q_sizes=uneven,
            k_sizes=uneven,
            labels="custom",
            dtype=torch.float64,
            upstream="scaled",
        ),
        replace(
            base, name="one-default-uneven-mean", q_sizes=uneven, k_sizes=uneven, symmetric=False, upstream="scaled"
        ),
        replace(
            base,
            name="one-custom-hardneg-none",
            q_sizes=uneven,
            k_sizes=hard,
            symmetric=False,
            labels="custom",
            reduction="none",
            upstream="scaled",
        ),
        replace(
            base,
            name="one-custom-hardneg-sum-f64",
            q_sizes=uneven,
            k_sizes=hard,
            symmetric=False,
            labels="custom",
            reduction="sum",
            dtype=torch.float64,
            upstream="scaled",
            noncontig=True,
        ),
    ]


@dataclass
class GlobalInputs:
    q: torch.Tensor  # [sum q_sizes, D] float64, unit rows
    k: torch.Tensor  # [sum k_sizes, D] float64, unit rows
    labels: torch.Tensor  # [sum q_sizes] global positive column of every row (the default diagonal too)
    upstream: List[torch.Tensor]  # per rank: 0-d, or [Bq_r] for reduction "none"


def _generator(name: str, world: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{name}/{world}".encode()))


def global_inputs(case: RingCase) -> GlobalInputs:
    gen = _generator(case.name, case.world)
    nq, nk = sum(case.q_sizes), sum(case.k_sizes)
    q = F.normalize(torch.randn(nq, DIM, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(nk, DIM, generator=gen, dtype=torch.float64), dim=-1)
    if case.labels == "default":
        labels = torch.cat([torch.arange(n) + off for n, off in zip(case.q_sizes, case.k_offsets)])
    elif case.symmetric:
        labels = torch.randperm(nq, generator=gen)
    else:
        labels = torch.randint(0, nk, (nq,), generator=gen)  # repeats and cross-rank positives allowed
    upstream = []
    for r, n in enumerate(case.q_sizes):
        if case.upstream == "unit":
            upstream.append(torch.ones(n) if case.reduction == "none" else torch.tensor(1.0))
        elif case.reduction == "none":
            upstream.append(torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 0.5)
        else:
            upstream.append(torch.tensor(0.5 + 0.75 * r, dtype=torch.float64))
    return GlobalInputs(q, k, labels, upstream)


def local_inputs(case: RingCase, rank: int):
    """This rank's leaves (q_leaf, k_leaf) in the case dtype, the views passed to the loss, labels, upstream."""
    g = global_inputs(case)
    qo, ko = case.q_offsets[rank], case.k_offsets[rank]
    q = g.q[qo : qo + case.q_sizes[rank]].to(case.dtype)
    k = g.k[ko : ko + case.k_sizes[rank]].to(case.dtype)
    if case.noncontig:
        # Leaves stored [D, B]; the loss sees their transposes, which are not contiguous.
        q_leaf, k_leaf = q.T.contiguous().requires_grad_(), k.T.contiguous().requires_grad_()
        q_in, k_in = q_leaf.T, k_leaf.T
    else:
        q_leaf, k_leaf = q.clone().requires_grad_(), k.clone().requires_grad_()
        q_in, k_in = q_leaf, k_leaf
    labels = None if case.labels == "default" else g.labels[qo : qo + case.q_sizes[rank]].clone()
    return q_leaf, k_leaf, q_in, k_in, labels, g.upstream[rank]


def _local_losses(case: RingCase, q: torch.Tensor, k: torch.Tensor, labels: torch.Tensor, scales) -> list:
    """Every rank's local loss L_s on the materialized global logits; rank s uses ``scales[s]``."""
    inverse = torch.argsort(labels) if case.symmetric else None
    losses = []
    for s in range(case.world):
        qo, ko, nq, nk = case.q_offsets[s], case.k_offsets[s], case.q_sizes[s], case.k_sizes[s]
        per = F.cross_entropy(scales[s] * q[qo : qo + nq] @ k.T, labels[qo : qo + nq], reduction="none")
        if case.symmetric:
            cols = F.cross_entropy(scales[s] * k[ko : ko + nk] @ q.T, inverse[ko : ko + nk], reduction="none")
            per = (per + cols) / 2
        losses.append({"mean": per.mean, "sum": per.sum, "none": lambda p=per: p}[case.reduction]())
    return losses


@dataclass
class Truth:
    loss: List[torch.Tensor]
    dq: List[torch.Tensor]
    dk: List[torch.Tensor]
    dparams: List[torch.Tensor]  # [n_params] per rank: d <upstream_r, L_r> / d (scale[, bias])
    dparams_full: torch.Tensor  # [n_params]: d total / d (scale[, bias])

    @property
    def dscale(self) -> List[torch.Tensor]:
        return [d[0] for d in self.dparams]

    @property
    def dscale_full(self) -> torch.Tensor:
        return self.dparams_full[0]


def _truth(case: RingCase, local_losses, values: Tuple[float, ...]) -> Truth:
    """The float64 truth of ``local_losses(case, q, k, labels, params_per_rank)``, the loss parameters
    starting at ``values`` (one replica per rank, and once shared by every rank for the full derivative)."""
    g = global_inputs(case)
    q, k = g.q.clone().requires_grad_(), g.k.clone().requires_grad_()

    def params():
        return [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in values]

    def total(losses):
        return sum((u * loss).sum() for u, loss in zip(g.upstream, losses))

    replicas = [params() for _ in range(case.world)]
    losses = local_losses(case, q, k, g.labels, replicas)
    dq, dk, *dparams = torch.autograd.grad(total(losses), [q, k, *(p for ps in replicas for p in ps)])
    shared = params()
    dparams_full = torch.autograd.grad(total(local_losses(case, g.q, g.k, g.labels, [shared] * case.world)), shared)
    n_params = len(values)
    return Truth(
        loss=[loss.detach() for loss in losses],
        dq=[dq[o : o + n] for o, n in zip(case.q_offsets, case.q_sizes)],
        dk=[dk[o : o + n] for o, n in zip(case.k_offsets, case.k_sizes)],
        dparams=[torch.stack(dparams[r * n_params : (r + 1) * n_params]) for r in range(case.world)],
        dparams_full=torch.stack(dparams_full),
    )


@functools.lru_cache(maxsize=None)  # one truth per case, shared by every backend's test
def truth(case: RingCase) -> Truth:
    return _truth(case, lambda c, q, k, labels, ps: _local_losses(c, q, k, labels, [p[0] for p in ps]), (SCALE,))


# --- the sigmoid (SigLIP) loss on the ring ---------------------------------------------------------------
BIAS = -4.0  # with SCALE on unit features: logits in [-11, 3], both signs of the margin well represented


def sigmoid_cases(world: int) -> List[RingCase]:
    """One-directional cases (the sigmoid loss has no symmetric form): uneven shards, Bk > Bq, labels."""
    even, uneven, hard = (EVEN_SIZE,) * world, UNEVEN_Q[world], HARD_NEG_K[world]
    base = RingCase("", world, even, even, False, "default", "mean", torch.float32, "unit")
    return [
        replace(base, name="sig-default-mean"),
        replace(
            base,
            name="sig-custom-hardneg-sum",
            q_sizes=uneven,
            k_sizes=hard,
            labels="custom",
            reduction="sum",
            upstream="scaled",
            noncontig=True,
        ),
        replace(
            base,
            name="sig-default-uneven-none-f64",
            q_sizes=uneven,
            k_sizes=uneven,
            reduction="none",
            dtype=torch.float64,
            upstream="scaled",
        ),
        replace(
            base,
            name="sig-custom-hardneg-mean-f64",
            q_sizes=uneven,
            k_sizes=hard,
            labels="custom",
            dtype=torch.float64,
            upstream="scaled",
        ),
    ]


def _sigmoid_local_losses(case: RingCase, q, k, labels, params) -> list:
    """Every rank's local sigmoid loss on the materialized global logits; rank s uses ``params[s]``."""
    losses = []
    for s, (scale, bias) in enumerate(params):
        qo, nq = case.q_offsets[s], case.q_sizes[s]
        logits = scale * q[qo : qo + nq] @ k.T + bias
        signs = torch.full_like(logits, -1.0).scatter_(1, labels[qo : qo + nq, None], 1.0)
        per = -F.logsigmoid(signs * logits).sum(dim=1)
        losses.append({"mean": per.mean, "sum": per.sum, "none": lambda p=per: p}[case.reduction]())
    return losses


@functools.lru_cache(maxsize=None)
def sigmoid_truth(case: RingCase) -> Truth:
    """As :func:`truth`, for the sigmoid loss; the parameters are (scale, bias)."""
    return _truth(case, _sigmoid_local_losses, (SCALE, BIAS))


# --- the DDP / open_clip model: a tiny two-tower model on synthetic pairs ------------------------------
TOWER_IN = (5, 7)  # image / text input widths
TOWER_OUT = 4
PAIRS_PER_RANK = 4
LOGIT_SCALE_INIT = 2.0  # log of the logit scale, as open_clip parametrizes it


class TwoTower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(1234)
        self.image = torch.nn.Linear(TOWER_IN[0], TOWER_OUT)
        self.text = torch.nn.Linear(TOWER_IN[1], TOWER_OUT)
        for p in list(self.image.parameters()) + list(self.text.parameters()):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.logit_scale = torch.nn.Parameter(torch.tensor(LOGIT_SCALE_INIT))

    def forward(self, x_img, x_txt):
        img = F.normalize(self.image(x_img), dim=-1)
        txt = F.normalize(self.text(x_txt), dim=-1)
        return img, txt, self.logit_scale.exp()


def tower_data(world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(99 + world)
    n = world * PAIRS_PER_RANK
    return torch.randn(n, TOWER_IN[0], generator=gen), torch.randn(n, TOWER_IN[1], generator=gen)


def _global_batch_grads(world: int, model: torch.nn.Module, loss_fn) -> dict:
    """Parameter gradients, in float64, of ``loss_fn(*model(global batch))``: the loss of the whole
    global batch in one process, whose gradient DDP training over ``world`` ranks should see."""
    model = model.to(torch.float64)
    loss_fn(*model(*(x.to(torch.float64) for x in tower_data(world)))).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def clip_mean_loss_grads(world: int) -> dict:
    """Gradient of the CLIP loss averaged over the whole global batch (what DDP training should see)."""

    def clip(img, txt, scale):
        logits = scale * img @ txt.T
        target = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2

    return _global_batch_grads(world, TwoTower(), clip)


class SigLipTwoTower(TwoTower):
    """TwoTower with SigLIP's learned logit bias as a fourth output."""

    def __init__(self):
        super().__init__()
        self.logit_bias = torch.nn.Parameter(torch.tensor(BIAS))

    def forward(self, x_img, x_txt):
        return (*super().forward(x_img, x_txt), self.logit_bias)


def siglip_mean_loss_grads(world: int) -> dict:
    """Gradient of the sigmoid loss of the whole global batch, mean over its rows: with equal shards,
    the mean over ranks of each rank's loss (its rows against every text, over its own row count)."""

    def siglip(img, txt, scale, bias):
        logits = scale * img @ txt.T + bias
        signs = 2 * torch.eye(logits.shape[0], dtype=logits.dtype) - 1
        return -F.logsigmoid(signs * logits).sum() / logits.shape[0]

    return _global_batch_grads(world, SigLipTwoTower(), siglip)


def rank_slice(rank: int) -> slice:
    return slice(rank * PAIRS_PER_RANK, (rank + 1) * PAIRS_PER_RANK)
