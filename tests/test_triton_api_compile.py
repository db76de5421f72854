"""The public API on a GPU target, compile-only: every Triton kernel a user's call launches compiles,
without spills, within shared memory and without float atomics, through the real registration.

Each call (``triton_compile.api_calls``) is ``cal_inf_loss`` / ``cal_siglip_loss`` / ``InfCLIPLoss`` /
``InfSigLipLoss`` forward and backward with ``backend="triton"`` (and ``cal_inf_loss`` with ``backend="chunked"``,
whose passes compile on sm_90, sm_80 and sm_100: ``triton_compile.chunked_calls``) on CPU tensors, in worker
processes that import infcl with TRITON_INTERPRET=0. Nothing below the API is bypassed: the backend choice, the
custom ops (``triton_op`` + ``wrap_triton`` on this torch), the per-architecture configs, the split plans and,
under INFCL_AUTOTUNE=1, the autotuner with every config of its search space as a trial. Only Triton's active driver
is a stand-in (``triton_compile.CompileOnlyDriver``: a GPU target, 132 SMs) and JITFunction.run compiles instead of
launching. ptxas (the wheel's, with Triton's flags) reports registers and spills.

Targets: sm_90, sm_80, sm_86 (the 99 KiB family) and, where the wheel's ptxas knows them, sm_100 and
sm_120. CI runs sm_90's whole matrix and the heaviest cases elsewhere, in every dtype on every target
(``triton_compile.api_dtypes``), and the mask options (ids,
multi_positive, a guide) on sm_90 and sm_80 in bf16 and fp32; INFCL_COMPILE_FULL=1 runs every case (every
mask kind too) on every target (``pytest -s`` prints the table either way; Triton's cache keeps compiled kernels
across calls and runs).
"""

import concurrent.futures
import multiprocessing
import os
import time
from collections import defaultdict

import pytest

from helpers import maxsim_compile, rank_distill_compile, triton_compile

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

WORKERS = 2
FULL = os.environ.get("INFCL_COMPILE_FULL", "0") == "1"


def _pool():
    context = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(WORKERS, context, initializer=triton_compile.init_worker)


def _summary(results) -> str:
    """Per target and kernel: compiled kernels, the ranges of registers and shared memory, spills."""
    by = defaultdict(dict)
    for result in results:
        arch = result["call"].split()[0]
        for row in result.get("kernels", ()):
            by[arch, row["kernel"]][row["hash"]] = row
    lines = [f"{'target':7} {'kernel':16} {'kernels':>7} {'regs':>9} {'smem KiB':>11} {'limit':>5} {'spills':>6}"]
    for (arch, kernel), rows in sorted(by.items()):
        regs = [r["regs"] for r in rows.values()]
        smem = [r["smem"] / 1024 for r in rows.values()]
        spills = sum(1 for r in rows.values() if r["spill_bytes"])
        limit = next(iter(rows.values()))["smem_limit"] // 1024
        lines.append(
            f"{arch:7} {kernel:16} {len(rows):7d} {min(regs):4d}-{max(regs):<4d} "
            f"{min(smem):5.0f}-{max(smem):<5.0f} {limit:5d} {spills:6d}"
        )
    return "\n".join(lines)


