"""bench/st_loss.py runs every option (a tiny batch: the script's paths, not its timings)."""

import pytest

pytest.importorskip("sentence_transformers")

from bench import st_loss  # noqa: E402


def test_every_option_runs(capsys, tmp_path):
    st_loss.main(
        ["--batch", "12", "--dim", "8", "--repeats", "1", "--backend", "torch", "--csv", str(tmp_path / "st.csv")]
    )
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + len(st_loss.OPTIONS)
    assert (tmp_path / "st.csv").read_text().count("\n") == 1 + len(st_loss.OPTIONS)
