"""The static performance report (bench/static.py) on sm_90 bf16 D = 512, compile-only, and what in it is
structural: every kernel of both losses compiled and its tile loop found; S on wgmma; no mma.sync in a
kernel whose products all have M >= 64 (wgmma's smallest M); no spills; shared memory within the limit.
The figures (instructions, MUFU and shuffles per S entry, CTAs per SM, waves, flop/byte) are reported
(``pytest -s`` prints the table), never asserted.

The listing reader and the occupancy model are also checked on small hand-made inputs.
"""

import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from bench import static  # noqa: E402

# wgmma's M is 64 per warpgroup: a product with fewer rows has to use mma.sync.
WGMMA_M = 64
KERNELS = {"forward", "dq", "dk", "siglip_forward", "siglip_backward"}


@pytest.fixture(scope="module")
def rows():
    out = static.run(targets=(90,), workers=1)
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
--:-:-:-:1\t@P2 BRA LBB0;
--:-:-:-:1\tMUFU.LG2 R8, R8;
--:-:-:-:1\tEXIT;
"""


def test_tile_loop_counts_weights_the_chunk_loop():
    # Tile loop: 1 HGMMA + [inner: 3 instructions] x (4 - 1) trips + 2 MUFU + 1 SHFL + 1 BRA.
    counts = static.tile_loop_counts(LISTING, static.SASS, n_chunks=4)
    assert counts == {"static": 8, "instr": 1 + 3 * 3 + 4, "mufu": 2, "ex2": 2, "shfl": 1}
    assert static.tile_loop_counts(LISTING.replace("MUFU.EX2", "FMUL"), static.SASS, 4) is None


def test_mma_kinds_reads_ptx_and_sass():
    ptx = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {...};\nmma.sync.aligned.m16n8k16.row.col.f32.bf16"
    kinds = static.mma_kinds(ptx, LISTING)
    assert kinds["mma_sync"] == 1 and kinds["async_mma"] == 1
    assert kinds["mma_ptx"] == "mma.sync.m16n8k16:1 wgmma.m64n64k16:1"
    assert kinds["mma_sass"] == "HGMMA.64x64x16:2"


@pytest.mark.parametrize("regs, warps, smem, expected", [
    (128, 8, 0, (2, "regs")),  # 128 x 256 threads = 32768 registers: two CTAs in 65536
    (168, 4, 0, (3, "regs")),  # 168 x 32 = 5376 per warp: 12 warps fit, 3 CTAs of 4
    (32, 4, 100 * 1024, (2, "smem")),  # 101 KiB per CTA with the reserved KiB: two in 228 KiB
    (16, 4, 0, (16, "warps")),  # 16 registers: 128 warps' worth, but 64 warps per SM
    (16, 1, 0, (32, "ctas")),
])
def test_occupancy(regs, warps, smem, expected):
    assert static.occupancy(regs, warps, smem, 90) == expected


def test_parse_tile():
    assert static.parse_tile("dk=64x64:8:3:256") == ("dk", (64, 64, 8, 3, 256))
    assert static.parse_tile("siglip=128x32") == ("siglip", (128, 32))
    for bad in ("dk=64", "attention=64x64", "dq=64x64:8:3:256:1"):
        with pytest.raises(ValueError, match="--tile"):
            static.parse_tile(bad)
