"""Paged KV-cache workbench: blocks, block tables, layouts, kernels and their analysis.

Importing the package first fixes the execution backend (``workbench.core.backend``), so the
Triton kernels in ``workbench.kernels`` run compiled on a GPU and interpreted on a CPU.
"""

import importlib.util
import sys
from pathlib import Path

from .core.backend import device, is_interpreted  # runs the backend's choice before any kernel module is imported

__all__ = ["device", "is_interpreted"]
__version__ = "0.1.0"


class _CheckoutKernels:
    """In a source checkout ``kernels/`` sits beside ``workbench/`` and is imported as
    ``workbench.kernels``. An install maps it (pyproject's package-dir); this finder, asked
    last, covers a bare checkout on ``sys.path`` (``PYTHONPATH=.``, or an editable install
    that only adds the folder, as older setuptools do)."""

    folder = Path(__file__).resolve().parent.parent / "kernels"

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "workbench.kernels" or not (cls.folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            name, cls.folder / "__init__.py", submodule_search_locations=[str(cls.folder)]
        )


if _CheckoutKernels not in sys.meta_path:
    sys.meta_path.append(_CheckoutKernels)
