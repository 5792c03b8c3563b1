"""Benchmarks: one module per benchmark, each with ``main(argv)`` run by
``python -m workbench bench <name>``; ``harness`` holds timing, bandwidth and metadata."""