@pytest.fixture(scope="module")
def results():
    start = time.perf_counter()
    out = []
    with _pool() as pool:
        calls = pool.submit(triton_compile.api_calls, FULL).result()
        for result in pool.map(triton_compile.run_call, calls):
            out.append(result)
            if len(out) % 20 == 0 or len(out) == len(calls):
                print(f"{len(out)} / {len(calls)} calls, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"\n{_summary(out)}\n{len(out)} calls in {time.perf_counter() - start:.0f} s")
    return out


def _kernels(results):
    return [(r["call"], row) for r in results for row in r.get("kernels", ())]


def test_every_call_compiles(results):
    errors = [f"{r['call']}: {r['error']}" for r in results if "error" in r]
    assert not errors, f"{len(errors)} of {len(results)} calls failed:\n" + "\n".join(errors[:20])


def test_no_register_spills(results):
    spills = {
        f"{call} {row['kernel']}: {row['spill_bytes']} bytes ({row['regs']} registers)"
        for call, row in _kernels(results)
        if row["spill_bytes"]
    }
    assert not spills, "\n".join(sorted(spills))


def test_shared_memory_within_target_limit(results):
    over = {
        f"{call} {row['kernel']}: {row['smem']} > {row['smem_limit']} bytes"
        for call, row in _kernels(results)
        if row["smem"] > row["smem_limit"]
    }
    assert not over, "\n".join(sorted(over))


def test_no_float_atomics(results):
    atomics = {
        f"{call} {row['kernel']}: {row['float_atomics']}" for call, row in _kernels(results) if row["float_atomics"]
    }
    assert not atomics, "\n".join(sorted(atomics))


def test_matrix_covers_every_target_dtype_and_kernel(results):
    """Every (target, dtype) compiled each loss's kernels, and the autotuned path ran on every target."""
    seen = defaultdict(set)
    for call, row in _kernels(results):
        arch, _, dtype = call.split()[:3]
        seen[arch, dtype].add(row["kernel"])
    targets = {r["call"].split()[0] for r in results}
    assert {"sm_90", "sm_80", "sm_86"} <= targets
    for arch in targets:
        pairs = triton_compile.api_dtypes(int(arch[3:]), FULL, _float64_dot())
        dtypes = {triton_compile.dtype_label(d, p) for d, p in pairs}
        assert {"fp32-tf32", "bf16"} <= dtypes
        assert "fp32-ieee" in dtypes or arch not in ("sm_90", "sm_80"), arch
        for dtype in dtypes:
            assert {"forward", "dq", "dk", "siglip_forward", "siglip_backward"} <= seen[arch, dtype], (arch, dtype)
        assert any(r["call"].startswith(arch + " ") and r["call"].endswith("autotune") for r in results), arch


def test_topk_calls_compile_on_sm_90_and_sm_80(results):
    """topk_scores' kernel (and nothing else) compiled for each n on sm_90 and sm_80 in every dtype there."""
    seen = defaultdict(set)
    for r in results:
        if " topk_scores " in r["call"] and "kernels" in r:
            assert {row["kernel"] for row in r["kernels"]} == {"topk"}, r["call"]
            words = r["call"].split()
            seen[words[0], words[2]].add(words[-1])
    for arch in ("sm_90", "sm_80"):
        for dtype, precision in triton_compile.api_dtypes(int(arch[3:]), FULL, _float64_dot()):
            if precision != "tf32":
                label = triton_compile.dtype_label(dtype, precision)
                assert {f"n={n}" for n in triton_compile.topk_ns(dtype)} <= seen[arch, label], (arch, label)


def test_masked_calls_cover_every_mask_kind(results):
    """The mask options compiled (forward, dq, dk; with a guide also its scores' kernel) on sm_90 and sm_80
    in bf16 and fp32: ids, a guide and both; symmetric and one-directional; multi_positive "mean" and "sum"."""
    seen = defaultdict(set)
    for r in results:
        words = r["call"].split()
        kinds = {w for w in words if w in ("ids", "guide", "both", "mean", "sum", "sym")}
        matryoshka = any(w.startswith("matryoshka=") for w in words)  # its own kernels: the test below
        if words[1] == "cal_inf_loss" and {"ids", "guide", "both"} & kinds and "kernels" in r and not matryoshka:
            seen[words[0], words[2]] |= kinds | ({"one"} if "sym" not in kinds else set())
            guided = {"guide", "both"} & kinds  # the thresholds come from the guide-scores kernel
            expected = {"forward", "dq", "dk"} | ({"guide_label_scores"} if guided else set())
            assert {row["kernel"] for row in r["kernels"]} == expected, r["call"]
    for arch in ("sm_90", "sm_80"):
        for dtype in ("bf16", "fp32-ieee"):
            assert {"ids", "guide", "both", "mean", "sum", "sym", "one"} <= seen[arch, dtype], (arch, dtype)


def test_sigmoid_id_calls_compile_on_sm_90_80_100(results):
    """cal_siglip_loss with ids (issue 56) compiled, forward and both backward passes, in every dtype on sm_90,
    sm_80 and (where the wheel's ptxas knows it) sm_100; spills are test_no_register_spills' check."""
    seen = defaultdict(set)
    for r in results:
        words = r["call"].split()
        if words[1] == "cal_siglip_loss" and "ids" in words and "kernels" in r:
            assert {row["kernel"] for row in r["kernels"]} == {"siglip_forward", "siglip_backward"}, r["call"]
            seen[words[0]].add(words[2])
    arches = [a for a in triton_compile.SIGMOID_ID_TARGETS if triton_compile.ptxas_knows(a)]
    assert 90 in arches and 80 in arches
    for arch in arches:
        dtypes = {triton_compile.dtype_label(d, p) for d, p in triton_compile.api_dtypes(arch, False, _float64_dot())}
        assert dtypes <= seen[f"sm_{arch}"], (arch, seen[f"sm_{arch}"])


def test_matryoshka_calls_compile_on_sm_90_80_100(results):
    """cal_inf_loss(matryoshka=...) (issue 56) compiled its fused kernels, forward and both backward walks, in
    every dtype on sm_90, sm_80 and (where the wheel's ptxas knows it) sm_100, plain and with the mask options (the
    masked kernels, beside the guide scores' kernel where a guide is given; never a call per prefix, which would
    launch the softmax kernels); spills are test_no_register_spills' check."""
    seen = defaultdict(set)
    for r in results:
        words = r["call"].split()
        if any(w.startswith("matryoshka=") for w in words) and "kernels" in r:
            kind = next((w for w in words if w in ("ids", "guide", "both")), None)
            if kind is None:
                expected = {"matryoshka_forward", "matryoshka_dq", "matryoshka_dk"}
            else:
                expected = {"masked_matryoshka_forward", "masked_matryoshka_dq", "masked_matryoshka_dk"}
                expected |= {"guide_label_scores"} if kind != "ids" else set()
            assert {row["kernel"] for row in r["kernels"]} == expected, r["call"]
            seen[words[0]].add((words[2], kind is not None))
    arches = [a for a in triton_compile.MATRYOSHKA_TARGETS if triton_compile.ptxas_knows(a)]
    assert 90 in arches and 80 in arches
    for arch in arches:
        dtypes = {triton_compile.dtype_label(d, p) for d, p in triton_compile.api_dtypes(arch, False, _float64_dot())}
        assert {(d, masked) for d in dtypes for masked in (False, True)} <= seen[f"sm_{arch}"], arch


def test_maxsim_calls_compile_on_sm_90_80_100():
    """cal_maxsim_loss with backend="triton" (issue 55), forward and backward through the public call: its three
    kernels compile for sm_90, sm_80 and (where the wheel's ptxas knows it) sm_100 in every dtype, ColBERT's shape
    with masks and a long query (several row blocks) over a ragged D with ids, without spills, within shared
    memory and without float atomics (``maxsim_compile.calls``)."""
    with _pool() as pool:
        out = list(pool.map(maxsim_compile.run_call, maxsim_compile.calls(_float64_dot())))
    print(f"\n{_summary(out)}")
    problems = rank_distill_compile.problems(out)
    assert not problems, "\n".join(problems)
    seen = defaultdict(set)
    for r in out:
        seen[r["call"].split()[0]].update(row["kernel"] for row in r["kernels"])
    assert {"sm_90", "sm_80"} <= set(seen)
    for arch, kernels in seen.items():
        assert kernels == {"maxsim_forward", "maxsim_dq", "maxsim_dk"}, (arch, kernels)


def test_label_smoothing_guided_calls_compile():
    """cal_inf_loss with a guide and label_smoothing (issue 56) through the public call: the masked kernels' kept-sums
    variant (the forward's two more partials, the backward's uniform weights) compiles, forward, dq and dk beside
    the guide scores' kernel, on sm_90 in every dtype and on sm_80 / sm_100 in bf16 and fp32, without spills,
    within shared memory and without float atomics (``triton_compile.smoothing_calls``); never rerouted to the
    torch tiles (which would launch no kernel)."""
    with _pool() as pool:
        out = list(pool.map(triton_compile.run_call, triton_compile.smoothing_calls(_float64_dot())))
    print(f"\n{_summary(out)}")
    problems = rank_distill_compile.problems(out)
    assert not problems, "\n".join(problems)
    seen = defaultdict(set)
    for r in out:
        assert {row["kernel"] for row in r["kernels"]} == {"forward", "dq", "dk", "guide_label_scores"}, r["call"]
        seen[r["call"].split()[0]].add(r["call"].split()[2])
    assert {"bf16", "fp32-ieee", "fp32-tf32", "fp16"} <= seen["sm_90"], seen
    assert {"bf16", "fp32-ieee"} <= seen["sm_80"], seen


def test_big_one_chunk_tiles_compile():
    """A pinned tiling whose one-chunk S tile holds more than 2**20 products (128 x 128 at D = 128) compiles for
    sm_90, softmax and sigmoid, forward and backward: no interpreter-only code (score_tiles.score_dot's [M, N, D]
    product) is traced on a GPU target. Compiling is the whole check: such a tile spills in the backward and
    is nobody's default."""
    with _pool() as pool:
        out = list(pool.map(triton_compile.run_call, triton_compile.big_tile_calls()))
    errors = [f"{r['call']}: {r['error']}" for r in out if "error" in r]
    assert not errors, "\n".join(errors)
    kernels = {row["kernel"] for r in out for row in r["kernels"]}
    assert {"forward", "dq", "dk", "siglip_forward", "siglip_backward"} <= kernels


def test_floor_subset_compiles_every_kernel_family():
    """The floor subset (``triton_compile.floor_calls``, ``rank_distill_compile.floor_calls`` and
    ``maxsim_compile.floor_calls``: every kernel
    family once) compiles, within shared memory and without float atomics. .ci/run runs this test alone under
    Triton 3.4.0, the oldest infcl supports (``-k floor``); here, under the installed Triton, its calls are the
    matrix's, already in Triton's cache. Spills are printed, not failed: the configs are sized for the newest
    Triton (the matrix above holds it to none), and under 3.4 a few kernels spill tens of bytes (docs/kernels.md,
    "Triton versions"), which costs time, not correctness."""
    with _pool() as pool:
        out = list(pool.map(triton_compile.run_call, triton_compile.floor_calls()))
        out += list(pool.map(rank_distill_compile.run_call, rank_distill_compile.floor_calls()))
        out += list(pool.map(maxsim_compile.run_call, maxsim_compile.floor_calls()))
    print(f"\nTriton {triton.__version__}, torch {torch.__version__}\n{_summary(out)}")
    spills = {f"{call} {row['kernel']}: {row['spill_bytes']} B" for call, row in _kernels(out) if row["spill_bytes"]}
    print("".join(f"spills: {line}\n" for line in sorted(spills)))
    problems = [line for line in rank_distill_compile.problems(out) if ": spills " not in line]
    assert not problems, "\n".join(problems)
    kernels = {row["kernel"] for r in out for row in r["kernels"]}
    expected = triton_compile.FLOOR_KERNELS | {"best_positives", "ahead_counts", "distill_forward", "distill_backward"}
    expected |= {"maxsim_forward", "maxsim_dq", "maxsim_dk"}
    assert expected <= kernels, sorted(expected - kernels)
    assert {r["call"].split()[0] for r in out} == {"sm_90", "sm_80"}


def _float64_dot():
    from infcl.kernels.configs import FLOAT64_DOT

    return FLOAT64_DOT


@pytest.mark.parametrize("entry", ["cal_inf_loss", "cal_siglip_loss", "cal_inf_loss masked", "cal_inf_loss smoothed"])
def test_torch_compile_fullgraph_traces_into_the_kernels(entry):
    """torch.compile(fullgraph=True) of a step calling the loss with backend="triton" traces (AOTAutograd,
    an eager backend: Inductor needs a GPU) through the custom ops into the kernels: one frame, no graph
    break, the kernels as triton_kernel_wrapper nodes in the forward and backward graphs, and the
    compiled step runs forward and backward compile-only."""
    with _pool() as pool:
        # ids and a guide, "sum"; smoothed: a guide alone (one positive per row) with label smoothing's kept sums
        masks = {"masked": ("both", "sum", 0.0), "smoothed": ("guide", "", 0.1)}.get(entry.split()[-1], ("", "", 0.0))
        entry = entry.split()[0]
        out = pool.submit(triton_compile.compile_training_step, 90, entry, *masks).result()
    assert "error" not in out, out.get("error")
    assert out["frames"] == 1
    forward_graph, backward_graph = out["graphs"]
    # the kernels themselves are in the graphs (triton_op + wrap_triton)
    assert "triton_kernel_wrapper" in forward_graph and "triton_kernel_wrapper" in backward_graph
    expected = {"forward", "dq", "dk"} if entry == "cal_inf_loss" else {"siglip_forward", "siglip_backward"}
    if masks[0] in ("both", "guide"):  # a guide: its thresholds come from the masked kernels' own guide product
        expected |= {"guide_label_scores"}
    assert set(out["kernels"]) == expected
