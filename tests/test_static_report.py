"""The static performance report (bench/static/) on sm_90 bf16 at D = 512 (whole feature chunks) and 1000
(ragged), compile-only, and what in it is structural: every kernel of both losses compiled and its tile loop
found; S on wgmma; S from the same MMA ops in the same layouts in the softmax forward, dq and dk (the
bit-identical S the backward relies on), one layout for every chunk; no mma.sync in a kernel whose products
all have M >= 64 (wgmma's smallest M); no spills; shared memory within the limit. The figures (instructions,
MUFU and shuffles per S entry, CTAs per SM, waves, flop/byte) are reported (``pytest -s`` prints the table),
never asserted.

The default and autotune configs are checked to share one S tile per (family, tensor-core class, ragged D)
without compiling; the listing and TTGIR readers, the occupancy model and the time model (its terms, the
totals, the comparison with measured times, a stored report read back) on small hand-made inputs. Inf-CL's
kernels, compiled the same way, where ``inf_cl`` is installed (skipped otherwise).
"""

import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from bench import static  # noqa: E402

# wgmma's M is 64 per warpgroup: a product with fewer rows has to use mma.sync.
WGMMA_M = 64
KERNELS = {"forward", "dq", "dk", "siglip_forward", "siglip_backward"}
SOFTMAX_KERNELS = ("forward", "dq", "dk")
# D = 512: several whole feature chunks; 1000: ragged chunks (configs.ragged_d), which may take another S tile.
DIMS = (512, 1000)


@pytest.fixture(scope="module")
def rows():
    out = static.run(targets=(90,), dims=DIMS, workers=1, no_positive=False)
    if not out:
        pytest.skip("the triton wheel's ptxas does not know sm_90")
    print("\n" + static.format_table(out))
    return out


def test_every_kernel_reported_with_its_tile_loop(rows):
    assert {r["kernel"] for r in rows} == KERNELS
    for r in rows:
        assert r["listing"] == "sass", r["kernel"]
        assert r["instr_per_entry"] is not None and r["instr_per_entry"] > 0, r["kernel"]
        assert r["mufu_per_entry"] > 0, r["kernel"]  # the loop holds the exponentials by construction
        for batch in static.BATCHES:
            assert r[f"programs@{batch}"] >= 1, (r["kernel"], batch)


def test_scores_on_wgmma_and_no_mma_sync_where_every_product_allows_wgmma(rows):
    for r in rows:
        assert r["async_mma"] > 0, f"{r['kernel']} {r['config']}: no wgmma ({r['mma_ptx']})"
        if r["min_mma_m"] >= WGMMA_M and r["warps"] % 4 == 0:
            assert r["mma_sync"] == 0, f"{r['kernel']} {r['config']}: mma.sync in the PTX ({r['mma_ptx']})"


def test_scores_from_one_mma_layout_in_forward_dq_and_dk(rows):
    """The bit-identical S premise, read from the compiled code: S's MMA ops (score_tiles.score_dot's tl.dot) have
    one layout in each softmax kernel (every feature chunk alike) and it is the same in all three."""
    for dim in DIMS:
        by_kernel = {r["kernel"]: r for r in rows if r["D"] == dim and r["kernel"] in SOFTMAX_KERNELS}
        assert set(by_kernel) == set(SOFTMAX_KERNELS), dim
        for name, r in by_kernel.items():
            assert r["s_layouts"] == 1, f"D={dim} {name} {r['config']}: S in {r['s_layouts']} layouts ({r['s_mma']})"
        layouts = {name: (r["s_layout"], r["s_mma"]) for name, r in by_kernel.items()}
        assert len({digest for digest, _ in layouts.values()}) == 1, f"D={dim}: {layouts}"


