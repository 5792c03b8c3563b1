"""A K/V store for :class:`~workbench.model.runner.Runner` that attends with Quest: once a sequence holds more
pages than a budget, each decode step reads only the pages its query scores highest by their key bounds
(:class:`~workbench.compress.quest_decode.QuestDecode`); shorter batches attend in full, as
:class:`~workbench.model.kv.PagedKV` does.

    cache = PagedKVCache(..., key_bounds=True)
    kv = QuestKV(cache, page_budget=128)          # 128 pages of 16 tokens: 2048 tokens a step at most
    out = Runner(model, kv).generate([long_prompt], max_new_tokens=64)
    kv.paths                                      # Counter: (step, layer)s attended by "quest" / "plain" / "shared"

Nothing is evicted: every page stays in the cache (and a later step may pick it again); Quest only decides what a
step reads. The selection is planned once per step (every layer reuses the batch's tables) and each layer scores
its own key bounds, which ``DecodeStep.write`` keeps current for the block each sequence writes.
"""

from __future__ import annotations

from workbench.compress.page_selection import check_page_budget
from workbench.compress.quest_decode import DECODE_REDUCES, QuestDecode
from workbench.model.kv import PagedKV


class QuestKV(PagedKV):
    """:class:`~workbench.model.kv.PagedKV` with Quest page selection for long sequences (module docstring).

    Args:
        cache: a :class:`~workbench.cache.PagedKVCache` built with ``key_bounds=True``.
        page_budget: pages a sequence attends per step once it holds more (forced pages included).
        reduce, keep_first, keep_last: :class:`QuestDecode`'s.
        q_dtype, shared_prefix, timing: :class:`PagedKV`'s (the cascade serves steps whose batch fits the budget).
    """

    name = "quest"

    def __init__(self, cache, page_budget: int, *, reduce: str = "sum", keep_first: int = 1, keep_last: int = 1,
                 q_dtype=None, shared_prefix: str = "off", timing: str = "eager"):
        check_page_budget(page_budget, keep_first, keep_last)
        if reduce not in DECODE_REDUCES:
            raise ValueError(f"reduce must be one of {DECODE_REDUCES}, got {reduce!r}")
        if getattr(cache, "k_bounds", None) is None:
            raise ValueError("cache must be a PagedKVCache built with key_bounds=True (Quest reads its key bounds)")
        super().__init__(cache, q_dtype, shared_prefix=shared_prefix, timing=timing)
        self.page_budget, self.reduce, self.keep_first, self.keep_last = page_budget, reduce, keep_first, keep_last
        self._step = self._quest = None  # the step the selection was planned for, and its QuestDecode

    def attend(self, step, layer: int, q, k, v, sm_scale: float):
        if -(-step.max_seq_len // step.block_size) <= self.page_budget:  # every sequence fits: read it all
            return super().attend(step, layer, q, k, v, sm_scale)
        step.write(layer, k, v)
        if self._step is not step:
            self._step, self._quest = step, QuestDecode(self.cache, step.seq_ids, self.page_budget,
                                                        reduce=self.reduce, keep_first=self.keep_first,
                                                        keep_last=self.keep_last, sm_scale=sm_scale)
        self.paths["quest"] += 1
        return self._quest.run(q.to(self.q_dtype), layer).to(q.dtype)

    def commit(self, step) -> None:
        self._step = self._quest = None
        super().commit(step)

    def abort(self, step) -> None:
        self._step = self._quest = None
        super().abort(step)
