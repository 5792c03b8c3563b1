"""The block pool: physical pages carved into blocks, ref counts, the prefix map, eviction.

Physical memory is ``num_pages`` pages of ``page_tokens`` token slots. A page is carved
(slab style) into blocks of one *size class* ``block_size`` (a divisor of ``page_tokens``):
``page_tokens // block_size`` blocks, numbered ``page * blocks_per_page + slot``, so each
size class addresses the same memory as a plain array of blocks. With one size class
equal to ``page_tokens`` this is vLLM's fixed-size block pool; with several (16 and 64,
say) short requests take small blocks and long ones large blocks (the seed's adaptive
block size) and memory accounting stays exact: every slot is in exactly one of
*uncarved*, *free block* or *used block*.

Per block (a :class:`Block` descriptor): ref count, valid tokens, prefix-cache key, last
access (:mod:`~workbench.allocator.size_class`). Free blocks wait in a
:class:`~workbench.allocator.free_queue.FreeBlockQueue`, whose docstring states the order.

The prefix map (exact keys chained on entry ids, lookups, registration) is
:mod:`~workbench.allocator.prefix_map`; a cached block stays in the free queue until allocation
pops it from the head (eviction, :meth:`BlockPool.evict`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from workbench.allocator.errors import OutOfBlocks, as_index, positive
from workbench.allocator.invariants import PoolInvariants
from workbench.allocator.moves import PoolMoves
from workbench.allocator.prefix_map import PrefixMap
from workbench.allocator.size_class import SizeClass, SizeClassView


@dataclass(frozen=True)
class Block:
    """A snapshot of one block's descriptor."""

    block_id: int
    token_slots: int
    ref_count: int
    valid_tokens: int
    content_hash: int | None
    last_access: int


def _in_use_list(ref: list[int], ids: object) -> bool:
    """True when ``ids`` is a list of plain ints, each a block in use: decref's common case, checked in one pass."""
    if type(ids) is not list:
        return False
    n = len(ref)
    for bid in ids:
        if type(bid) is not int or not 0 <= bid < n or ref[bid] < 1:
            return False
    return True