def test_configs_share_one_score_tile():
    """Every default and autotune config of the three softmax kernels on tensor cores is built on the one S
    tile of its (family, class, ragged D): the same BLOCK_M, BLOCK_N and num_warps (so the same MMA)."""
    from infcl.kernels import softmax_backward, softmax_forward
    from infcl.kernels.configs import TENSOR_CORE_CLASSES, ragged_d
    from infcl.kernels.target import ARCH_FAMILIES
    from infcl.kernels.tiling import plain_tiling, score_tile

    for arch in ARCH_FAMILIES:
        for operand_class in TENSOR_CORE_CLASSES:
            for dim in (40, 512, 1000):  # 40 is ragged for tf32's 32-feature chunks, one chunk for bf16's
                ragged = ragged_d(dim, operand_class)
                tile = score_tile(arch, operand_class, ragged)
                tiling = plain_tiling(arch, operand_class, dim)
                for name, cfg in (("forward", tiling.forward), ("dq", tiling.dq), ("dk", tiling.dk)):
                    assert cfg.score_tile == tile, (arch, operand_class, dim, name, cfg)
                spaces = (
                    softmax_forward.AUTOTUNE_CONFIGS,
                    softmax_backward.DQ_AUTOTUNE_CONFIGS,
                    softmax_backward.DK_AUTOTUNE_CONFIGS,
                )
                for space in spaces:
                    assert space[arch, operand_class, ragged], (arch, operand_class, ragged)
                    assert {cfg.score_tile for cfg in space[arch, operand_class, ragged]} == {tile}, (
                        arch,
                        operand_class,
                        ragged,
                    )


def test_no_spills_and_shared_memory_within_limit(rows):
    for r in rows:
        assert r["spill_bytes"] == 0, f"{r['kernel']}: {r['spill_bytes']} spill bytes at {r['regs']} registers"
        assert r["smem"] <= r["smem_limit"], f"{r['kernel']}: {r['smem']} > {r['smem_limit']} bytes"


# A made-up SASS listing: a prologue, a tile loop with one inner (feature-chunk) loop, an epilogue.
LISTING = """Function:_k
--:-:-:-:1\tMOV R1, R2;
LBB0:
--:-:-:-:1\tHGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24;
LBB1:
--:-:-:-:1\tLDG.E R3, desc[UR4][R4.64];
--:-:-:-:1\tHGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24;
--:-:-:-:1\t@P1 BRA LBB1;
--:-:-:-:1\tMUFU.EX2 R5, R5;
--:-:-:-:1\tMUFU.EX2 R6, R6;
--:-:-:-:1\tSHFL.BFLY PT, R7, R6, 0x1, 0x1f;
--:-:-:-:1\tBAR.SYNC.DEFER_BLOCKING 0x0;
--:-:-:-:1\t@P2 BRA LBB0;
--:-:-:-:1\tMUFU.LG2 R8, R8;
--:-:-:-:1\tEXIT;
"""


def test_tile_loop_counts_weights_the_chunk_loop():
    # Tile loop: 1 HGMMA + [inner: 3 instructions, one a load] x (4 - 1) trips + 2 MUFU + 1 SHFL + 1 BAR + 1 BRA.
    counts = static.tile_loop_counts(LISTING, static.SASS, n_chunks=4)
    assert counts == {"static": 9, "instr": 1 + 3 * 3 + 5, "mufu": 2, "ex2": 2, "shfl": 1, "bar": 1, "loads": 3}
    assert static.tile_loop_counts(LISTING.replace("MUFU.EX2", "FMUL"), static.SASS, 4) is None
    # a chunk loop the source does not peel (Inf-CL's loop over heads) runs n_chunks times
    assert static.tile_loop_counts(LISTING, static.SASS, n_chunks=4, peeled=False)["instr"] == 1 + 3 * 4 + 5


def test_mma_kinds_reads_ptx_and_sass():
    ptx = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {...};\nmma.sync.aligned.m16n8k16.row.col.f32.bf16"
    kinds = static.mma_kinds(ptx, LISTING)
    assert kinds["mma_sync"] == 1 and kinds["async_mma"] == 1
    assert kinds["mma_ptx"] == "mma.sync.m16n8k16:1 wgmma.m64n64k16:1"
    assert kinds["mma_sass"] == "HGMMA.64x64x16:2"


