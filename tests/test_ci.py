"""CI runs README's Set up block verbatim (.ci/run through .ci/readme_commands.py): the block it reads is the
install with the CPU torch pin, then the test command."""

import re
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


def _floor_triton() -> str:
    text = (ROOT / ".ci" / "check_floor").read_text()
    return re.search(r"^FLOOR_TRITON=(\S+)$", text, re.MULTILINE).group(1)


def test_ci_compiles_the_kernels_under_the_floor_triton():
    """.ci/run runs .ci/check_floor, whose Triton is the floor infcl declares (infcl/versions.py, setup.py)."""
    from infcl.versions import TRITON_FLOOR, floor_text, release

    run = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash .ci/check_floor" in run
    assert release(_floor_triton()) == TRITON_FLOOR
    assert f"triton>={floor_text(TRITON_FLOOR)};" in (ROOT / "setup.py").read_text()


def test_the_floor_check_selects_the_floor_subset_test():
    """``-k floor`` on the compile gate collects exactly the floor subset's test (nothing of the full matrix)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_triton_api_compile.py", "-k", "floor", "--collect-only", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    tests = [line for line in result.stdout.splitlines() if "::" in line]
    assert tests == ["tests/test_triton_api_compile.py::test_floor_subset_compiles_every_kernel_family"], result.stdout
