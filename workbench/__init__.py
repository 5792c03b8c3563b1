"""Paged KV-cache workbench: blocks, block tables, layouts, kernels and their analysis.

Importing the package first fixes the execution backend (``workbench.backend``), so the
Triton kernels in ``workbench.kernels`` run compiled on a GPU and interpreted on a CPU.
"""

from . import backend  # noqa: F401  (must run before any kernel module is imported)
from .backend import device, is_interpreted

__all__ = ["backend", "device", "is_interpreted"]
__version__ = "0.1.0"
