"""Spawn a CPU (gloo) process group from pytest, and the worker-side start and clean exit.

Parent side: :func:`launch` starts ``world`` worker processes (``python -m workers.<name>``), each rank
writes its results with :func:`finish` to ``<out_dir>/rank<r>.pt``, and :func:`launch` returns what
every rank wrote plus its exit code. The parent itself hosts the rendezvous ``TCPStore`` on
127.0.0.1 with port 0, so the OS picks a free port and no other process can take it in between.

Worker side: :func:`init_worker` joins the group; :func:`finish` writes the results and leaves with
``os._exit``. Why not ``destroy_process_group()``: with torch 2.13 + gloo about one spawned run in ten
aborts at interpreter exit ("terminate called without an active exception", SIGABRT) even after a
barrier; a barrier followed by ``os._exit(0)`` once the results are on disk ended that.
"""

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the worker modules import helpers.*
REPO_ROOT = os.path.dirname(TESTS_DIR)

# Environment variables that carry the rendezvous to a worker.
ENV_RANK, ENV_WORLD, ENV_PORT, ENV_OUT, ENV_PG_TIMEOUT = (
    "INFCL_TEST_RANK",
    "INFCL_TEST_WORLD",
    "INFCL_TEST_PORT",
    "INFCL_TEST_OUT",
    "INFCL_TEST_PG_TIMEOUT",
)
HOST = "127.0.0.1"
# How long ranks wait for each other to start (importing torch takes seconds on a loaded machine); kept
# apart from the process-group timeout, which the failure tests set to a few seconds.
RENDEZVOUS_S = 300.0
# Exit code of a rank that finished but wrote an error record instead of results.
EXIT_OK = 0


@dataclass
class RankOutcome:
    rank: int
    returncode: Optional[int]  # None: still running at the deadline and killed
    results: Optional[dict]  # what the rank passed to finish(), or None if it wrote nothing
    log: str  # the rank's stdout + stderr, for failure messages


def launch(
    world: int,
    module: str,
    out_dir: str,
    args: List[str] = (),
    pg_timeout_s: float = 30.0,
    deadline_s: float = 120.0,
    extra_env: Optional[Dict[str, str]] = None,
    wait_for: Optional[List[int]] = None,
) -> List[RankOutcome]:
    """Run ``python -m module *args`` as ranks 0..world-1 of a gloo group; return every rank's outcome.

    Ranks still running ``deadline_s`` after the start are killed (their ``returncode`` is None), so a
    hang fails the test instead of blocking the suite. With ``wait_for``, only those ranks are awaited;
    the others (a rank made to hang on purpose) are killed as soon as they are done.
    """
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=deadline_s))
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            # Keep gloo's connections on the loopback device, whatever the host name resolves to.
            "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": os.pathsep.join([REPO_ROOT, TESTS_DIR, env.get("PYTHONPATH", "")]),
            ENV_WORLD: str(world),
            ENV_PORT: str(store.port),
            ENV_OUT: out_dir,
            ENV_PG_TIMEOUT: str(pg_timeout_s),
        }
    )
    env.update(extra_env or {})
    procs, logs = [], []
    for rank in range(world):
        log = open(os.path.join(out_dir, f"rank{rank}.log"), "w+")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                env={**env, ENV_RANK: str(rank)},
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        logs.append(log)
    end = time.monotonic() + deadline_s
    awaited = range(world) if wait_for is None else wait_for
    codes = [None] * world
    for rank in list(awaited) + [r for r in range(world) if r not in awaited]:
        proc = procs[rank]
        try:
            timeout = max(0.1, end - time.monotonic()) if rank in awaited else 0
            codes[rank] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    outcomes = []
    for rank, log in enumerate(logs):
        log.seek(0)
        text = log.read()
        log.close()
        path = os.path.join(out_dir, f"rank{rank}.pt")
        results = torch.load(path, weights_only=False) if os.path.exists(path) else None
        outcomes.append(RankOutcome(rank, codes[rank], results, text))
    del store
    return outcomes


def describe(outcomes: List[RankOutcome]) -> str:
    """Every rank's exit code and log tail, for assertion messages."""
    return "\n".join(f"--- rank {o.rank}: exit {o.returncode}\n{o.log[-3000:]}" for o in outcomes)


def results_by_ring(outcomes: List[RankOutcome], rings: Dict[int, Tuple[int, ...]]) -> Callable[[int], List[dict]]:
    """Parent side of :func:`run_on_rings`: ``get(world)`` -> the results of the ring of ``world`` ranks,
    one dict per member in group-rank order; every call fails the test if any rank failed."""
    failed = None if all(o.returncode == 0 and o.results is not None for o in outcomes) else describe(outcomes)

    def get(world: int) -> List[dict]:
        if failed:
            pytest.fail(f"ring workers failed:\n{failed}")
        return [outcomes[member].results[world] for member in rings[world]]

    return get


def init_worker():
    """Join the group described by the environment; return (rank, world)."""
    rank, world = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD])
    store = dist.TCPStore(HOST, int(os.environ[ENV_PORT]), is_master=False, timeout=timedelta(seconds=RENDEZVOUS_S))
    # Wait until every rank is up, so that a slow start never counts against the short group timeout
    # (gloo connects its full mesh within that timeout).
    store.add("started", 1)
    end = time.monotonic() + RENDEZVOUS_S
    while store.add("started", 0) < world and time.monotonic() < end:
        time.sleep(0.01)
    timeout = timedelta(seconds=float(os.environ[ENV_PG_TIMEOUT]))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    torch.set_num_threads(1)
    return rank, world


def run_on_rings(world: int, rings: Dict[int, Tuple[int, ...]], scenarios: Callable[[int, int, object], dict]) -> None:
    """Worker side: join the group of ``world`` processes, make one process group per ring (``rings``:
    size -> global ranks, sorted; the whole world is the default group), run
    ``scenarios(group_rank, size, group)`` on every ring this process belongs to and :func:`finish`
    with ``{size: result}``."""
    rank, joined = init_worker()
    assert joined == world, (joined, world)
    # new_group is collective: every process creates every group, in the same order.
    groups = {
        size: (None if len(members) == world else dist.new_group(list(members))) for size, members in rings.items()
    }
    finish(
        {size: scenarios(members.index(rank), size, groups[size]) for size, members in rings.items() if rank in members}
    )


def finish(results: dict, barrier: bool = True) -> None:
    """Write this rank's results, wait for every rank (unless the group is broken), and exit now."""
    rank = int(os.environ[ENV_RANK])
    path = os.path.join(os.environ[ENV_OUT], f"rank{rank}.pt")
    torch.save(results, path + ".tmp")
    os.replace(path + ".tmp", path)  # the parent never reads a half-written file
    sys.stdout.flush()
    sys.stderr.flush()
    if barrier:
        dist.barrier()
    os._exit(EXIT_OK)
