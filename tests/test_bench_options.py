"""Smoke test of ``python -m bench.options``: one row per option with both times and their ratio, in the CSV
too (no timing assertions)."""

import csv

from bench.options import main


def test_bench_options_rows(tmp_path, capsys):
    out = tmp_path / "options.csv"
    argv = ["--batch", "32", "--dim", "8", "--repeats", "1", "--threads", "1", "--backend", "torch"]
    assert main(argv + ["--csv", str(out)]) == 0
    assert "ratio" in capsys.readouterr().out
    with open(out, newline="") as f:
        rows = {r["option"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"smoothing", "smoothing, ids", 'smoothing, ids "sum"', "siglip ids"}
    for row in rows.values():
        without, with_, ratio = float(row["without_s"]), float(row["with_s"]), float(row["ratio"])
        assert without > 0 and with_ > 0 and abs(ratio - with_ / without) <= 1e-2 * ratio
