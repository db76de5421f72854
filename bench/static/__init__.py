"""``python -m bench.static``: a static performance report of the Triton kernels, compiled for GPU targets
on a machine without a GPU.

For each target (sm_90, sm_80, sm_100 where the wheel's ptxas knows it) and operand type, the public calls
``cal_inf_loss(symmetric=True)`` and ``cal_siglip_loss`` with ``backend="triton"`` run forward and
backward compile-only (``tests/helpers/triton_compile.py``: a stand-in driver names the target, every launch
compiles instead of running), at D = 512 and B = 16384 and 65536, so the kernels, their default configs and
their launch grids are exactly what the API launches. One row per (target, dtype, kernel): softmax
``forward``, ``dq``, ``dk``; ``siglip_forward``, ``siglip_backward``.

What is read from the compiled artefacts (counted, not run):

- ``mma``: the MMA instructions in the PTX (``wgmma`` / ``tcgen05`` / ``mma.sync``, with their shapes) and
  in the SASS (``HGMMA`` / ``UTC*MMA`` / ``HMMA``), each with its static count in the kernel.
- ``regs``, ``spill``: ptxas -v (the wheel's ptxas, Triton's flags); ``smem``: Triton's metadata.
- ``instr/entry``, ``mufu/entry``, ``shfl/entry``: instructions per S entry, counted in the SASS (the PTX
  where cuobjdump cannot disassemble the cubin). The tile loop is the loop (a backward branch) holding the
  most MUFU.EX2 outside its own inner loops; a loop nested in it runs over feature chunks, counted
  ``cdiv(D, BLOCK_D) - 1`` times (the first chunk is peeled) or ``cdiv(D, BLOCK_D)`` times if it stores to
  global memory (the sigmoid backward's per-chunk gradient). Per entry = warp instructions per tile x 32
  lanes x warps / (BLOCK_M x BLOCK_N x ROW_TILES, the row blocks one pass walks): lane instructions per S
  entry, per D slice of dq / dk (``slices``: each slice recomputes S, so an S entry costs
  ``instr_per_entry_all_slices`` in all). Approximate: the
  software pipeliner's prologue and epilogue and the branches not taken are counted as in the listing. The
  ``*_no_pos`` columns ("no pos." in the table) count the softmax kernels compiled for a tile that holds no
  positive (:func:`without_positives`), the path all but one or two column blocks per row block take.

What is modelled (not read from the code):

- ``CTAs/SM``: from registers (65536 per SM, allocated per warp in units of 256), shared memory (per SM,
  plus 1 KiB reserved per CTA), warps (64 per SM) and 32 CTAs per SM: the smallest of the four, named.
- ``waves``: the launch grid the launcher planned (on a stand-in device with the target's SM count) over
  SMs x CTAs/SM, for B = 16384 and 65536.
- ``flop/byte``: the tile loop's flops (S, and the dq/dk product) over the operand bytes it loads per
  tile, assuming nothing outlives a tile in L1 or shared memory except an operand held in registers
  (D <= resident_d). Per-row vectors (stats, positives) are left out; the sigmoid backward's per-chunk
  fp32 read-modify-write of the gradient is in.

The time model (:func:`model_kernel`, printed after the table and written to ``<name>-model.csv``): per
launch at B = 32768 and 65536 (``--model-batches``), four terms from the figures above — tensor (flops per
S entry at the GEMM rate ``--tflops``, half that for tf32), issue (lane instructions per entry at
``--issue-per-clk`` per SM per clock), MUFU (at ``--mufu-per-clk``), L2 (modelled bytes per entry at
``--l2-tbs``) — times the last wave's tail; ``bound`` is the largest term (everything overlapped),
``serial`` the sum (nothing overlapped; issue and MUFU one term), the estimate: on the H100 it lands within
-6..+10% of the measured kernels, the bound 36-54% under (docs/benchmarks.md, "The time model"). Each
target's assumptions are a :class:`Device` (H100 SXM for sm_90; A100 and B200 scaled from it, unmeasured),
every field an option; ``--measured`` compares with per-kernel times, ``--from-csv`` reruns the model on a
stored report without compiling. Inf-CL's kernels are compiled and modelled the same way when ``inf_cl``
is installed (``--no-inf-cl``: not).

``--dims`` and ``--tile KERNEL=MxN[:warps[:stages[:block_out]]]`` (repeatable) report other feature dims
and candidate configs, e.g. ``--targets 90 --dims 512,1000 --tile dq=64x64 --tile dk=64x64 --name try``.

The chunked route's passes (``backend="chunked"``: the stats pass, the merge of its partials, the grad pass;
:mod:`.chunked`) are compiled as a GPU chunk launches them and reported in a table of their own: registers,
spills, lane instructions, MUFU, shuffles per S entry (with and without a positive in the tile), barriers per
tile, HBM bytes per entry, CTAs per SM, the route's C and the waves at each B (``<name>-chunked.csv``, which
``python -m bench.chunked_model`` models; ``--no-chunked``: not).

Writes a table (stdout), bench/results/static.csv, static-model.csv and static.png (``--no-plot``: no plot). Figures are
reported, not asserted; the structural checks (no mma.sync where every product's M >= 64 on sm_90, no
spills, shared memory within the limit) are tests/test_static_report.py.

The package, by concern: :mod:`.compile` (infcl's kernels compiled for a target, one row per kernel) with
:mod:`.driver` (the compile-only driver), :mod:`.inf_cl_kernels` (Inf-CL's, the same way) and :mod:`.workers`
(every job in spawned processes); :mod:`.counts` and :mod:`.score_layout` (what is read from the compiled
code); :mod:`.resources` and :mod:`.traffic` (what is modelled of it: occupancy, waves, bytes and flops);
:mod:`.time_model` (readable on its own); :mod:`.report` (tables, CSVs, plot); :mod:`.cli`. The infcl
internals it reaches into are all in :mod:`.infcl_internals`.
"""