class BlockPool(PrefixMap, PoolMoves, PoolInvariants):
    """Physical pages carved into blocks of the configured sizes; prefix map; eviction.

    Args:
        num_pages: pages of memory.
        page_tokens: token slots per page.
        block_sizes: allowed block sizes, each dividing ``page_tokens`` (default: ``page_tokens``).
    """

    def __init__(self, num_pages: int, page_tokens: int, block_sizes: Iterable[int] | None = None):
        self.num_pages = positive("num_pages", num_pages)
        self.page_tokens = positive("page_tokens", page_tokens)
        if block_sizes is None:
            block_sizes = (page_tokens,)
        elif isinstance(block_sizes, int) or not isinstance(block_sizes, Iterable):
            raise ValueError(f"block_sizes must be a sequence of ints, got {block_sizes!r}")
        sizes = list(block_sizes)
        for bs in sizes:
            positive("block_sizes entry", bs)
            if page_tokens % bs:
                raise ValueError(f"block_sizes entry {bs} must divide page_tokens={page_tokens}")
        if not sizes:
            raise ValueError("block_sizes must name at least one block size")
        self.block_sizes = tuple(sorted(set(sizes)))
        self._classes = {bs: SizeClass(bs, page_tokens // bs, num_pages) for bs in self.block_sizes}
        self._uncarved = list(range(num_pages - 1, -1, -1))  # stack: pops page 0 first
        self._clock = 0
        self._next_entry = 0  # prefix-cache entry ids: handed out once, never reused
        self.hits = self.misses = self.evictions = 0
        # A tier below the device (workbench.tiers) sets this to a list: every eviction appends
        # (block_size, block_id, entry_id) so the block's bytes can be copied down before they are overwritten.
        self.evicted: list[tuple[int, int, int]] | None = None

    # ---- queries -------------------------------------------------------------------
    def check_block_size(self, block_size: int) -> int:
        """``block_size`` as an int when it is one of :attr:`block_sizes`; else ValueError naming them."""
        return self._cls(block_size).block_size

    @property
    def clock(self) -> int:
        """The LRU clock: allocation, a free and a touch each tick it once; a block's last access is a reading."""
        return self._clock

    def blocks_per_page(self, block_size: int) -> int:
        return self._cls(block_size).blocks_per_page

    def num_blocks(self, block_size: int) -> int:
        """Block ids of this size class run from 0 to ``num_blocks(block_size) - 1``."""
        return self.num_pages * self._cls(block_size).blocks_per_page

    def block(self, block_size: int, block_id: int) -> Block:
        c = self._cls(block_size)
        block_id = self._check_id(c, block_id)
        key = c.key[block_id]
        return Block(block_id, block_size, c.ref[block_id], c.valid[block_id],
                     None if key is None else hash(key), c.last_access[block_id])

    def ref_count(self, block_size: int, block_id: int) -> int:
        c = self._cls(block_size)
        return c.ref[self._check_id(c, block_id)]

    def is_free(self, block_size: int, block_id: int) -> bool:
        c = self._cls(block_size)
        return self._check_id(c, block_id) in c.free

    def size_class(self, block_size: int) -> SizeClassView:
        """A read-only view of one size class's descriptors (what compaction and fragmentation read)."""
        return SizeClassView(self._cls(block_size))

    def free_blocks(self, block_size: int) -> int:
        """Blocks of this size that an allocation could take now (carving and reclaiming included)."""
        return self._available(self._cls(block_size))

    def used_slots(self) -> int:
        return sum(c.block_size * (len(c.pages) * c.blocks_per_page - len(c.free)) for c in self._classes.values())

    def free_slots(self) -> int:
        """Slots in uncarved pages plus free blocks (cached ones included: they are evictable)."""
        return len(self._uncarved) * self.page_tokens + sum(c.block_size * len(c.free) for c in self._classes.values())

    def cached_blocks(self, block_size: int | None = None) -> int:
        classes = self._classes.values() if block_size is None else [self._cls(block_size)]
        return sum(len(c.cached) for c in classes)

    def stats(self) -> dict[str, int]:
        return {
            "total_slots": self.num_pages * self.page_tokens,
            "used_slots": self.used_slots(),
            "free_slots": self.free_slots(),
            "uncarved_pages": len(self._uncarved),
            "cached_blocks": self.cached_blocks(),
            "prefix_hits": self.hits,
            "prefix_misses": self.misses,
            "evictions": self.evictions,
        }

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, block_size: int, n: int) -> list[int]:
        """Take ``n`` blocks (ref count 1, no valid tokens), oldest free first; all or nothing."""
        c = (type(block_size) is int and self._classes.get(block_size)) or self._cls(block_size)
        if type(n) is not int:
            n = as_index("n", n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(c.free) and n > self._available(c):
            raise OutOfBlocks(f"need {n} blocks of {block_size} tokens, {self._available(c)} available")
        self._clock += 1
        clock, out = self._clock, []
        free, key = c.free, c.key
        for _ in range(n):
            if not free:
                self._carve(c)
            bid = free.popitem(last=False)[0]
            if key[bid] is not None:
                if self._uncarved:  # clean memory first: carve a fresh page rather than evict
                    free[bid] = None
                    free.move_to_end(bid, last=False)
                    self._carve(c)
                    bid = free.popitem(last=False)[0]
                else:
                    self._evict(c, bid)
            c.ref[bid] = 1
            c.valid[bid] = 0
            c.last_access[bid] = clock
            c.free_in_page[bid // c.blocks_per_page] -= 1
            out.append(bid)
        return out

    def incref(self, block_size: int, ids: Iterable[int]) -> None:
        """One more user of each block (each in use, or free and cached: a prefix hit); all or nothing."""
        c = self._cls(block_size)
        ids = self._check_ids(c, ids)
        for bid in ids:
            if not c.ref[bid] and c.key[bid] is None:
                raise ValueError(f"ids entry {bid}: block {bid} of size {block_size} is neither in use nor cached")
        self._incref(c, ids)

    def decref(self, block_size: int, ids: Iterable[int]) -> None:
        """One user fewer; at zero the block joins the free queue's tail (staying cached if it was). All or nothing."""
        c = (type(block_size) is int and self._classes.get(block_size)) or self._cls(block_size)
        ref = c.ref
        if type(ids) is list and len(ids) == 1 and type(bid := ids[0]) is int and 0 <= bid < len(ref) and ref[bid]:
            self._clock += 1  # the single-block path (a copy-on-write source, the benchmark), inlined
            ref[bid] -= 1
            if not ref[bid]:
                c.free[bid] = None
                c.last_access[bid] = self._clock
                c.free_in_page[bid // c.blocks_per_page] += 1
            return
        if not _in_use_list(ref, ids):  # else: convert numpy / torch ids, or say which id is bad
            ids = self._check_ids(c, ids)
            for bid in ids:
                if ref[bid] < 1:
                    raise ValueError(f"ids entry {bid}: block {bid} of size {block_size} is not in use")
        if len(ids) > 1 and len(set(ids)) < len(ids):  # a repeated id drops one user each time
            for bid, times in Counter(ids).items():
                if ref[bid] < times:
                    raise ValueError(f"ids entry {bid}: block {bid} of size {block_size} has {ref[bid]} users, "
                                     f"cannot drop {times}")
        self._decref(c, ids)

    def evict(self, n: int | None = None) -> int:
        """Forget up to ``n`` (default all) cached free blocks, oldest first; returns how many."""
        if n is not None:
            n = as_index("n", n)
            if n < 0:
                raise ValueError(f"n must be >= 0 or None, got {n}")
        done = 0
        for c in self._classes.values():
            for bid in list(c.free):
                if n is not None and done >= n:
                    return done
                if c.key[bid] is not None:
                    self._evict(c, bid)
                    done += 1
        return done

    # ---- block contents ------------------------------------------------------------
    def set_valid(self, block_size: int, block_id: int, valid: int) -> None:
        c = self._cls(block_size)
        block_id = self._check_id(c, block_id)
        if type(valid) is not int or not 0 <= valid <= block_size:
            raise ValueError(f"valid must be an int in [0, {block_size}], got {valid!r}")
        c.valid[block_id] = valid

    def valid_tokens(self, block_size: int, block_id: int) -> int:
        c = self._cls(block_size)
        return c.valid[self._check_id(c, block_id)]

    def touch(self, block_size: int, ids: Iterable[int]) -> None:
        c = self._cls(block_size)
        self._touch(c, self._check_ids(c, ids))

    # ---- for a manager: block ids from its own tables or lookups, valid by its invariants: not checked again ----
    def incref_unchecked(self, block_size: int, ids: Iterable[int]) -> None:
        """:meth:`incref` without its checks (a fork, prefix hits found by :meth:`cached_chain`)."""
        self._incref(self._cls(block_size), ids)

    def decref_unchecked(self, block_size: int, ids: Iterable[int]) -> None:
        """:meth:`decref` without its checks (a sequence freed)."""
        self._decref(self._cls(block_size), ids)

    def touch_unchecked(self, block_size: int, ids: Iterable[int]) -> None:
        """:meth:`touch` without its checks."""
        self._touch(self._cls(block_size), ids)

    def count_free(self, block_size: int, ids: Iterable[int]) -> int:
        """How many of ``ids`` are in the free queue (cached free blocks that prefix hits take back)."""
        free = self._cls(block_size).free
        return sum(1 for b in ids if b in free)

    def fill_unchecked(self, block_size: int, ids: Sequence[int], tokens: int) -> None:
        """Blocks ``ids``, in order, hold ``tokens`` tokens from the first one's start: each gets its valid count,
        and all of them the access time of now (:meth:`set_valid` and :meth:`touch` in one)."""
        c = self._cls(block_size)
        bs, valid = c.block_size, c.valid
        for j, bid in enumerate(ids):
            valid[bid] = min(bs, tokens - j * bs)
        self._touch(c, ids)

    # the manager's undo (BlockManager.checkpoint / restore): a block's state read before an add or append
    def block_state_unchecked(self, block_size: int, block_id: int) -> tuple[int, int]:
        """``(valid tokens, last access)`` of the block."""
        c = self._cls(block_size)
        return c.valid[block_id], c.last_access[block_id]

    def set_block_state_unchecked(self, block_size: int, block_id: int, valid: int, last_access: int) -> None:
        """Put back what :meth:`block_state_unchecked` read."""
        c = self._cls(block_size)
        c.valid[block_id], c.last_access[block_id] = valid, last_access

    def rewind_clock(self, clock: int) -> None:
        """Set the LRU clock back to an earlier reading (:attr:`clock` before the undone operation)."""
        self._clock = clock

    def return_to_head(self, block_size: int, ids: Sequence[int]) -> None:
        """Free blocks go back to the head of the queue, ``ids[0]`` first: where an undone allocation took them."""
        free = self._cls(block_size).free
        for bid in reversed(ids):
            free.push_head(bid)

    # ---- internals -----------------------------------------------------------------
    def _cls(self, block_size: int) -> SizeClass:
        c = None
        if type(block_size) is int or (not isinstance(block_size, (bool, float)) and hasattr(block_size, "__index__")):
            c = self._classes.get(int(block_size))
        if c is None:
            raise ValueError(f"block_size must be one of {self.block_sizes}, got {block_size!r}")
        return c

    def _check_id(self, c: SizeClass, block_id: object, name: str = "block_id") -> int:
        if type(block_id) is not int:
            block_id = as_index(name, block_id)
        if not 0 <= block_id < len(c.ref):
            raise ValueError(f"{name} must be in [0, {len(c.ref)}) for block size {c.block_size}, got {block_id}")
        return block_id

    def _check_ids(self, c: SizeClass, ids: Iterable[int]) -> list[int]:
        """``ids`` as a list of plain ints, each a block id of ``c`` (numpy / torch integers accepted)."""
        if type(ids) is not list:
            if isinstance(ids, (str, bytes)):
                raise ValueError(f"ids must be an iterable of block ids, got {type(ids).__name__}")
            try:
                ids = list(ids)
            except TypeError:
                raise ValueError(f"ids must be an iterable of block ids, got {type(ids).__name__}") from None
        n = len(c.ref)
        for bid in ids:
            if type(bid) is not int or bid < 0 or bid >= n:
                return [self._check_id(c, b, "ids entry") for b in ids]
        return ids

    # Unchecked forms for the manager, whose ids come from its own tables (valid by its invariants).
    def _incref(self, c: SizeClass, ids: Iterable[int]) -> None:
        ref = c.ref
        for bid in ids:
            if not ref[bid]:  # a cached free block comes back into use
                del c.free[bid]
                c.free_in_page[bid // c.blocks_per_page] -= 1
            ref[bid] += 1

    def _decref(self, c: SizeClass, ids: Iterable[int]) -> None:
        self._clock += 1
        clock, ref = self._clock, c.ref
        for bid in ids:
            ref[bid] -= 1
            if not ref[bid]:
                c.free[bid] = None
                c.last_access[bid] = clock
                c.free_in_page[bid // c.blocks_per_page] += 1

    def _touch(self, c: SizeClass, ids: Iterable[int]) -> None:
        self._clock += 1
        clock, last_access = self._clock, c.last_access
        for bid in ids:
            last_access[bid] = clock

    def _reclaimable(self, c: SizeClass) -> list[tuple[SizeClass, int]]:
        """Fully free pages of other size classes, which can be re-carved for ``c``."""
        return [(o, p) for o in self._classes.values() if o is not c
                for p, nfree in o.free_in_page.items() if nfree == o.blocks_per_page]

    def _available(self, c: SizeClass) -> int:
        pages = len(self._uncarved)
        if len(self._classes) > 1:
            pages += len(self._reclaimable(c))
        return len(c.free) + pages * c.blocks_per_page

    def _carve(self, c: SizeClass) -> None:
        """Carve the next uncarved page for ``c``, taking back a wholly free page of another class if none."""
        if not self._uncarved:
            self._uncarve(*self._reclaimable(c)[0])
        self._carve_page(c, self._uncarved[-1])

    def _uncarve(self, c: SizeClass, page: int) -> None:
        """Return a wholly free page of ``c`` to the uncarved stock, evicting its cached blocks."""
        for bid in range(page * c.blocks_per_page, (page + 1) * c.blocks_per_page):
            if c.key[bid] is not None:
                self._evict(c, bid)
            del c.free[bid]
            c.valid[bid] = 0
        c.pages.discard(page)
        del c.free_in_page[page]
        self._uncarved.append(page)

    def _carve_page(self, c: SizeClass, page: int) -> None:
        """Carve an uncarved ``page`` into free blocks of ``c``, at the head of its free queue."""
        if self._uncarved[-1] == page:
            self._uncarved.pop()
        else:
            self._uncarved.remove(page)
        c.pages.add(page)
        c.free_in_page[page] = c.blocks_per_page
        base = page * c.blocks_per_page
        for bid in range(base + c.blocks_per_page - 1, base - 1, -1):  # to the head, ascending ids
            c.free[bid] = None
            c.free.move_to_end(bid, last=False)

    def _evict(self, c: SizeClass, bid: int) -> None:
        if self.evicted is not None:
            self.evicted.append((c.block_size, bid, c.entry[bid]))
        del c.cached[c.key[bid]]
        c.key[bid] = c.entry[bid] = None
        self.evictions += 1
