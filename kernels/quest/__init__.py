"""Quest page selection (Tang et al. 2024): per-block key bounds, page scores, and the compacted block table.

Quest keeps, per page (block) and kv head, the elementwise min and max of the page's keys; for a query ``q`` the
score ``sum_i max(q_i * min_i, q_i * max_i)`` bounds ``q . k`` for every key of the page, and decode attends only
to the top-k pages. One module per kernel, their PyTorch references beside them:

- ``bounds.py``: :func:`key_bounds`, the bounds ``[num_blocks, Hkv, 2, D]`` (fp16) of the blocks a write touched,
  from the keys as stored (any layout, dequantized as the decode kernel reads them);
- ``scores.py``: :func:`quest_page_scores`, the score of every page of every sequence (two tensor-core dots);
- ``api.py``: :func:`quest_select`, the top ``page_budget`` pages of every sequence and the compacted table, in
  one launch with no host sync, from the kernel ``split_select`` (the rule) picks:
- ``select.py``: one program a sequence (a radix search and a prefix sum);
- ``select_split.py``: the same table from a kernel that spreads each row over many programs (two row histograms
  by atomics, then the row's last program finishes), for a few long rows;
- ``plan.py``: :class:`QuestPlan`, scores and selection planned once per decode step and run per layer (FlashInfer's
  plan / run);
- ``reference.py``: ``key_bounds_ref``, ``quest_page_scores_ref`` (the selection's reference is
  ``workbench.compress.page_selection.select_pages``, the same table bit for bit).

Index arithmetic is int64 (pools beyond 2**31 elements).
"""

from .api import quest_select
from .bounds import key_bounds
from .plan import QuestPlan
from .scores import quest_page_scores

__all__ = ["QuestPlan", "key_bounds", "quest_page_scores", "quest_select"]
