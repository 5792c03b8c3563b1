"""Block pool and block tables: where every token's K/V lives, who shares it, what can be reused.

- :mod:`~workbench.allocator.pool`: physical pages carved into size classes, ref counts and eviction;
  the methods the manager needs (its unchecked forms and its undo), so nothing outside reads the pool's fields.
- :mod:`~workbench.allocator.prefix_map`: the prefix map (exact keys chained on entry ids), mixed into the pool.
- :mod:`~workbench.allocator.invariants`: the pool's invariants, asserted (tests call them after every step).
- :mod:`~workbench.allocator.free_queue`: the free blocks' order (what is handed out, and evicted, first).
- :mod:`~workbench.allocator.size_class`: one size class's descriptors and their read-only view.
- :mod:`~workbench.allocator.moves`: what compaction needs (clone, take chosen blocks, move, release).
- :mod:`~workbench.allocator.manager`: sequences and their block tables (add with prefix hits,
  append with copy-on-write, fork, free, deferred publishing, undo).
- :mod:`~workbench.allocator.policies`: which block size a new sequence gets.
- :mod:`~workbench.allocator.errors`: the exceptions and the shared argument checks.

Every operation validates its arguments before it changes anything; an exception leaves
the allocator exactly as it was.
"""

from workbench.allocator.errors import AllocatorError, OutOfBlocks, SequenceExists, UnknownSequence
from workbench.allocator.free_queue import FreeBlockQueue
from workbench.allocator.manager import BlockManager, Checkpoint, Placement
from workbench.allocator.policies import ByExpectedLength, FixedBlockSize
from workbench.allocator.pool import Block, BlockPool
from workbench.allocator.size_class import SizeClassView

__all__ = [
    "AllocatorError", "Block", "BlockManager", "BlockPool", "ByExpectedLength", "Checkpoint", "FixedBlockSize",
    "FreeBlockQueue", "OutOfBlocks", "Placement", "SequenceExists", "SizeClassView", "UnknownSequence",
]
