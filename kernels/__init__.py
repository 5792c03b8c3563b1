"""Triton kernels of the workbench, imported as ``workbench.kernels``.

One folder per op, each with its plain PyTorch reference beside the kernel (as flash-linear-attention's
``fla/ops/<op>/`` keeps ``naive.py``), which the tests compare against on random data:

- ``decode/``: paged decode attention (kernels, launch config, ``DecodePlan``, merge of states, the shared-prefix
  ``CascadePlan``, ``paged_decode``) and ``reference.py``;
- ``write/``: write-to-cache, quantizing on write per storage family (``write_kv``) and ``reference.py`` (with the
  values a cache's blocks hold, which the decode and Quest references read);
- ``gather/``, ``copy/``, ``swap/``: the paged gather, the block copy (copy-on-write, compaction) and the block moves
  between block spaces (the tiers), each ``kernel.py`` (kernel and wrapper) and ``reference.py``;
- ``quest/``: Quest page selection (key bounds, page scores, the compacted table, ``QuestPlan``) and ``reference.py``.

Shared by the ops: ``common.py`` (helpers), ``validate.py`` (the block-table check), ``tuning/`` (the measured
launch tables per GPU).
"""

import workbench  # (chooses compiled vs interpreted before any kernel is decorated)
from workbench.core import interpreter

from .copy import copy_blocks
from .decode import CascadePlan, DecodePlan, decode_config, merge_state, merge_states, paged_decode
from .gather import paged_gather
from .quest import key_bounds, quest_page_scores, quest_select
from .swap import move_blocks
from .write import check_write_kv, write_kv

if workbench.is_interpreted():
    interpreter.install()  # triton.language patched once a launch, not once a helper call (a third of the time)

__all__ = ["CascadePlan", "DecodePlan", "check_write_kv", "copy_blocks", "decode_config", "key_bounds", "merge_state", "merge_states",
           "move_blocks", "paged_decode", "paged_gather", "quest_page_scores", "quest_select", "write_kv"]
