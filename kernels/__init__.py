"""Triton kernels of the workbench, imported as ``workbench.kernels``.

Each kernel module holds the ``@triton.jit`` kernel and a Python wrapper that checks its
arguments; ``reference.py`` holds a plain PyTorch version of every kernel, which the
tests compare against on random data.
"""

import workbench  # noqa: F401  (chooses compiled vs interpreted before any kernel is decorated)

from .copy import copy_blocks
from .decode import DecodePlan, decode_config, merge_state, merge_states, paged_decode
from .gather import paged_gather
from .write import check_write_kv, write_kv

__all__ = ["DecodePlan", "check_write_kv", "copy_blocks", "decode_config", "merge_state", "merge_states",
           "paged_decode", "paged_gather", "write_kv"]
