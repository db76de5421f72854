"""One rank of the ring tests, started by tests/test_ring.py through tests/helpers/distributed.py.

``python -m workers.ring_worker main BACKEND...`` (4 processes) runs, on rings of 2, 3 and 4 ranks, every ring
case with every backend, the instrumented overlap runs, the D/dtype mismatch calls, the open_clip
comparison and the DDP step, and writes all results in one file per rank: one spawn serves every
assertion of tests/test_ring.py except the failure tests.
``python -m workers.ring_worker fail SCENARIO`` makes rank 1 die or hang and records what the other ranks see.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from helpers import ring_cases
from helpers.distributed import finish, init_worker, run_on_rings
from infcl import cal_inf_loss
from infcl.backends.torch_tiles import TorchTilesBackend
from infcl.ring import driver
from infcl.ring.comm import RingComm

TINY_SUFFIX = "-tiny-tiles"
# One spawn of MAIN_WORLD processes serves every ring size: the rings of 2 and 3 ranks are subgroups
# whose group ranks differ from the global ranks (which exercises the ``group`` argument), the ring
# of 4 is the default world group. Members are sorted: group rank = index in the tuple.
MAIN_WORLD = 4
OVERLAP_CASES = ("sym-perm-uneven-sum", "one-custom-hardneg-none")  # both streams; one stream forward
RINGS = {2: (1, 3), 3: (1, 2, 3), 4: (0, 1, 2, 3)}
FAILING_RANK = 1
HANG_S = 600  # far past any process-group timeout; the parent kills the hung rank


def _run_case(case, backend, rank, group):
    q_leaf, k_leaf, q, k, labels, upstream = ring_cases.local_inputs(case, rank)
    scale = torch.tensor(ring_cases.SCALE, dtype=case.dtype, requires_grad=True)
    loss = cal_inf_loss(
        q, k, labels, scale, symmetric=case.symmetric, reduction=case.reduction, group=group, backend=backend
    )
    loss.backward(upstream.to(loss.dtype))
    dq, dk = (q_leaf.grad.T, k_leaf.grad.T) if case.noncontig else (q_leaf.grad, k_leaf.grad)
    return {"loss": loss.detach(), "dq": dq, "dk": dk, "dscale": scale.grad, "loss_dtype": loss.dtype}


def run_cases(rank, world, group, backends, cases=ring_cases.ring_cases, run=_run_case):
    """``run(case, backend, rank, group)`` for every case of ``cases(world)`` and every backend (a name; "torch"
    with TINY_SUFFIX: the torch tiles shrunk to ring_cases.TINY_TILES, passed from the call as a backend object);
    results keyed (case, backend)."""
    out = {}
    for backend in backends:
        route = backend
        if backend.endswith(TINY_SUFFIX):
            assert backend == "torch" + TINY_SUFFIX, backend
            route = TorchTilesBackend(*ring_cases.TINY_TILES)
        for case in cases(world):
            out[(case.name, backend)] = run(case, route, rank, group)
    return out


class _LoggingComm(RingComm):
    """RingComm that records when each batch is committed and waited for."""

    events: list = []

    def commit(self, what):
        self.events.append(("commit", self.name, what))
        super().commit(what)

    def wait(self):
        self.events.append(("wait", self.name, self._what))
        super().wait()


class _HookedTiles(TorchTilesBackend):
    """The torch tiles calling ``before(method)`` ahead of each of ``methods`` (block operations), passed to the
    call as its backend object."""

    def __init__(self, before, methods=("forward_block", "backward_block")):
        super().__init__()
        self.before, self.methods = before, methods

    def forward_block(self, *args):
        if "forward_block" in self.methods:
            self.before("forward_block")
        return super().forward_block(*args)

    def backward_block(self, *args):
        if "backward_block" in self.methods:
            self.before("backward_block")
        return super().backward_block(*args)


def run_overlap(rank, world, group):
    """Event logs of the forward and backward ring with an instrumented communicator and backend."""
    out = {}
    real_comm = driver.RingComm
    driver.RingComm = _LoggingComm
    try:
        for case in ring_cases.ring_cases(world):
            if case.name not in OVERLAP_CASES:
                continue
            q_leaf, k_leaf, q, k, labels, upstream = ring_cases.local_inputs(case, rank)
            _LoggingComm.events = []
            loss = cal_inf_loss(
                q,
                k,
                labels,
                ring_cases.SCALE,
                symmetric=case.symmetric,
                reduction=case.reduction,
                group=group,
                backend=_HookedTiles(lambda method: _LoggingComm.events.append(("compute", method))),
            )
            forward = list(_LoggingComm.events)
            _LoggingComm.events = []
            loss.backward(upstream.to(loss.dtype))
            out[case.name] = {"forward": forward, "backward": list(_LoggingComm.events)}
    finally:
        driver.RingComm = real_comm
    return out


def run_mismatch(rank, world, group):
    """Arguments that disagree across ranks, or that are wrong on one rank only: every rank must raise."""
    out = {}
    for what in ("dim", "dtype", "labels", "sizes", "empty", "label-dtype"):
        last = rank == world - 1
        dim = ring_cases.DIM + (1 if what == "dim" and last else 0)
        dtype = torch.float64 if what == "dtype" and rank == 0 else torch.float32
        # "sizes": the last rank's q and k disagree under symmetric=True; "labels": only the last rank's
        # labels point past the global batch (3 * world columns). Both are caught on that rank's data alone.
        # "empty" / "label-dtype": the last rank's own argument checks fail (an empty shard, float labels).
        bq = 0 if what == "empty" and last else 3
        bk = {"sizes": 4, "empty": 0}.get(what, 3) if last else 3
        q, k = torch.randn(bq, dim, dtype=dtype), torch.randn(bk, dim, dtype=dtype)
        labels = None
        if what == "labels":
            labels = torch.tensor([0, 1, 3 * world]) if last else torch.tensor([0, 1, 2])
        if what == "label-dtype":
            labels = torch.tensor([0.0, 1.0, 2.0]) if last else torch.tensor([0, 1, 2]) + 3 * rank
        try:
            cal_inf_loss(q, k, labels, symmetric=what != "labels", group=group, backend="torch")
            out[what] = None
        except Exception as err:  # the test checks the exact type
            out[what] = (type(err).__name__, str(err))
    return out


class _GatherWithGrad(torch.autograd.Function):
    """torch.distributed.nn.all_gather, equal sizes: backward sums every rank's gradient of our slice.

    (torch.distributed.nn itself emulates reduce-scatter with scatter(src=group rank) under gloo, which
    breaks on subgroups whose group ranks differ from the global ranks: torch 2.13.)
    """

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.n = group, x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.n
        return grad[start : start + ctx.n], None


def _clip_loss_open_clip(img, txt, scale, rank, group):
    """open_clip ClipLoss(local_loss=True, gather_with_grad=True), written out (open_clip is not a dependency)."""
    all_img = _GatherWithGrad.apply(img, group)
    all_txt = _GatherWithGrad.apply(txt, group)
    labels = torch.arange(img.shape[0]) + img.shape[0] * rank
    return (F.cross_entropy(scale * img @ all_txt.T, labels) + F.cross_entropy(scale * txt @ all_img.T, labels)) / 2


def run_open_clip(rank, world, group):
    """Same model and data through open_clip's formula and through the ring: loss and every grad."""
    x_img, x_txt = (x[ring_cases.rank_slice(rank)] for x in ring_cases.tower_data(world))
    out = {}
    for name, loss_fn in (
        ("open_clip", lambda i, t, s: _clip_loss_open_clip(i, t, s, rank, group)),
        ("infcl", lambda i, t, s: cal_inf_loss(i, t, scale=s, symmetric=True, group=group, backend="torch")),
    ):
        model = ring_cases.TwoTower()
        loss = loss_fn(*model(x_img, x_txt))
        loss.backward()
        out[name] = {"loss": loss.detach(), **{p: v.grad.clone() for p, v in model.named_parameters()}}
    return out


