from setuptools import find_packages, setup

# torch is a range that 2.13.0 satisfies: install `torch==2.13.0` first (or in the same pip command)
# so pip never reaches for a newer, multi-GB CUDA build. The native CPU kernel in csrc/ is compiled
# just-in-time on first use (torch.utils.cpp_extension + ninja) and cached, so installing needs no
# compiler and no torch inside pip's build isolation.
setup(
    name="infcl",
    version="0.1.0",
    description="Exact contrastive (InfoNCE / CLIP) losses with memory linear in the batch: tiled kernels and a ring over ranks",
    packages=find_packages(include=["infcl", "infcl.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.1,<=2.13.0",
        "numpy",
        "ninja",
        'triton>=3.0; platform_system == "Linux" and platform_machine == "x86_64"',
    ],
    extras_require={
        "dev": ["pytest>=7", "hypothesis>=6", "pytest-benchmark>=4", "matplotlib>=3.5", "tqdm>=4"],
    },
)