# A made-up TTGIR: the S product (its location in tiles.py, lines 10-12) peeled and in the loop, in two
# layouts, and a product elsewhere (line 40) that is not S.
TTGIR = """#loc = loc("/x/softmax_backward.py":1:1)
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 32, 16]}>
#shared = #ttg.nvmma_shared<{swizzlingByteWidth = 128, transposed = false, elementBitWidth = 16}>
#smem = #ttg.shared_memory
    %raw = ttng.warp_group_dot %q, %k, %z {isAsync = true} : !ttg.memdesc<64x64xbf16, #shared, #smem> * \
!ttg.memdesc<64x64xbf16, #shared, #smem> -> tensor<64x64xf32, #mma> loc(#loc7)
      %raw_1 = ttng.warp_group_dot %q1, %k1, %raw {isAsync = true} : !ttg.memdesc<64x64xbf16, #shared, #smem, \
mutable, 3x64x64> * !ttg.memdesc<64x64xbf16, #shared, #smem, mutable> -> tensor<64x64xf32, #mma1> loc(#loc8)
    %acc = tt.dot %ds, %kout, %acc0 : tensor<64x64xbf16> * tensor<64x256xbf16> -> tensor<64x256xf32, #mma> loc(#loc9)
#loc3 = loc("/y/infcl/kernels/score_tiles.py":11:16)
#loc4 = loc("/y/infcl/kernels/score_tiles.py":40:11)
#loc5 = loc("/x/softmax_backward.py":200:5)
#loc6 = loc("raw"(#loc3))
#loc7 = loc(callsite(#loc3 at #loc5))
#loc8 = loc(callsite(#loc6 at #loc5))
#loc9 = loc(callsite(#loc4 at #loc5))
"""


def test_score_mma_layouts_reads_the_score_product_and_its_layouts():
    layouts = static.score_mma_layouts(TTGIR, ("score_tiles.py", range(10, 13)))
    # the two S dots (not the product at line 40), buffers' mutability and stage count left out
    assert [static.mma_instruction(layout) for layout in layouts] == ["wgmma m64n32k16 8x1", "wgmma m64n32k16 4x2"]
    assert all("mutable" not in layout and "3x64x64" not in layout for layout in layouts)
    assert "instrShape = [16, 32, 16]" in layouts[0] and "swizzlingByteWidth = 128" in layouts[0]
    one = TTGIR.replace("#mma1>", "#mma>")  # both chunks in one layout
    assert len(static.score_mma_layouts(one, ("score_tiles.py", range(10, 13)))) == 1
    assert static.score_mma_layouts(TTGIR, ("score_tiles.py", range(50, 60))) == []


def test_mma_instruction_names():
    assert (
        static.mma_instruction("tc_gen5_mma #ttng.tensor_memory_encoding<blockM = 64, blockN = 32, colStride = 1>")
        == "tcgen05 m64n32"
    )
    v2 = "dot #ttg.nvidia_mma<{versionMajor = 2, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 8]}>"
    assert static.mma_instruction(v2) == "mma.sync m16n8 4x2"


@pytest.mark.parametrize(
    "regs, warps, smem, expected",
    [
        (128, 8, 0, (2, "regs")),  # 128 x 256 threads = 32768 registers: two CTAs in 65536
        (168, 4, 0, (3, "regs")),  # 168 x 32 = 5376 per warp: 12 warps fit, 3 CTAs of 4
        (32, 4, 100 * 1024, (2, "smem")),  # 101 KiB per CTA with the reserved KiB: two in 228 KiB
        (16, 4, 0, (16, "warps")),  # 16 registers: 128 warps' worth, but 64 warps per SM
        (16, 1, 0, (32, "ctas")),
    ],
)
def test_occupancy(regs, warps, smem, expected):
    assert static.occupancy(regs, warps, smem, 90) == expected


def test_parse_tile():
    assert static.parse_tile("dk=64x64:8:3:256") == ("dk", (64, 64, 8, 3, 256))
    assert static.parse_tile("siglip=128x32") == ("siglip", (128, 32))
    for bad in ("dk=64", "attention=64x64", "dq=64x64:8:3:256:1"):
        with pytest.raises(ValueError, match="--tile"):
            static.parse_tile(bad)


# ---- the time model --------------------------------------------------------------------------------------
# A made-up device with round figures, and a kernel row with round per-entry figures.
DEVICE = static.Device("test", sms=100, clock_ghz=1.0, tflops=1000.0, l2_tbs=1.0, issue_per_clk=128, mufu_per_clk=16)
ROW = {
    "target": "sm_90",
    "dtype": "bf16",
    "D": 512,
    "kernel": "dq",
    "slices": 2,
    "ctas_per_sm": 1,
    "flops_per_entry": 3072.0,
    "l2_bytes_per_entry": 80.0,
    "instr_per_entry_all_slices": 200.0,
    "instr_per_entry_all_slices_no_pos": 128.0,
    "mufu_per_entry": 2.5,
    "mufu_per_entry_no_pos": 2.0,
    "programs@1000": 150,
}


