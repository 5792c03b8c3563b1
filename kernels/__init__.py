"""Triton kernels of the workbench, imported as ``workbench.kernels``.

Each kernel module holds the ``@triton.jit`` kernel and a Python wrapper that checks its
arguments; ``reference.py`` holds a plain PyTorch version of every kernel, which the
tests compare against on random data.
"""

import workbench  # noqa: F401  (chooses compiled vs interpreted before any kernel is decorated)

from .gather import paged_gather

__all__ = ["paged_gather"]
