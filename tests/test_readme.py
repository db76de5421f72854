"""README.md is a front door: at most 150 lines, no line over 160 characters outside code blocks and tables, no
table cell over 200 characters, every headline result with its command and date, and every relative link
pointing at a file of the checkout. The details live in docs/ (docs/api.md, docs/benchmarks.md)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES, MAX_PROSE_LINE, MAX_CELL = 150, 160, 200


def _lines():
    return README.read_text(encoding="utf-8").splitlines()


def _outside_code(lines):
    """(number, line) of every line outside ``` blocks."""
    inside = False
    for number, line in enumerate(lines, 1):
        if line.strip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            yield number, line


def _cells(line: str):
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_readme_is_at_most_150_lines():
    assert len(_lines()) <= MAX_LINES, len(_lines())


def test_no_prose_line_over_160_characters():
    long = [(n, len(line)) for n, line in _outside_code(_lines()) if not line.startswith("|") and len(line) > 160]
    assert not long, long


def test_no_table_cell_over_200_characters():
    wide = [
        (n, len(cell), cell[:60])
        for n, line in _outside_code(_lines())
        if line.startswith("|")
        for cell in _cells(line)
        if len(cell) > MAX_CELL
    ]
    assert not wide, wide


def test_every_headline_result_names_its_command_and_date():
    lines = _lines()
    start = lines.index("## Headline results")
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append(_cells(line))
    header, body = rows[0], rows[1:]
    assert header == ["where", "date", "command", "result"], header
    assert len(body) >= 2 and any("GPU" in row[0] for row in body) and any("CPU" in row[0] for row in body)
    for row in body:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[1]), row
        assert "`python -m bench" in row[2] or row[2].startswith("the same"), row
        assert row[3], row


def test_relative_links_point_at_files():
    text = README.read_text(encoding="utf-8")
    missing = [
        target
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
        if "://" not in target and not (ROOT / target).exists()
    ]
    assert not missing, missing


def test_a_marked_spot_for_new_features():
    """New features add one line each above this marker (in the list of the package's pages)."""
    lines = _lines()
    marker = [n for n, line in enumerate(lines) if line.startswith("<!-- New features:")]
    assert len(marker) == 1
    assert lines[marker[0] - 1].startswith("- [docs/"), lines[marker[0] - 1]
