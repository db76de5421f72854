"""The one GPU runner's dry run (``python -m bench.gpu_first --dry-run``): every step, the chunked route's included,
runs its control flow on CPU tensors at toy sizes through the one runner and the one float64 harness, writes its rows
and records how it ended; the auto table's suggestion from measured rows; the peers skipped gracefully on CPU; the
modelled time prints its assumptions and per-kernel table from the compiled passes."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from bench import chunked_model, gpu_first

REPO = Path(__file__).resolve().parent.parent


def _rows(path: Path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-first-dry")
    assert gpu_first.main(["--dry-run", "--in-process", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
def test_dry_run_covers_every_step(dry_run):
    steps = {row["step"]: row["status"] for row in _rows(dry_run / "steps.csv")}
    names = [step.name for stage in gpu_first.plan(dry_run) for step in stage]
    assert steps == {name: "ok" for name in names}
    route = {(r["step"], r["case"], r["metric"]): r["value"] for r in _rows(dry_run / "route.csv")}
    assert {step for step, _, _ in route} == {"probes", "gemm", "passes", "bits", "million", "peers", "autotable"}
    assert route["bits", f"B={gpu_first.DRY.bits}", "rerun identical"] == "1"
    assert any(step == "bits" and metric == "S fwd == bwd bits" and value == "1" for (step, _, metric), value in
               route.items())  # fmt: skip
    assert {metric for step, _, metric in route if step == "gemm"} >= {"scores", "dq", "dk"}
    # the CPU route's plan at the dry sizes: everything it holds (16 B an entry, the float32 dq/dk and copies) counted
    assert [v for (step, _, metric), v in route.items() if step == "million" and metric == "chunk plan"] == ["C=122"]
    assert {metric for step, _, metric in route if step == "probes"} >= {"mm.dtype", "addmm.dtype"}


@pytest.mark.slow
def test_dry_run_errors_go_through_the_one_harness_with_several_chunks(dry_run):
    rows = [r for r in _rows(dry_run / "correctness.csv") if r["status"] != "skipped"]
    assert all(r["status"] == "ok" for r in rows), [r["note"] for r in rows if r["status"] != "ok"]
    chunked = [r for r in rows if r["backend"] == "chunked"]
    assert {r["case"] for r in chunked} == {"plain", "labels", "siglip"}
    assert {r["dtype"] for r in chunked} == {"bfloat16", "float16", "tf32"}
    assert all(r["note"] == f"chunk_rows={gpu_first.DRY.check_chunk_rows}" for r in chunked)
    assert gpu_first.DRY.check[0] > 2 * gpu_first.DRY.check_chunk_rows  # several chunks a block
    for r in rows:
        assert r["within_tol"] == "True" and r["bit_identical"] == "True", r
        assert r.get("within_vanilla") in ("True", ""), r


@pytest.mark.slow
def test_dry_run_speed_has_ours_and_the_peers_skipped_on_cpu(dry_run):
    speed = _rows(dry_run / "speed.csv")
    ours = {(r["method"], r["loss"], int(r["batch"])) for r in speed if r["status"] == "ok"}
    for loss in ("clip", "siglip"):
        for b in gpu_first.DRY.speed:
            assert {("chunked", loss, b), ("torch", loss, b), ("vanilla", loss, b)} <= ours
    peers = [r for r in speed if r["method"] in {name for name, *_ in gpu_first.PEERS}]
    assert len(peers) == len(gpu_first.PEERS) * len(gpu_first.DRY.speed)
    assert all(r["status"] == "skipped" and "CUDA-only" in r["note"] for r in peers)
    assert "## The chunked route (route.csv)" in (dry_run / "summary.md").read_text()


def test_one_step_runs_in_its_own_process(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.gpu_first", "--dry-run", "--steps", "env", "--out",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(r["step"], r["status"]) for r in _rows(tmp_path / "steps.csv")] == [("env", "ok")]
    assert "==== env: ok ====" in (tmp_path / "logs.txt").read_text()


def test_the_auto_table_suggestion_from_measured_rows():
    def row(method, batch, ms, loss="clip"):
        return {"method": method, "loss": loss, "batch": str(batch), "dtype": "bfloat16", "status": "ok",
                "time_ms": str(ms)}  # fmt: skip

    rows = [row("triton", 16384, 16.1), row("chunked", 16384, 17.0), row("triton", 32768, 49.5),
            row("chunked", 32768, 11.0), row("triton", 65536, 191.9), row("chunked", 65536, 41.0)]  # fmt: skip
    assert gpu_first.suggest_chunked_from(rows) == 32768
    rows.append(row("chunked", 16384, 9.0, loss="siglip"))  # another loss: not read
    assert gpu_first.suggest_chunked_from(rows) == 32768
    slower_at_the_top = rows[:-2] + [row("chunked", 65536, 200.0)]
    assert gpu_first.suggest_chunked_from(slower_at_the_top) is None
    assert gpu_first.suggest_chunked_from([]) is None
    from bench.gpu_first.autotable import family_of

    assert (family_of("90"), family_of("100"), family_of("86"), family_of("")) == (90, 100, 86, None)


def test_peers_that_are_not_downloaded_get_a_row_saying_why(tmp_path):
    _, status = gpu_first.install(tmp_path, wheels=tmp_path / "nowhere")
    assert set(status) == {dist for _, _, dist, _ in gpu_first.PEERS}
    assert all(value.startswith("no wheel in") for value in status.values())


def test_model_prints_its_assumptions_and_the_table_per_kernel():
    out = subprocess.run([sys.executable, "-m", "bench.chunked_model"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert "MODEL" in out and "H100 SXM" in out and "H200" in out
    for words in ("GEMM 652 TFLOP/s, HBM 4.1 TB/s", "GEMM 750 TFLOP/s, HBM 2.85 TB/s", "float32 output"):
        assert words in out, words
    for kernel in ("scores", "stats pass", "merge", "grad pass", "dq", "dk", "siglip pass", "launch gaps"):
        assert f"\n{kernel} " in out, kernel
    assert "no compiled SigLIP pass" not in out  # the stored report holds SigLIP's own pass
    passes = chunked_model.read_passes(chunked_model.STATIC_CSV)
    rows = chunked_model.model_loss("clip", 65536, chunked_model.GPUS["H200"], passes)
    total = rows[-1]
    assert total["kernel"] == "total" and total["ms"] == pytest.approx(sum(r["ms"] for r in rows[:-1]))
    gemm_floor = 4 * 2.0 * 65536**2 * 512 / (652e12) * 1e3  # four GEMM-equivalents at the GEMM rate
    assert gemm_floor < total["ms"] < 2 * gemm_floor


def test_siglip_model_reads_its_own_pass_and_bytes():
    """SigLIP's modelled pass takes the ``chunk siglip`` row's instructions and occupancy (not the softmax grad
    pass's) and the bytes its kernel moves: S read in float32, dS written in bf16, the loss partials."""
    import torch

    from infcl.kernels.chunked_sigmoid import pass_bytes
    from infcl.kernels.tiling import CHUNK_GRAD_TILE as TILE
    from infcl.kernels.tiling import CHUNK_SPLIT_TILES

    stored = chunked_model.read_passes(chunked_model.STATIC_CSV)
    passes = {**stored, "chunk siglip": {**stored["chunk grad"], "instr_per_entry_no_pos": "100", "ctas_per_sm": "1"}}
    gpu, batch = chunked_model.GPUS["H100 SXM"], 65536
    row = next(r for r in chunked_model.model_loss("siglip", batch, gpu, passes) if r["kernel"] == "siglip pass")
    c = chunked_model.chunk_rows(batch)
    lanes = gpu.sms * gpu.issue_per_clk * gpu.clock_ghz * 1e9
    assert row["issue_ms"] == pytest.approx(100 * float(batch) ** 2 / lanes * 1e3)
    read, written = pass_bytes(c, batch, torch.bfloat16, True)
    assert read == 4 * c * batch and written > 2 * c * batch  # dS and the loss partials
    chunks = -(-batch // c)
    assert row["hbm_ms"] == pytest.approx(chunks * (read + written) / (gpu.hbm_tbs * 1e12) * 1e3)
    programs = -(-c // TILE.block_m) * -(-(batch // TILE.block_n) // CHUNK_SPLIT_TILES)  # one CTA per SM
    waves = programs / gpu.sms
    assert row["tail"] == pytest.approx(-(-programs // gpu.sms) / waves)


@pytest.mark.slow
def test_the_prepared_sweep_runs_on_cpu_tensors(tmp_path):
    """bench.chunked_sweep (the next GPU's A/B of the stats pass's tilings, of auto's table at small B and of the
    fused Matryoshka kernels), its
    control flow on CPU tensors through the interpreter: every row ok, the tilings' stats within 1e-5 of the shipped
    one's, the route timed under both, every method of the auto table timed."""
    import json

    from bench import chunked_sweep

    assert chunked_sweep.main(["--dry-run", "--repeats", "1", "--candidates", "2", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    stats = [r for r in rows if r["step"] == "stats"]
    assert [r["status"] for r in stats] == ["ok", "ok"]
    assert all(r["row_r_rel"] < 1e-5 and r["col_r_rel"] < 1e-5 and r["row_max_equal"] for r in stats)
    assert [r["step"] for r in rows].count("route") in (1, 2)
    auto = {(r["loss"], r["method"]) for r in rows if r["step"] == "auto" and r["status"] == "ok"}
    assert auto == {(loss, m) for loss in ("clip", "siglip") for m in ("torch", "chunked", "vanilla")}
    matryoshka = {r["method"]: r["status"] for r in rows if r["step"] == "matryoshka"}
    assert matryoshka == {m: "ok" for m in ("one loss", "matryoshka fused", "matryoshka per prefix")}


def test_the_sweep_hides_only_the_fused_matryoshka_operations():
    """The per-prefix stand-in is the Triton backend less its two fused Matryoshka block operations."""
    from bench.chunked_sweep import _per_prefix_triton

    backend = _per_prefix_triton()
    assert backend.name == "triton"
    assert not hasattr(backend, "matryoshka_forward_block") and not hasattr(backend, "matryoshka_backward_block")
    assert hasattr(backend, "forward_block") and hasattr(backend, "backward_block")
