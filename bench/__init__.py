"""infcl's benchmark suite: ``python -m bench`` (see docs/benchmarks.md).

Modules: ``methods`` (the providers compared), ``measure`` (timing and peak memory), ``gemm`` (this
machine's matmul rate and the GEMM bound), ``worker`` (one configuration in its own process),
``presets`` (the embedded sweeps), ``report`` (table, CSV, plot), ``tile_sizes`` (torch-tiles tile scan).
"""
