"""The ``autotable`` step: the auto table's entry this run's measurements suggest. ``backend="auto"`` takes the
chunked route where :data:`infcl.backends.resolve.CHUNKED_FROM` says a GPU measured it faster than the fused kernels:
(GPU family, dtype) -> the smallest Bq from which it was. This step reads the speed step's rows (the CLIP loss, bf16,
forward + backward: "chunked" against the fused kernels' "triton", same B, same process) and writes the suggestion
to route.csv and to summary.md; the table itself changes by hand, with this run's files named beside it (docs/
chunked.md). Needs no GPU: a dry run suggests from its own rows (the torch tiles standing in for the fused kernels).
"""

from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

from .files import read_rows, route_row
from .plan import Sizes

FUSED = ("triton", "torch")  # the fused kernels' method name on a GPU, and its stand-in in a dry run


def suggest_chunked_from(rows: Iterable[Dict], loss: str = "clip", dtype: str = "bfloat16") -> Optional[int]:
    """The smallest B from which the route's forward + backward was faster than the fused kernels' at that B and at
    every larger B measured (None: at no B, or no pair measured). ``rows``: speed.csv's."""
    times: Dict[Tuple[str, int], float] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("loss", loss) == loss and r.get("dtype") == dtype and r.get("time_ms"):
            times[(r["method"], int(r["batch"]))] = float(r["time_ms"])
    batches = sorted({b for m, b in times if m == "chunked"})
    fused = next((f for f in FUSED if any(m == f for m, _ in times)), None)
    faster = [b for b in batches if fused and (fused, b) in times and times[("chunked", b)] < times[(fused, b)]]
    measured = [b for b in batches if fused and (fused, b) in times]
    threshold = None
    for b in reversed(measured):  # from the largest B down, as long as the route wins
        if b not in faster:
            break
        threshold = b
    return threshold


def family_of(capability: str) -> Optional[int]:
    """The GPU family (a key of infcl.kernels.target.ARCH_FAMILIES) of env.csv's capability, e.g. "90" -> 90."""
    from infcl.kernels.target import arch_key

    if not capability or not capability.isdigit():
        return None
    return arch_key((int(capability[:-1]), int(capability[-1])))


def step_autotable(out: Path, sizes: Sizes, dry: bool, part: str = "") -> None:
    env = dict(read_rows(out / "env.csv", ("key", "value")))
    family = family_of(env.get("capability", ""))
    threshold = suggest_chunked_from(read_rows(out / "speed.csv"))
    key = f"({family}, 'bfloat16')" if family is not None else "(<family>, 'bfloat16')"
    if threshold is None:
        route_row(
            out,
            "autotable",
            "CHUNKED_FROM",
            "suggestion",
            "none",
            note="the route was not faster than the fused kernels at the largest B measured (or not measured)",
        )
    else:
        route_row(
            out,
            "autotable",
            "CHUNKED_FROM",
            "suggestion",
            f"{key}: {threshold}",
            note="the smallest measured B from which the route beat the fused kernels at every larger B",
        )
