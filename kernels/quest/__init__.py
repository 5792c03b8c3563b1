"""Quest page selection: the kernels and their plan in ``select.py``, the plain PyTorch references in
``reference.py``."""

from .select import QuestPlan, key_bounds, quest_page_scores, quest_select

__all__ = ["QuestPlan", "key_bounds", "quest_page_scores", "quest_select"]
