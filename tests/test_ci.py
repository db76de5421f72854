"""CI runs README's Set up block verbatim (.ci/run through .ci/readme_commands.py): the block it reads is the
install with the CPU torch pin, then the test command."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str, heading: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_commands.py"), "-", heading],
        input=text,
        capture_output=True,
        text=True,
    )


def test_readme_set_up_is_the_pinned_install_then_the_test_command():
    lines = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "readme_commands.py"), str(ROOT / "README.md"), "Set up"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(lines) == 2, lines
    assert "torch==2.13.0" in lines[0] and '-e ".[dev]"' in lines[0], lines[0]
    assert lines[1].startswith("python -m pytest tests"), lines[1]


@pytest.mark.parametrize(
    "text, why",
    (("# Set up\n\nno code here\n# Next\n```bash\nrm -rf /\n```\n", "no ```bash block"), ("# Other\n", "no heading")),
)
def test_a_missing_block_stops_ci(text, why):
    result = _commands(text, "Set up")
    assert result.returncode != 0 and why in result.stderr, result
