"""The compile-only driver (tests/helpers/triton_compile.py, shared with the API compile check): a stand-in
driver names the target and every launch compiles instead of running."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
from helpers import triton_compile  # noqa: E402

__all__ = ["triton_compile"]