class _AllReduceGrad(torch.autograd.Function):
    """Identity whose backward all-reduces (sums) the gradient: Inf-CL's in-backward dscale all_reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def run_ddp(rank, world, group):
    """One DDP backward of the ring CLIP loss, as we ship it and with Inf-CL's dscale all_reduce added."""
    x_img, x_txt = (x[ring_cases.rank_slice(rank)] for x in ring_cases.tower_data(world))
    out = {}
    for name in ("infcl", "infcl_with_dscale_all_reduce"):
        ddp = DistributedDataParallel(ring_cases.TwoTower(), process_group=group)
        img, txt, scale = ddp(x_img, x_txt)
        if name != "infcl":
            scale = _AllReduceGrad.apply(scale, group)
        cal_inf_loss(img, txt, scale=scale, symmetric=True, group=group, backend="torch").backward()
        out[name] = {p: v.grad.clone() for p, v in ddp.module.named_parameters()}
    return out


def main(backends):
    """Every scenario on each ring in RINGS this process belongs to; results keyed by ring size."""

    def scenarios(rank, size, group):
        return {
            "cases": run_cases(rank, size, group, backends),
            "overlap": run_overlap(rank, size, group),
            "mismatch": run_mismatch(rank, size, group),
            "open_clip": run_open_clip(rank, size, group),
            "ddp": run_ddp(rank, size, group),
        }

    run_on_rings(MAIN_WORLD, RINGS, scenarios)


def fail(scenario):
    """Scenarios "<die|hang>-<before|forward|backward>": what rank FAILING_RANK does, and where."""
    rank, world = init_worker()
    action_name, where = scenario.split("-")
    action = (lambda: os._exit(3)) if action_name == "die" else (lambda: time.sleep(HANG_S))
    route = "torch"
    if rank == FAILING_RANK:
        if where == "before":
            action()
        calls = []

        def at_second_block(method):  # the second block is ring step 1, after step 0's exchanges worked
            calls.append(1)
            if len(calls) == 2:
                action()

        route = _HookedTiles(at_second_block, ("forward_block",) if where == "forward" else ("backward_block",))
    q, k = torch.randn(4, ring_cases.DIM, requires_grad=True), torch.randn(4, ring_cases.DIM, requires_grad=True)
    start = time.monotonic()
    try:
        cal_inf_loss(q, k, symmetric=True, backend=route).backward()
        result = {"error": None}
    except Exception as err:  # the test checks the type and message
        result = {"error": (type(err).__name__, str(err)), "seconds": time.monotonic() - start}
    finish(result, barrier=False)


if __name__ == "__main__":
    if sys.argv[1] == "main":
        main(sys.argv[2:])
    else:
        fail(sys.argv[2])
