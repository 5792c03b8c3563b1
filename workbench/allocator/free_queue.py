"""The free blocks of one size class, in the order they are handed out (and their cache entries evicted).

A :class:`FreeBlockQueue` is an ``OrderedDict`` of block ids (values unused), so every operation is
O(1): pop the head, push at either end, remove from the middle (a prefix hit takes a cached free
block back). Only :class:`~workbench.allocator.pool.BlockPool` changes it; everything else reads.

The order, head first (vLLM's ``FreeKVCacheBlockQueue`` keeps the same one):

1. A freshly carved page's blocks go to the **head**, in ascending id order: clean memory is
   handed out before any cached block is evicted.
2. A block whose last user frees it goes to the **tail**: the least recently used block is reused
   first. A sequence frees its blocks last-to-first, so its shared prefix sits behind its tail and
   is evicted last.
3. Allocation pops the **head**. A cached block found there is kept (moved back to the head) while
   an uncarved page can be carved instead; only when memory is full is its cache entry evicted.
4. Compaction's moves keep a moved cached block's place (the destination takes it), and freed
   sources join the tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator


class FreeBlockQueue(OrderedDict):
    """Block ids, head (next to be handed out) first. See the module docstring for the order.

    The hot paths of the pool use the inherited ``OrderedDict`` operations directly
    (``popitem(last=False)``, ``q[bid] = None``, ``del q[bid]``): these names are the same operations.
    """

    __slots__ = ()

    def pop_head(self) -> int:
        return self.popitem(last=False)[0]

    def push_tail(self, block_id: int) -> None:
        self[block_id] = None

    def push_head(self, block_id: int) -> None:
        self[block_id] = None
        self.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        del self[block_id]

    def head_first(self) -> Iterator[int]:
        return iter(self)

    def reordered(self, ids: Iterable[int]) -> FreeBlockQueue:
        """A queue holding ``ids`` in this order (compaction rebuilds the order after renames)."""
        return FreeBlockQueue.fromkeys(ids)
