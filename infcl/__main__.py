"""``python -m infcl``: what infcl can run here. ``python -m infcl build``: compile the native CPU kernel now.

The report names the infcl, Python, torch and Triton versions, the devices, and for each backend whether it
runs on each device here and, if not, why (the sentences of :func:`infcl.backends.unavailable_reason`), and
where the native build is cached. It never compiles: without a cached build it says "not built yet".
"""

import argparse
import os
import platform
import sys
import warnings
from importlib import metadata
from typing import List, Optional

import torch

import infcl
from infcl.backends import BACKENDS, unavailable_reason
from infcl.backends.native import build as native_build
from infcl.versions import requirements

NOT_BUILT = (
    "not built yet: `python -m infcl build` compiles it once per machine and version of the sources "
    f"({native_build.BUILD_TIME_HINT}), else the first CPU call does"
)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> List[torch.device]:
    """The CPU, and the first CUDA device when there is one (every CUDA device gives the same answers)."""
    return [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])


def _device_names() -> str:
    names = [f"cpu ({torch.get_num_threads()} threads)"]
    names += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    return ", ".join(names)


def _availability(backend: str, device: torch.device) -> str:
    """'available', or why not; for the native kernel on the CPU without a cached build, 'not built yet'
    instead of building it (asking unavailable_reason would compile it)."""
    if backend == "cpu" and device.type == "cpu" and native_build.disabled_reason() is None:
        try:
            built = native_build.built_library().is_file()
        except FileNotFoundError:
            built = True  # no sources: unavailable_reason says so at once, with nothing to compile
        if not built:
            return NOT_BUILT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a failed load warns; the reason is printed anyway
        why = unavailable_reason(backend, device)
    return "available" if why is None else f"unavailable: {why}"


def _native_cache() -> List[str]:
    try:
        sources = native_build.source_files()
    except FileNotFoundError as err:
        return [f"  sources: none found ({err})"]
    library = native_build.built_library(native_build.extension_name(sources))
    state = "built" if library.is_file() else "not built yet"
    return [
        f"  sources: {sources[0].parent} ({', '.join(p.name for p in sources)})",
        f"  cache:   {library.parent} ({state})",
    ]


def report() -> str:
    lines = [
        f"infcl {infcl.__version__} ({os.path.dirname(infcl.__file__)})",
        f"Python {platform.python_version()}, torch {torch.__version__}, Triton {_version('triton')}",
        f"infcl needs {requirements()}",
        f"devices: {_device_names()}",
        "backends:",
    ]
    for backend in BACKENDS[1:]:  # every concrete backend; "auto" only picks one of them
        for device in _devices():
            lines.append(f"  {backend:<10} on {device.type + ':':<6} {_availability(backend, device)}")
    lines.append("native CPU kernel:")
    lines += _native_cache()
    return "\n".join(lines)


def build() -> int:
    """Build (or load the cached build of) the native kernel; 0 when it is ready, else 1 with the reason on stderr."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the reason is printed below instead
        why = native_build.load_error()
    if why is not None:
        print(f"infcl: {why}", file=sys.stderr)
        return 1
    print(f"native CPU kernel ready: {native_build.built_library()}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infcl", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("report", help="versions, devices, and which backends run here (the default)")
    commands.add_parser("build", help="compile the native CPU kernel now (once per machine and version of the sources)")
    args = parser.parse_args(argv)
    if args.command == "build":
        return build()
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
