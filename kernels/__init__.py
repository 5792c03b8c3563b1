"""Triton kernels of the workbench, imported as ``workbench.kernels``.

Arranged by op (as flash-linear-attention's ``fla/ops/<op>/``): ``decode/`` and ``write/`` are folders
(kernel, launch config, wrapper), ``gather.py`` and ``copy.py`` single files (kernel and wrapper);
``quest.py`` the Quest page-selection kernels (key bounds, page scores, compacted table), ``common.py`` holds the
shared helpers, ``validate.py`` the block-table check, ``tuning/`` the measured
launch tables per GPU, and ``reference.py`` a plain PyTorch version of every kernel, which the tests
compare against on random data.
"""

import workbench  # noqa: F401  (chooses compiled vs interpreted before any kernel is decorated)

from .copy import copy_blocks
from .decode import CascadePlan, DecodePlan, decode_config, merge_state, merge_states, paged_decode
from .gather import paged_gather
from .quest import key_bounds, quest_page_scores, quest_select
from .swap import move_blocks
from .write import check_write_kv, write_kv

__all__ = ["CascadePlan", "DecodePlan", "check_write_kv", "copy_blocks", "decode_config", "key_bounds", "merge_state", "merge_states",
           "move_blocks", "paged_decode", "paged_gather", "quest_page_scores", "quest_select", "write_kv"]
