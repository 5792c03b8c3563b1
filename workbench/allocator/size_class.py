"""One size class's block descriptors, and the read-only view of them that planners use.

:class:`SizeClass` is the pool's own state (plain lists indexed by block id, for speed); only
:class:`~workbench.allocator.pool.BlockPool` (with its mixins) reads or changes it: the manager asks the pool.
:class:`SizeClassView` is what everything outside the package reads (compaction, fragmentation):
the same facts through methods, with nothing to assign.
"""

from __future__ import annotations

from workbench.allocator.free_queue import FreeBlockQueue


class SizeClass:
    """The blocks of one block size: descriptor arrays indexed by block id, and the free queue.

    ``key[b]``/``entry[b]`` are set together (a cached full block) or both None; ``cached`` maps
    every set key to its block. ``free`` holds exactly the carved blocks with ``ref == 0``, and
    ``free_in_page[p]`` counts them per carved page ``p``.
    """

    __slots__ = ("block_size", "blocks_per_page", "ref", "valid", "key", "entry", "last_access", "free", "pages",
                 "free_in_page", "cached")

    def __init__(self, block_size: int, blocks_per_page: int, num_pages: int):
        self.block_size = block_size
        self.blocks_per_page = blocks_per_page
        n = num_pages * blocks_per_page
        self.ref = [0] * n  # users of each block (sequences holding it in their tables)
        self.valid = [0] * n  # tokens written in it
        self.key: list[tuple | None] = [None] * n  # prefix-cache key of a cached full block
        self.entry: list[int | None] = [None] * n  # its entry id: what child keys chain on
        self.last_access = [0] * n
        self.free = FreeBlockQueue()  # see free_queue.py for the order
        self.pages: set[int] = set()  # pages carved for this class
        self.free_in_page: dict[int, int] = {}  # page -> free blocks in it
        self.cached: dict[tuple, int] = {}  # exact key -> block id

    def copy(self) -> SizeClass:
        d = SizeClass.__new__(SizeClass)
        d.block_size, d.blocks_per_page = self.block_size, self.blocks_per_page
        d.ref, d.valid, d.key, d.entry = list(self.ref), list(self.valid), list(self.key), list(self.entry)
        d.last_access = list(self.last_access)
        d.free, d.pages = FreeBlockQueue(self.free), set(self.pages)
        d.free_in_page, d.cached = dict(self.free_in_page), dict(self.cached)
        return d


class SizeClassView:
    """Read-only facts about one size class (``BlockPool.size_class(bs)``); block ids are not checked."""

    __slots__ = ("_c",)

    def __init__(self, c: SizeClass):
        self._c = c

    @property
    def block_size(self) -> int:
        return self._c.block_size

    @property
    def blocks_per_page(self) -> int:
        return self._c.blocks_per_page

    @property
    def pages(self) -> frozenset[int]:
        """Pages carved for this class."""
        return frozenset(self._c.pages)

    def page_blocks(self, page: int) -> range:
        """Block ids of this class in ``page``."""
        bpp = self._c.blocks_per_page
        return range(page * bpp, (page + 1) * bpp)

    def free_in_page(self, page: int) -> int:
        """Free blocks in a carved page (0 for a page not carved for this class)."""
        return self._c.free_in_page.get(page, 0)

    def wholly_free(self, page: int) -> bool:
        return self._c.free_in_page.get(page, -1) == self._c.blocks_per_page

    def ref(self, block_id: int) -> int:
        return self._c.ref[block_id]

    def valid(self, block_id: int) -> int:
        return self._c.valid[block_id]

    def is_cached(self, block_id: int) -> bool:
        """In the prefix map (in use or free)."""
        return self._c.key[block_id] is not None

    def is_free(self, block_id: int) -> bool:
        return block_id in self._c.free

    def holds_data(self, block_id: int) -> bool:
        """In use, or free but cached: its bytes matter."""
        return bool(self._c.ref[block_id]) or self._c.key[block_id] is not None

    def free_queue(self) -> tuple[int, ...]:
        """Free blocks, the next to be handed out first."""
        return tuple(self._c.free)