def test_model_kernel_terms():
    m = static.model_kernel(ROW, 1000, DEVICE)
    entries, clock, sms = 1e6, 1e9, 100
    assert m["tensor_ms"] == pytest.approx(1e3 * 3072 * entries / 1e15)
    assert m["issue_ms"] == pytest.approx(1e3 * 128 * entries / (sms * 128 * clock))  # no-positive figure
    assert m["mufu_ms"] == pytest.approx(1e3 * 2.0 * 2 * entries / (sms * 16 * clock))  # per slice x slices
    assert m["l2_ms"] == pytest.approx(1e3 * 80 * entries / 1e12)
    assert m["waves"] == 1.5 and m["tail"] == pytest.approx(2 / 1.5)
    terms = [m[f"{t}_ms"] for t in static.MODEL_TERMS]
    assert m["bound_ms"] == pytest.approx(m["tail"] * max(terms))
    assert m["serial_ms"] == pytest.approx(m["tail"] * (m["tensor_ms"] + max(m["issue_ms"], m["mufu_ms"]) + m["l2_ms"]))
    assert m["limiter"] == "l2"
    no_plan = static.model_kernel(ROW, 2000, DEVICE)  # no launch plan at that batch: no tail
    assert no_plan["tail"] == 1.0 and no_plan["l2_ms"] == pytest.approx(4 * m["l2_ms"])


def test_tensor_rate_by_operand_type():
    assert static.tensor_rate(DEVICE, "bf16") == 1e15
    assert static.tensor_rate(DEVICE, "fp32-tf32") == 1e15 * static.TF32_RATE
    assert static.tensor_rate(DEVICE, "fp32-ieee") == 2 * 128 * 100 * 1e9


def test_model_rows_totals_and_measured_errors():
    forward = {**ROW, "kernel": "forward", "slices": 1, "flops_per_entry": 1024.0, "l2_bytes_per_entry": 24.0}
    theirs = {**ROW, "kernel": "inf-cl dq", "dtype": "fp32-tf32", "calls": 2}
    measured = {("sm_90", "bf16", 512, 1000, "dq"): 1.0, ("sm_90", "bf16", 512, 1000, "inf-cl total"): 3.0}
    models = static.model_rows(
        [ROW, forward, theirs, {**ROW, "kernel": "siglip_forward"}], (1000,), {90: DEVICE}, measured
    )
    by = {m["kernel"]: m for m in models}
    assert set(by) == {"dq", "forward", "inf-cl dq", "infcl total", "inf-cl total"}  # siglip is not modelled
    assert by["dq"]["serial_error"] == pytest.approx(by["dq"]["serial_ms"] / 1.0 - 1)
    assert by["infcl total"]["serial_ms"] == pytest.approx(by["dq"]["serial_ms"] + by["forward"]["serial_ms"])
    assert by["inf-cl total"]["serial_ms"] == pytest.approx(2 * by["inf-cl dq"]["serial_ms"])  # two calls
    assert by["inf-cl total"]["measured_ms"] == 3.0
    bound = 1e3 * static.BOUND_GEMMS * 2.0 * 1000**2 * 512 / 1e15
    assert by["infcl total"]["gemm_bound_ms"] == pytest.approx(bound)
    assert "infcl total" in static.format_model(models)


def test_model_from_a_stored_report(tmp_path):
    """The CSV the report writes is enough to rerun the model (no compile), measured times from a CSV."""
    static.write_csv([ROW], tmp_path / "r.csv")
    (tmp_path / "m.csv").write_text("target,dtype,D,batch,kernel,measured_ms\nsm_90,bf16,512,1000,dq,2.5\n")
    measured = static.read_measured(tmp_path / "m.csv")
    again = static.model_rows(static.read_rows(tmp_path / "r.csv"), (1000,), {90: DEVICE}, measured)
    direct = static.model_rows([ROW], (1000,), {90: DEVICE}, measured)
    assert [m["serial_ms"] for m in again] == pytest.approx([m["serial_ms"] for m in direct])
    assert again[0]["measured_ms"] == 2.5


def test_stored_report_has_the_model_columns():
    rows = static.read_rows(static.DEFAULT_OUT / "static.csv")
    sm90 = {r["kernel"]: r for r in rows if r["target"] == "sm_90" and r["D"] == "512"}
    models = {m["kernel"]: m for m in static.model_rows(list(sm90.values()), (32768,))}
    assert {"forward", "dq", "dk", "infcl total"} <= set(models)