from .chunked import format_chunked, report_chunked, run_chunked
from .cli import main
from .compile import report_target
from .counts import PTX, SASS, Dialect, compiled_figures, mma_kinds, tile_loop_counts
from .inf_cl_kernels import INF_CL_CALLS, INF_CL_KERNELS, inf_cl_installed, kernel_label, report_inf_cl
from .infcl_internals import TILE_KERNELS, parse_tile, score_lines, tile_overrides, without_positives
from .matrix import BATCHES, BF16, DIM, ENTRIES, TARGETS, TF32
from .report import (
    DEFAULT_OUT,
    PLOT_PANELS,
    format_model,
    format_table,
    read_measured,
    read_rows,
    write_csv,
    write_plot,
)
from .resources import LIMITS, SMLimits, add_launch, occupancy
from .score_layout import mma_instruction, score_mma_layouts
from .time_model import (
    BOUND_GEMMS,
    DEVICES,
    H100,
    MODEL_BATCHES,
    MODEL_KERNELS,
    MODEL_TERMS,
    TF32_RATE,
    Device,
    model_kernel,
    model_rows,
    tensor_rate,
)
from .traffic import inf_cl_bytes_flops, modelled_bytes_flops, per_entry_model
from .workers import NO_POSITIVE_FIGURES, WORKERS, run

__all__ = [
    "BATCHES",
    "BF16",
    "BOUND_GEMMS",
    "DEFAULT_OUT",
    "DEVICES",
    "DIM",
    "Device",
    "Dialect",
    "ENTRIES",
    "H100",
    "INF_CL_CALLS",
    "INF_CL_KERNELS",
    "LIMITS",
    "MODEL_BATCHES",
    "MODEL_KERNELS",
    "MODEL_TERMS",
    "NO_POSITIVE_FIGURES",
    "PLOT_PANELS",
    "PTX",
    "SASS",
    "SMLimits",
    "TARGETS",
    "TF32",
    "TF32_RATE",
    "TILE_KERNELS",
    "WORKERS",
    "add_launch",
    "compiled_figures",
    "format_chunked",
    "format_model",
    "format_table",
    "inf_cl_bytes_flops",
    "inf_cl_installed",
    "kernel_label",
    "main",
    "mma_instruction",
    "mma_kinds",
    "model_kernel",
    "model_rows",
    "modelled_bytes_flops",
    "occupancy",
    "parse_tile",
    "per_entry_model",
    "read_measured",
    "read_rows",
    "report_chunked",
    "report_inf_cl",
    "report_target",
    "run",
    "run_chunked",
    "score_lines",
    "score_mma_layouts",
    "tensor_rate",
    "tile_loop_counts",
    "tile_overrides",
    "without_positives",
    "write_csv",
    "write_plot",
]
