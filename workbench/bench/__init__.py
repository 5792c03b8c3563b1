"""Benchmarks: one module per benchmark, each with ``main(argv)`` run by
``python -m workbench bench <name>``; ``harness`` holds timing, bandwidth and metadata,
``workloads`` the decode workloads W1-W5, ``results`` the loaders the notebooks plot from."""

# The modules `python -m workbench bench NAME` runs (the others are helpers).
BENCHMARKS = ("allocator", "cache_kernels", "decode", "results")
