"""The time model: a modelled time per kernel launch from the report's counted and modelled figures.

Per launch at Bq = Bk = B (B^2 S entries), four terms, each a figure per S entry over a rate of the device
(:class:`Device`): tensor (flops at the GEMM rate, :func:`tensor_rate`), issue (lane instructions at
``issue_per_clk`` per SM per clock), MUFU (at ``mufu_per_clk``) and L2 (the traffic model's bytes at
``l2_tbs``), times the last wave's tail. ``bound`` is the largest term (everything overlapped), ``serial``
the sum (nothing overlapped; issue and MUFU one term), the estimate: on the H100 it lands within -6..+10% of
the measured kernels, the bound 36-54% under (docs/benchmarks.md, "The time model").

Its assumptions are the named constants below, each with its reason; every :class:`Device` field is also a
CLI option of ``python -m bench.static``. Nothing here compiles or imports infcl: the model reruns on a
stored report (``--from-csv``).
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .resources import LIMITS


@dataclass(frozen=True)
class Device:
    """What the time model assumes of one GPU. Every field is a CLI option of ``python -m bench.static``."""

    name: str
    sms: int
    clock_ghz: float  # sustained SM clock under this load
    tflops: float  # dense bf16 / fp16 tensor-core rate a large GEMM reaches (cuBLAS), not the datasheet peak
    l2_tbs: float  # L2 -> SM operand bandwidth, TB/s
    issue_per_clk: int = 128  # lane instructions issued per SM per clock: 4 schedulers x 1 warp instruction x 32
    mufu_per_clk: int = 16  # MUFU results (ex2, lg2, rcp) per SM per clock: 4 per scheduler
    fma_per_clk: int = 128  # fp32 FMA lanes per SM per clock (fp32 products without tensor cores)


# ---- the assumptions ----------------------------------------------------------------------------------

# tf32 MMAs run at half the 16-bit rate on sm_80 / sm_90 / sm_100 (the datasheets' dense figures).
TF32_RATE = 0.5
# The H100 SXM (sm_90), the one target measured: its sustained SM clock under tensor-core load (max 1.98 GHz),
# the bf16 GEMM rate bench measured on that machine (735-770 TFLOP/s), and its L2 bandwidth, the top of the
# 5.5-7.5 TB/s range of published H100 L2 read bandwidths, which with the serial sum fits the measured
# per-kernel times (docs/benchmarks.md, "The time model").
H100_CLOCK_GHZ = 1.755
H100_GEMM_TFLOPS = 750.0
H100_L2_TBS = 7.5
# Datasheet dense bf16 peaks, TFLOP/s: the H100's gives the fraction of its peak a GEMM reaches, which the
# unmeasured targets are assumed to reach of theirs.
H100_PEAK_TFLOPS = 989.4
A100_PEAK_TFLOPS = 312
B200_PEAK_TFLOPS = 2250
# The unmeasured targets' SM clocks: the A100 SXM's boost clock; the B200's, assumed.
A100_CLOCK_GHZ = 1.41
B200_CLOCK_GHZ = 1.8

H100 = Device("H100 SXM", LIMITS[90].sms, H100_CLOCK_GHZ, H100_GEMM_TFLOPS, H100_L2_TBS)
# What the unmeasured targets take from the H100: its GEMM fraction of the datasheet peak (750 / 989), and its
# L2 bytes per SM per clock (7.5 TB/s / 132 / 1.755 GHz = 32.4 B), scaled by their SMs and clock.
_GEMM_FRACTION = H100.tflops / H100_PEAK_TFLOPS
_L2_BYTES_PER_SM_CLK = H100.l2_tbs * 1e12 / (H100.sms * H100.clock_ghz * 1e9)


def _assumed(name: str, arch: int, clock_ghz: float, peak_tflops: float) -> Device:
    """An unmeasured target, scaled from the H100 (:data:`_GEMM_FRACTION`, :data:`_L2_BYTES_PER_SM_CLK`)."""
    sms = LIMITS[arch].sms
    l2_tbs = _L2_BYTES_PER_SM_CLK * sms * clock_ghz * 1e9 / 1e12
    return Device(name, sms, clock_ghz, round(_GEMM_FRACTION * peak_tflops, 1), round(l2_tbs, 2))


DEVICES = {
    90: H100,
    80: _assumed("A100 SXM (assumed)", 80, A100_CLOCK_GHZ, A100_PEAK_TFLOPS),
    100: _assumed("B200 (assumed)", 100, B200_CLOCK_GHZ, B200_PEAK_TFLOPS),
}
# The batches the model reports, and the GEMM-equivalents (2 B^2 D flops each) of the bound: S, and in the
# backward S again, dq and dk.
MODEL_BATCHES = (32768, 65536)
BOUND_GEMMS = 5
MODEL_TERMS = ("tensor", "issue", "mufu", "l2")
# The kernels modelled: the symmetric softmax loss's, infcl's and Inf-CL's (the sigmoid loss's are reported only).
MODEL_KERNELS = ("forward", "dq", "dk", "inf-cl forward", "inf-cl dq", "inf-cl dk")


def tensor_rate(device: Device, dtype: str) -> float:
    """flop/s of the products in operand type ``dtype`` (a row's label: bf16, fp16, fp32-tf32, fp32-ieee)."""
    if dtype in ("bf16", "fp16"):
        return device.tflops * 1e12
    if dtype == "fp32-tf32":
        return device.tflops * 1e12 * TF32_RATE
    return 2.0 * device.fma_per_clk * device.sms * device.clock_ghz * 1e9


def _figure(row: Dict, name: str) -> float:
    """A row's per-entry figure for the tiles without a positive (all but one or two column blocks per row
    block) where the report has it, else the listing's."""
    value = row.get(f"{name}_no_pos")
    return float(row[name] if value in (None, "") else value)


def model_kernel(row: Dict, batch: int, device: Device) -> Dict:
    """Modelled time (ms) of one launch of ``row``'s kernel at Bq = Bk = ``batch``, B^2 S entries.

    - tensor: the flops per S entry (S, and dq / dk's product, over all D slices) at :func:`tensor_rate`;
    - issue: the tile loop's lane instructions per entry (all slices) at ``issue_per_clk`` per SM per clock;
    - mufu: MUFU per entry (all slices) at ``mufu_per_clk`` per SM per clock;
    - l2: the modelled operand bytes per entry (:func:`modelled_bytes_flops`) at ``l2_tbs``;
    - tail: ceil(waves) / waves, the last wave's idle SMs (waves from the launch plan's programs at ``batch``
      over SMs x CTAs/SM; 1 where the report has no plan at that batch).
    ``bound`` = tail x the largest term: every unit overlapped with the others. ``serial`` = tail x (tensor
    + max(issue, mufu) + l2): nothing overlaps (MUFU instructions are issued in the same stream, so issue and
    MUFU are one term). ``serial`` is the estimate: on the H100 it fits the measured kernels (the bound does
    not; docs/benchmarks.md).
    """
    entries = float(batch) * batch
    clock = device.clock_ghz * 1e9
    slices = int(row.get("slices") or 1)
    terms = {
        "tensor": float(row["flops_per_entry"]) * entries / tensor_rate(device, row["dtype"]),
        "issue": _figure(row, "instr_per_entry_all_slices") * entries / (device.sms * device.issue_per_clk * clock),
        "mufu": _figure(row, "mufu_per_entry") * slices * entries / (device.sms * device.mufu_per_clk * clock),
        "l2": float(row["l2_bytes_per_entry"]) * entries / (device.l2_tbs * 1e12),
    }
    terms = {name: 1e3 * value for name, value in terms.items()}
    programs = row.get(f"programs@{batch}")
    waves = int(programs) / (device.sms * max(int(row["ctas_per_sm"]), 1)) if programs not in (None, "") else None
    tail = math.ceil(waves) / waves if waves else 1.0
    return {
        **{f"{name}_ms": value for name, value in terms.items()},
        "waves": waves,
        "tail": tail,
        "bound_ms": tail * max(terms.values()),
        "serial_ms": tail * (terms["tensor"] + max(terms["issue"], terms["mufu"]) + terms["l2"]),
        "limiter": max(terms, key=terms.get),
    }


def model_rows(
    rows: List[Dict],
    batches=MODEL_BATCHES,
    devices: Optional[Dict[int, Device]] = None,
    measured: Optional[Dict[Tuple, float]] = None,
) -> List[Dict]:
    """The time model of every softmax kernel row (infcl's forward, dq, dk; Inf-CL's) at each batch, then a
    total per (target, dtype, D, batch, method): the symmetric loss's forward + backward, Inf-CL's kernels
    counted twice (two calls), beside the bound of :data:`BOUND_GEMMS` GEMMs at the tensor rate.
    ``measured``: {(target, dtype, D, batch, kernel): ms} (:func:`read_measured`; "infcl total" and
    "inf-cl total" name the totals) gives each row its measured time and the estimate's error."""
    devices = devices or DEVICES
    measured = measured or {}
    out = []
    for batch in batches:
        totals: Dict[Tuple, Dict] = {}
        for row in rows:
            if row["kernel"] not in MODEL_KERNELS:
                continue
            arch = int(str(row["target"]).removeprefix("sm_"))
            device = devices[arch]
            method = "inf-cl" if row["kernel"].startswith("inf-cl") else "infcl"
            # Measured rows carry the loss's input dtype: Inf-CL's kernels run fp32 (tf32 products) on bf16 inputs.
            inputs = "bf16" if method == "inf-cl" else row["dtype"]
            key = (row["target"], inputs, int(row["D"]), batch)
            model = {
                "target": row["target"],
                "device": device.name,
                "dtype": row["dtype"],
                "D": int(row["D"]),
                "kernel": row["kernel"],
                "batch": batch,
                "calls": int(row.get("calls") or 1),
                **model_kernel(row, batch, device),
            }
            out.append(_with_measured(model, measured.get((*key, row["kernel"]))))
            total = totals.setdefault(
                (*key, method),
                {
                    "target": row["target"],
                    "device": device.name,
                    "dtype": inputs,
                    "D": int(row["D"]),
                    "kernel": f"{method} total",
                    "batch": batch,
                    "calls": 1,
                    "bound_ms": 0.0,
                    "serial_ms": 0.0,
                    "gemm_bound_ms": 1e3
                    * BOUND_GEMMS
                    * 2.0
                    * batch
                    * batch
                    * int(row["D"])
                    / tensor_rate(device, "bf16"),
                },
            )
            for name in ("bound_ms", "serial_ms"):
                total[name] += model["calls"] * model[name]
        for key, total in totals.items():
            total["x_gemm_bound"] = total["serial_ms"] / total["gemm_bound_ms"]
            out.append(_with_measured(total, measured.get((*key[:4], total["kernel"]))))
    return out


def _with_measured(model: Dict, measured_ms: Optional[float]) -> Dict:
    if measured_ms:
        model.update(
            measured_ms=measured_ms,
            serial_error=model["serial_ms"] / measured_ms - 1,
            bound_error=model["bound_ms"] / measured_ms - 1,
        )
    return model
