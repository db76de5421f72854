"""Packaging: the version, ``python -m infcl``, INFCL_NATIVE=0, what a wheel and an sdist carry, and the native
build's cache key and messages.

The build itself is faked here (a real one takes minutes); .ci/run builds a real wheel, installs it into a fresh
virtual environment and compiles the kernel from the installed copy.
"""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import warnings
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import torch

import infcl
from infcl.backends import BACKENDS, resolve_backend, unavailable_reason
from infcl.backends.native import build as native_build

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
# What a wheel or sdist is built from (the rest of the checkout, tests included, is not part of the package).
PACKAGE_FILES = ("setup.py", "pyproject.toml", "README.md", "csrc", "infcl")
# Setuptools builds wheels by itself from 70.1 on; older ones need the `wheel` package.
SETUPTOOLS_WITH_BDIST_WHEEL = (70, 1)


def _python(args, tmp_path, **env):
    """Run ``python <args>`` on this checkout's infcl, from a directory outside it, with extra environment."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=300
    )


def test_version_comes_from_the_package_metadata():
    try:
        expected = metadata.version("infcl")
    except metadata.PackageNotFoundError:
        expected = "0+unknown"  # a plain source checkout, never installed
    assert infcl.__version__ == expected


def test_import_does_not_import_optional_packages(tmp_path):
    """triton and the integrations' libraries are extras: importing infcl must not need (or load) them."""
    optional = ("triton", "sentence_transformers", "open_clip", "transformers")
    code = f"import sys, infcl; print([m for m in {optional!r} if m in sys.modules])"
    result = _python(["-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_report_names_every_backend_and_compiles_nothing(tmp_path):
    extensions = tmp_path / "extensions"
    result = _python(["-m", "infcl"], tmp_path, TORCH_EXTENSIONS_DIR=str(extensions), INFCL_NATIVE="1")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"infcl {infcl.__version__}" in out
    assert f"torch {torch.__version__}" in out and "Triton" in out and "Python" in out
    assert "infcl needs torch >= 2.8, Triton >= 3.4 for backend 'triton'" in out
    assert "devices: cpu" in out
    for backend in BACKENDS[1:]:
        assert re.search(rf"^  {backend} +on cpu: +\S", out, re.MULTILINE), f"no line for backend {backend!r}:\n{out}"
    cpu_line = re.search(r"^  cpu +on cpu: +(.*)$", out, re.MULTILINE).group(1)
    assert cpu_line.startswith("not built yet") and "python -m infcl build" in cpu_line
    assert f"cache:   {extensions / native_build.extension_name()} (not built yet)" in out
    assert not extensions.exists()  # reporting created no build folder, let alone compiled
    assert "building" not in result.stderr


def test_infcl_native_0_turns_the_native_backend_off(monkeypatch):
    monkeypatch.setenv(native_build.DISABLE_VAR, "0")
    monkeypatch.delenv("INFCL_BACKEND", raising=False)
    native_build.load_error.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # turning it off is a choice: no warning
            why = unavailable_reason("cpu", CPU)
            assert why is not None and "INFCL_NATIVE=0" in why
            assert resolve_backend("auto", CPU) == "torch"
            with pytest.raises(RuntimeError, match="INFCL_NATIVE=0"):
                resolve_backend("cpu", CPU)
    finally:
        native_build.load_error.cache_clear()  # the next caller loads the real build again


def test_build_command_fails_with_the_reason(tmp_path):
    result = _python(["-m", "infcl", "build"], tmp_path, INFCL_NATIVE="0")
    assert result.returncode == 1
    assert "turned off (INFCL_NATIVE=0)" in result.stderr
    report = _python(["-m", "infcl"], tmp_path, INFCL_NATIVE="0")
    assert re.search(r"^  cpu +on cpu: +unavailable: .*INFCL_NATIVE=0", report.stdout, re.MULTILINE), report.stdout


def _package_copy(tmp_path) -> Path:
    """The files a build reads, copied, so the checkout gets no build/ or egg-info from this test."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    source.mkdir()
    for name in PACKAGE_FILES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    return source


def test_wheel_and_sdist_carry_the_native_sources(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    version = tuple(int(part) for part in re.findall(r"\d+", setuptools.__version__)[:2])
    if version < SETUPTOOLS_WITH_BDIST_WHEEL:
        pytest.importorskip("wheel", reason=f"setuptools {setuptools.__version__} needs the wheel package to build one")
    source = _package_copy(tmp_path)
    dist = tmp_path / "dist"
    # No build isolation: the installed setuptools builds it, offline and in seconds.
    wheel_build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wheel_build.returncode == 0, wheel_build.stdout + wheel_build.stderr
    sdist_build = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(dist)!r})"],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sdist_build.returncode == 0, sdist_build.stdout + sdist_build.stderr

    cpp = sorted(p.name for p in (REPO / "csrc").glob(native_build.SOURCE_GLOB))
    assert cpp, "no C++ sources in csrc/"
    # The headers the sources include ship beside them (csrc/common.h).
    cpp += sorted(p.name for pattern in native_build.HEADER_GLOBS for p in (REPO / "csrc").glob(pattern))
    (wheel,) = dist.glob("infcl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        wheel_metadata = archive.read(metadata_name).decode()
    for name in cpp:
        assert f"infcl/_csrc/{name}" in names
    assert {"infcl/__main__.py", "infcl/backends/native/build.py"} <= names
    assert not any(n.startswith("csrc/") for n in names)  # inside the package, not a top-level folder
    requires = re.findall(r"^Requires-Dist: (.*)$", wheel_metadata, re.MULTILINE)
    assert "torch>=2.8" in requires  # no upper bound
    assert all('extra == "' in r for r in requires if r.startswith("triton"))  # only through extras
    for extra in ("triton", "sentence-transformers", "open-clip", "dev"):
        assert f"Provides-Extra: {extra}" in wheel_metadata

    (sdist,) = dist.glob("infcl-*.tar.gz")
    with tarfile.open(sdist) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"pyproject.toml", "setup.py"} | {f"csrc/{name}" for name in cpp} <= members


def test_sources_in_the_package_come_before_the_checkout(tmp_path, monkeypatch):
    packaged, checkout = tmp_path / "_csrc", tmp_path / "csrc"
    for folder in (packaged, checkout):
        folder.mkdir()
        (folder / "kernel.cpp").write_text("// kernel\n")
    monkeypatch.setattr(native_build, "SOURCE_DIRS", (packaged, checkout))
    assert native_build.sources_dir() == packaged
    (packaged / "kernel.cpp").unlink()
    assert native_build.sources_dir() == checkout
    (checkout / "kernel.cpp").unlink()
    with pytest.raises(FileNotFoundError, match="reinstall infcl"):
        native_build.sources_dir()


def test_build_key_follows_the_sources(tmp_path):
    """Every *.cpp is compiled, and the extension's name (its cache key) changes with any source or header."""
    (tmp_path / "infcl_cpu.cpp").write_text("int forward();\n")
    names = [native_build.extension_name(native_build.source_files(tmp_path))]
    assert names[0] == native_build.extension_name(native_build.source_files(tmp_path))  # stable
    assert names[0].startswith(f"{native_build.EXTENSION_PREFIX}_{native_build._cpu_fingerprint()}_")

    (tmp_path / "infcl_cpu.cpp").write_text("int forward(int);\n")
    names.append(native_build.extension_name(native_build.source_files(tmp_path)))
    (tmp_path / "sigmoid.cpp").write_text("int sigmoid();\n")  # a second kernel file is found and compiled
    assert [p.name for p in native_build.source_files(tmp_path)] == ["infcl_cpu.cpp", "sigmoid.cpp"]
    names.append(native_build.extension_name(native_build.source_files(tmp_path)))
    (tmp_path / "tiles.h").write_text("#pragma once\n")
    names.append(native_build.extension_name(native_build.source_files(tmp_path)))
    assert len(set(names)) == len(names), names


def test_build_announces_itself_and_a_cached_load_is_silent(tmp_path, monkeypatch, capsys):
    """A build prints one line when it starts (what, where) and one when it ends (seconds), whatever the
    warning filters; loading the cached build prints nothing and compiles nothing."""
    from torch.utils import cpp_extension

    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "infcl_cpu.cpp").write_text("// kernel\n")
    monkeypatch.setattr(native_build, "SOURCE_DIRS", (sources,))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    builds, loads = [], []

    def fake_build(name, sources, build_directory, **kwargs):
        builds.append(sources)
        Path(build_directory, f"{name}{cpp_extension.LIB_EXT}").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_build)
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    library = native_build.built_library()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        native_build._build_and_load()
    start, end = capsys.readouterr().err.splitlines()
    assert builds == [[str(sources / "infcl_cpu.cpp")]]
    assert start.startswith("infcl: building the native CPU kernel") and str(library.parent) in start
    assert "once per machine" in start and str(sources) in start
    assert re.match(r"infcl: built the native CPU kernel in \d+ s", end)

    native_build._build_and_load()
    assert capsys.readouterr().err == ""
    assert len(builds) == 1 and loads == [str(library)]

    library.unlink()

    def broken_build(**kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", broken_build)
    with pytest.raises(RuntimeError, match="no compiler"):
        native_build._build_and_load()
    assert re.search(r"building the native CPU kernel failed after \d+ s", capsys.readouterr().err)


def test_an_older_torch_fails_at_import_naming_the_floor(tmp_path):
    """``import infcl`` under a torch older than 2.8 raises one ImportError naming the floor (torch's own
    version string is replaced before infcl is imported: the check reads it, nothing else runs first)."""
    code = "import torch; torch.__version__ = '2.7.1+cu126'; import infcl"
    result = _python(["-c", code], tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last == "ImportError: infcl needs torch >= 2.8 (found 2.7.1+cu126): pip install 'torch>=2.8'", last


@pytest.mark.parametrize(
    "version, old",
    [("2.8.0", False), ("2.8.0a0+git1234", False), ("2.10.1+cu128", False), ("3.0.0", False), ("2.7.1", True)],
)
def test_torch_floor_reads_major_and_minor(version, old):
    from infcl.versions import TORCH_FLOOR, too_old

    assert (too_old("torch", version, TORCH_FLOOR) is not None) == old


def test_an_older_triton_makes_the_triton_backend_unavailable_naming_the_floor(tmp_path):
    """Triton 3.3 (its version string replaced before infcl looks): backend 'triton' says why it cannot run, and
    the floor; the other backends are untouched."""
    code = (
        "import triton; triton.__version__ = '3.3.1'; import torch\n"
        "from infcl.backends import unavailable_reason\n"
        "print(unavailable_reason('triton', torch.device('cuda')))\n"
        "print(unavailable_reason('torch', torch.device('cpu')))"
    )
    result = _python(["-c", code], tmp_path, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr
    triton_line, torch_line = result.stdout.strip().splitlines()
    assert "infcl needs Triton >= 3.4 (found 3.3.1)" in triton_line, triton_line
    assert torch_line == "None"


def test_setup_declares_the_floor():
    setup = (REPO / "setup.py").read_text()
    assert '"torch>=2.8"' in setup and "triton>=3.4;" in setup