def test_kernel_labels_meet_the_profiler_names():
    # The softmax backward is one kernel for dq and dk (BY_COLUMN): the profiler sees it as one name.
    assert static.kernel_label("_backward_kernel") == "backward"
    assert static.kernel_label("_forward_kernel") == "forward"
    assert static.kernel_label("_dk_prob_bwd_kernel") == "inf-cl dk"


def test_inf_cl_traffic_model():
    # fp32 64x64 tiles at D = 512: q and k slices every tile (64 B per entry); dq adds k again and the fp32
    # read-modify-write of its 64 rows (160 B per entry), twice the flops.
    assert static.inf_cl_bytes_flops("inf-cl forward", 64, 64, 512, 4) == (4 * 512 * 128, 2.0 * 64 * 64 * 512)
    nbytes, flops = static.inf_cl_bytes_flops("inf-cl dq", 64, 64, 512, 4)
    assert nbytes / (64 * 64) == 160 and flops == 4.0 * 64 * 64 * 512


def test_inf_cl_kernels_compiled_and_counted():
    pytest.importorskip("inf_cl")
    rows = static.run(targets=(90,), entries=(), batches=(32768,), workers=1, inf_cl=True)
    if not rows:
        pytest.skip("the triton wheel's ptxas does not know sm_90")
    by = {r["kernel"]: r for r in rows}
    assert set(by) == {"inf-cl forward", "inf-cl dq", "inf-cl dk"}
    for r in rows:
        assert r["listing"] == "sass" and r["instr_per_entry"] > 0 and r["mufu_per_entry"] > 0, r["kernel"]
        assert r["async_mma"] > 0 and r["calls"] == static.INF_CL_CALLS
    assert by["inf-cl forward"]["flops_per_entry"] == 2 * 512 and by["inf-cl dq"]["flops_per_entry"] == 4 * 512


CHUNKED_PASSES = {"chunk stats", "chunk merge", "chunk grad", "chunk siglip"}


@pytest.fixture(scope="module")
def chunked_rows():
    out = static.run_chunked(targets=(90,), workers=1)
    if not out:
        pytest.skip("the triton wheel's ptxas does not know sm_90")
    print("\n" + static.format_chunked(out))
    return out


def test_chunked_passes_reported_without_spills(chunked_rows):
    """The chunked route's passes as a GPU chunk launches them (even tiles, dS in bf16), SigLIP's one pass (loss and
    dS at once) among them: each found with its tile loop, the tiles without a positive issuing no more than the
    listing, no spills, the launch plan at every B."""
    assert {r["kernel"] for r in chunked_rows} == CHUNKED_PASSES
    for r in chunked_rows:
        assert r["listing"] == "sass" and r["spill_bytes"] == 0, r
        assert 0 < r["instr_per_entry_no_pos"] <= r["instr_per_entry"], r
        assert r["bar_per_tile"] is not None and r["loads_per_tile"] > 0, r
        for batch in static.BATCHES:
            assert r[f"programs@{batch}"] >= 1 and r[f"chunk_rows@{batch}"] % 64 == 0, (r["kernel"], batch)
    by = {r["kernel"]: r for r in chunked_rows}
    assert by["chunk stats"]["hbm_bytes_per_entry"] == 4 and by["chunk grad"]["hbm_bytes_per_entry"] == 6
    assert by["chunk siglip"]["hbm_bytes_per_entry"] == 6  # S read in float32, dS written in bf16
    assert by["chunk grad"]["bar_per_tile"] == 0  # no cross-warp reduction in the backward's tile loop
    # the SigLIP pass runs the grad pass's grid (its tile and splits): the same programs at every B
    for batch in static.BATCHES:
        assert by["chunk siglip"][f"programs@{batch}"] == by["chunk grad"][f"programs@{batch}"], batch


def test_stored_chunked_report_feeds_the_model():
    rows = static.read_rows(static.DEFAULT_OUT / "static-chunked.csv")
    assert {r["kernel"] for r in rows if r["target"] == "sm_90"} == CHUNKED_PASSES
    for r in rows:
        assert r["instr_per_entry_no_pos"] not in ("", None) or r["target"] != "sm_90", r
