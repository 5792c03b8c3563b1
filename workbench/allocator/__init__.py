"""Block pool and block tables: where every token's K/V lives, who shares it, what can be reused.

- :mod:`~workbench.allocator.pool`: physical pages carved into size classes, ref counts, the
  LRU free queue, the prefix map (exact keys chained on entry ids) and eviction.
- :mod:`~workbench.allocator.manager`: sequences and their block tables (add with prefix hits,
  append with copy-on-write, fork, free, deferred publishing, undo).
- :mod:`~workbench.allocator.policies`: which block size a new sequence gets.
- :mod:`~workbench.allocator.errors`: the exceptions and the shared argument checks.

Every operation validates its arguments before it changes anything; an exception leaves
the allocator exactly as it was.
"""

from workbench.allocator.errors import AllocatorError, OutOfBlocks, SequenceExists, UnknownSequence
from workbench.allocator.manager import BlockManager, Checkpoint, Placement
from workbench.allocator.policies import ByExpectedLength, FixedBlockSize
from workbench.allocator.pool import Block, BlockPool

__all__ = [
    "AllocatorError", "Block", "BlockManager", "BlockPool", "ByExpectedLength", "Checkpoint", "FixedBlockSize",
    "OutOfBlocks", "Placement", "SequenceExists", "UnknownSequence",
]
