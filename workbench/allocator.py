"""Block pool and block tables: where every token's K/V lives, who shares it, what can be reused.

Physical memory is ``num_pages`` pages of ``page_tokens`` token slots. A page is carved
(slab style) into blocks of one *size class* ``block_size`` (a divisor of ``page_tokens``):
``page_tokens // block_size`` blocks, numbered ``page * blocks_per_page + slot``, so each
size class addresses the same memory as a plain array of blocks. With one size class
equal to ``page_tokens`` this is vLLM's fixed-size block pool; with several (16 and 64,
say) short requests take small blocks and long ones large blocks (the seed's adaptive
block size) and memory accounting stays exact: every slot is in exactly one of
*uncarved*, *free block* or *used block*.

Per block (a :class:`Block` descriptor): ref count, valid tokens, content hash, last access.
Free blocks wait in an LRU queue (``OrderedDict``: O(1) pop-oldest, O(1) removal from the
middle). A full block gets a chained content hash ``hash(parent_hash, tokens, extra_key)``
(the key is kept, so a hash collision can never alias two contents); when its last user
frees it, it stays in the queue *and* in the prefix map, so a later prompt with the same
prefix reuses it without copying, until allocation pops it from the head of the queue
(eviction).

Sequences (:class:`BlockManager`) own a block table (logical -> physical block id).
``fork`` shares every block (ref counts go up); appending into a shared, partly filled last
block first copies it (copy-on-write) and reports the ``(src, dst)`` copy for the cache to
apply. Every operation checks everything it needs before it changes anything: a failure
raises a specific exception and leaves tables, counts and queues exactly as they were.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class AllocatorError(Exception):
    """Base of the allocator's errors; the allocator is unchanged when one is raised."""


class OutOfBlocks(AllocatorError):
    """Not enough free memory for the request."""


class UnknownSequence(AllocatorError, KeyError):
    """No live sequence has this id."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class SequenceExists(AllocatorError):
    """A live sequence already has this id."""


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Block:
    """A snapshot of one block's descriptor."""

    block_id: int
    token_slots: int
    ref_count: int
    valid_tokens: int
    content_hash: int | None
    last_access: int


class _SizeClass:
    """The blocks of one block size: descriptor arrays indexed by block id, LRU free queue."""

    __slots__ = ("block_size", "blocks_per_page", "ref", "valid", "key", "last_access", "free", "pages",
                 "free_in_page", "cached")

    def __init__(self, block_size: int, blocks_per_page: int, num_pages: int):
        self.block_size = block_size
        self.blocks_per_page = blocks_per_page
        n = num_pages * blocks_per_page
        self.ref = [0] * n
        self.valid = [0] * n
        self.key: list[tuple | None] = [None] * n  # prefix-cache key of a cached full block
        self.last_access = [0] * n
        self.free: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self.pages: set[int] = set()  # pages carved for this class
        self.free_in_page: dict[int, int] = {}  # page -> free blocks in it
        self.cached: dict[int, int] = {}  # hash(key) -> block id


class BlockPool:
    """Physical pages carved into blocks of the configured sizes; prefix map; eviction.

    Args:
        num_pages: pages of memory.
        page_tokens: token slots per page.
        block_sizes: allowed block sizes, each dividing ``page_tokens`` (default: ``page_tokens``).
    """

    def __init__(self, num_pages: int, page_tokens: int, block_sizes: Iterable[int] | None = None):
        self.num_pages = _positive("num_pages", num_pages)
        self.page_tokens = _positive("page_tokens", page_tokens)
        sizes = sorted(set(block_sizes or (page_tokens,)))
        for bs in sizes:
            _positive("block_sizes entry", bs)
            if page_tokens % bs:
                raise ValueError(f"block_sizes entry {bs} must divide page_tokens={page_tokens}")
        self.block_sizes = tuple(sizes)
        self._classes = {bs: _SizeClass(bs, page_tokens // bs, num_pages) for bs in sizes}
        self._uncarved = list(range(num_pages - 1, -1, -1))  # stack: pops page 0 first
        self._clock = 0
        self.hits = self.misses = self.evictions = 0

    # ---- queries -------------------------------------------------------------------
    def blocks_per_page(self, block_size: int) -> int:
        return self._cls(block_size).blocks_per_page

    def num_blocks(self, block_size: int) -> int:
        """Block ids of this size class run from 0 to ``num_blocks(block_size) - 1``."""
        return self.num_pages * self._cls(block_size).blocks_per_page

    def block(self, block_size: int, block_id: int) -> Block:
        c = self._cls(block_size)
        self._check_id(c, block_id)
        key = c.key[block_id]
        return Block(block_id, block_size, c.ref[block_id], c.valid[block_id],
                     None if key is None else hash(key), c.last_access[block_id])

    def ref_count(self, block_size: int, block_id: int) -> int:
        return self._cls(block_size).ref[block_id]

    def is_free(self, block_size: int, block_id: int) -> bool:
        return block_id in self._cls(block_size).free

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
        c = self._classes.get(block_size) or self._cls(block_size)
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
        """One more user of each block (blocks must be in use or cached-free)."""
        c = self._cls(block_size)
        for bid in ids:
            if c.ref[bid] == 0:  # a cached free block comes back into use
                del c.free[bid]
                c.free_in_page[bid // c.blocks_per_page] -= 1
            c.ref[bid] += 1

    def decref(self, block_size: int, ids: Iterable[int]) -> None:
        """One user fewer; at zero the block joins the free queue's tail (staying cached if it was)."""
        c = self._classes.get(block_size) or self._cls(block_size)
        ids = list(ids)
        ref = c.ref
        for bid in ids:
            if ref[bid] <= 0:
                raise ValueError(f"block {bid} of size {block_size} is not in use")
        self._clock += 1
        clock = self._clock
        for bid in ids:
            ref[bid] -= 1
            if ref[bid] == 0:
                c.free[bid] = None
                c.last_access[bid] = clock
                c.free_in_page[bid // c.blocks_per_page] += 1

    def evict(self, n: int | None = None) -> int:
        """Forget up to ``n`` (default all) cached free blocks, oldest first; returns how many."""
        done = 0
        for c in self._classes.values():
            for bid in list(c.free):
                if n is not None and done >= n:
                    return done
                if c.key[bid] is not None:
                    self._evict(c, bid)
                    done += 1
        return done

    # ---- prefix cache --------------------------------------------------------------
    @staticmethod
    def block_key(parent_hash: int | None, tokens: Sequence[int], extra_key: object = None) -> tuple:
        """The exact identity of a full block's content, chained to everything before it."""
        return (parent_hash, tuple(tokens), extra_key)

    def lookup(self, block_size: int, key: tuple) -> int | None:
        """The cached block holding exactly ``key``, or None. Does not take a reference."""
        c = self._cls(block_size)
        bid = c.cached.get(hash(key))
        return bid if bid is not None and c.key[bid] == key else None

    def register(self, block_size: int, block_id: int, key: tuple) -> bool:
        """Make a full, in-use block findable by ``key``; False if that content is cached already."""
        c = self._cls(block_size)
        h = hash(key)
        if h in c.cached or c.key[block_id] is not None:
            return False
        c.cached[h] = block_id
        c.key[block_id] = key
        return True

    def set_valid(self, block_size: int, block_id: int, valid: int) -> None:
        self._cls(block_size).valid[block_id] = valid

    def valid_tokens(self, block_size: int, block_id: int) -> int:
        return self._cls(block_size).valid[block_id]

    def touch(self, block_size: int, ids: Iterable[int]) -> None:
        c = self._cls(block_size)
        self._clock += 1
        for bid in ids:
            c.last_access[bid] = self._clock

    # ---- internals -----------------------------------------------------------------
    def _cls(self, block_size: int) -> _SizeClass:
        try:
            return self._classes[block_size]
        except (KeyError, TypeError):
            raise ValueError(f"block_size must be one of {self.block_sizes}, got {block_size!r}") from None

    def _check_id(self, c: _SizeClass, block_id: int) -> None:
        if not 0 <= block_id < len(c.ref):
            raise ValueError(f"block_id must be in [0, {len(c.ref)}), got {block_id}")

    def _reclaimable(self, c: _SizeClass) -> list[tuple[_SizeClass, int]]:
        """Fully free pages of other size classes, which can be re-carved for ``c``."""
        return [(o, p) for o in self._classes.values() if o is not c
                for p, nfree in o.free_in_page.items() if nfree == o.blocks_per_page]

    def _available(self, c: _SizeClass) -> int:
        pages = len(self._uncarved)
        if len(self._classes) > 1:
            pages += len(self._reclaimable(c))
        return len(c.free) + pages * c.blocks_per_page

    def _carve(self, c: _SizeClass) -> None:
        """Carve the next uncarved page for ``c``, taking back a wholly free page of another class if none."""
        if not self._uncarved:
            self._uncarve(*self._reclaimable(c)[0])
        self._carve_page(c, self._uncarved[-1])

    def _uncarve(self, c: _SizeClass, page: int) -> None:
        """Return a wholly free page of ``c`` to the uncarved stock, evicting its cached blocks."""
        for bid in range(page * c.blocks_per_page, (page + 1) * c.blocks_per_page):
            if c.key[bid] is not None:
                self._evict(c, bid)
            del c.free[bid]
            c.valid[bid] = 0
        c.pages.discard(page)
        del c.free_in_page[page]
        self._uncarved.append(page)

    def _carve_page(self, c: _SizeClass, page: int) -> None:
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

    def _evict(self, c: _SizeClass, bid: int) -> None:
        del c.cached[hash(c.key[bid])]
        c.key[bid] = None
        self.evictions += 1

    # ---- compaction support (appended; workbench.compaction plans and applies) -------
    def carved_pages(self, block_size: int) -> list[int]:
        """Pages carved for this size class, ascending."""
        return sorted(self._cls(block_size).pages)

    def uncarved_pages(self) -> list[int]:
        """Pages not carved for any size class, ascending."""
        return sorted(self._uncarved)

    def page_block_size(self, page: int) -> int | None:
        """The size class ``page`` is carved for, or None if it is uncarved."""
        if not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an int in [0, {self.num_pages}), got {page!r}")
        return next((bs for bs, c in self._classes.items() if page in c.pages), None)

    def clone(self) -> BlockPool:
        """An independent copy (prefix keys are shared: they are immutable tuples)."""
        new = object.__new__(BlockPool)
        vars(new).update(vars(self))
        new.block_sizes = self.block_sizes
        new._uncarved = list(self._uncarved)
        new._classes = {}
        for bs, c in self._classes.items():
            d = _SizeClass.__new__(_SizeClass)
            d.block_size, d.blocks_per_page = c.block_size, c.blocks_per_page
            d.ref, d.valid, d.key, d.last_access = list(c.ref), list(c.valid), list(c.key), list(c.last_access)
            d.free, d.pages = OrderedDict(c.free), set(c.pages)
            d.free_in_page, d.cached = dict(c.free_in_page), dict(c.cached)
            new._classes[bs] = d
        return new

    def fingerprint(self) -> int:
        """A hash of every descriptor, queue and page assignment (equal states, equal fingerprints)."""
        parts = [tuple(self._uncarved)]
        for bs, c in self._classes.items():
            parts.append((bs, tuple(c.ref), tuple(c.valid), tuple(c.key), tuple(c.free), tuple(sorted(c.pages))))
        return hash(tuple(parts))

    def take(self, block_size: int, ids: Sequence[int]) -> None:
        """Take these specific blocks (ref count 1, no valid tokens); all or nothing.

        Each must be a clean free block of this class (not in the prefix cache), or lie in an
        uncarved page, or in a wholly free page of another class holding no cached block (that
        page is re-carved for this class).
        """
        c = self._cls(block_size)
        ids = list(ids)
        self._check_takeable(c, ids)
        # ---- nothing can fail below ----
        self._carve_for(c, ids)
        self._clock += 1
        for bid in ids:
            del c.free[bid]
            c.ref[bid], c.valid[bid], c.last_access[bid] = 1, 0, self._clock
            c.free_in_page[bid // c.blocks_per_page] -= 1

    def move_blocks(self, block_size: int, moves: Sequence[tuple[int, int]]) -> None:
        """Move block descriptors ``src -> dst`` within one size class; all or nothing.

        A ``src`` is in use (its ref count, valid tokens, prefix key and last access go to ``dst``;
        ``src`` becomes a clean free block at the queue's tail) or a cached free block (its key and
        its place in the LRU queue go to ``dst``). Each ``dst`` must be takeable as in :meth:`take`.
        Sources are distinct, destinations are distinct, and no destination is a source. Block
        tables are not the pool's: use :meth:`BlockManager.move_blocks`, and copy the K/V yourself.
        """
        c = self._cls(block_size)
        moves = [(int(s), int(d)) for s, d in moves]
        srcs, dsts = [s for s, _ in moves], [d for _, d in moves]
        for s in srcs:
            self._check_id(c, s)
            if c.ref[s] == 0 and c.key[s] is None:
                raise ValueError(f"src block {s} of size {block_size} holds nothing (not in use, not cached)")
        if len(set(srcs)) != len(srcs):
            raise ValueError("moves must not repeat a src block")
        if set(srcs) & set(dsts):
            raise ValueError("a dst block must not also be a src block")
        self._check_takeable(c, dsts)
        # ---- nothing can fail below ----
        self._carve_for(c, dsts)
        bpp = c.blocks_per_page
        rename = {}  # cached free src -> dst: dst takes src's place in the LRU queue
        for s, d in moves:
            key = c.key[s]
            c.valid[d], c.key[d], c.last_access[d] = c.valid[s], key, c.last_access[s]
            if key is not None:
                c.cached[hash(key)] = d
            c.key[s], c.valid[s] = None, 0
            if c.ref[s]:
                del c.free[d]
                c.free_in_page[d // bpp] -= 1
                c.ref[d], c.ref[s] = c.ref[s], 0
                c.free[s] = None
                c.free_in_page[s // bpp] += 1
            else:
                rename[s] = d
        if rename:
            taken = set(rename.values())
            order = [rename.get(b, b) for b in c.free if b not in taken]
            c.free = OrderedDict.fromkeys(order + list(rename))  # freed sources go to the tail

    def release_pages(self, pages: Iterable[int] | None = None) -> list[int]:
        """Return wholly free carved pages to the uncarved stock, evicting cached blocks in them.

        ``pages=None`` releases every wholly free page. Afterwards the uncarved stock hands out
        the lowest page first. Returns the released pages, ascending; all or nothing.
        """
        owner = {p: c for c in self._classes.values() for p in c.pages}
        if pages is None:
            pages = [p for p, c in owner.items() if c.free_in_page[p] == c.blocks_per_page]
        pages = sorted(set(pages))
        for p in pages:
            c = owner.get(p)
            if c is None:
                raise ValueError(f"page {p} is not carved")
            if c.free_in_page[p] != c.blocks_per_page:
                raise ValueError(f"page {p} still holds blocks in use")
        # ---- nothing can fail below ----
        for p in pages:
            self._uncarve(owner[p], p)
        self._uncarved.sort(reverse=True)  # a stack: the lowest page is popped first
        return pages

    def _check_takeable(self, c: _SizeClass, ids: list[int]) -> None:
        if len(set(ids)) != len(ids):
            raise ValueError("block ids to take must be distinct")
        owner = {p: o for o in self._classes.values() if o is not c for p in o.pages}
        for bid in ids:
            self._check_id(c, bid)
            page = bid // c.blocks_per_page
            if page in c.pages:
                if bid not in c.free or c.key[bid] is not None:
                    raise ValueError(f"block {bid} of size {c.block_size} is not a clean free block")
            elif page in owner:
                o = owner[page]
                base = page * o.blocks_per_page
                if o.free_in_page[page] != o.blocks_per_page or any(
                        o.key[b] is not None for b in range(base, base + o.blocks_per_page)):
                    raise ValueError(f"block {bid} of size {c.block_size} lies in page {page}, carved for size "
                                     f"{o.block_size} and not wholly free and clean")

    def _carve_for(self, c: _SizeClass, ids: Iterable[int]) -> None:
        """Carve the pages of ``ids`` that are not carved for ``c`` yet (taking back free pages of other classes)."""
        for page in sorted({bid // c.blocks_per_page for bid in ids} - c.pages):
            for o in self._classes.values():
                if page in o.pages:  # wholly free and clean: checked
                    self._uncarve(o, page)
            self._carve_page(c, page)


# ---- block-size policies ------------------------------------------------------------
class FixedBlockSize:
    """Every sequence gets the same block size."""

    def __init__(self, block_size: int):
        self.block_size = _positive("block_size", block_size)

    def choose(self, prompt_len: int, expected_len: int | None) -> int:
        return self.block_size

    def observe(self, final_len: int, prompt_len: int) -> None:
        pass


class ByExpectedLength:
    """Small blocks for requests expected to stay short, large ones for long requests (seed 4.1).

    The expected length is the caller's (prompt + max new tokens, say) or, when unknown,
    the prompt length plus a running average of observed output lengths times ``safety``.
    """

    def __init__(self, small: int = 16, large: int = 64, threshold: int = 512, safety: float = 1.0):
        self.small, self.large = _positive("small", small), _positive("large", large)
        self.threshold = _positive("threshold", threshold)
        if not safety > 0:
            raise ValueError(f"safety must be > 0, got {safety}")
        self.safety = safety
        self._outputs = 0
        self._finished = 0

    @property
    def average_output(self) -> float:
        return self._outputs / self._finished if self._finished else 0.0

    def choose(self, prompt_len: int, expected_len: int | None) -> int:
        if expected_len is None:
            expected_len = prompt_len + self.safety * self.average_output
        return self.small if expected_len <= self.threshold else self.large

    def observe(self, final_len: int, prompt_len: int) -> None:
        self._outputs += final_len - prompt_len
        self._finished += 1


# ---- sequences ----------------------------------------------------------------------
@dataclass
class _Seq:
    block_size: int
    table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hash of each full block (by position)
    prompt_len: int = 0
    extra_key: object = None


@dataclass(frozen=True)
class Placement:
    """What an add/append did: where the new tokens go and which blocks must be copied first.

    ``slots[i]`` is the slot (``block_id * block_size + offset``) of token ``first + i``;
    tokens before ``first`` were found in the prefix cache and need no write. ``copies`` are
    ``(src, dst)`` block ids to copy before writing (copy-on-write), in the sequence's size class.
    """

    seq_id: object
    block_size: int
    first: int
    slots: list[int]
    copies: list[tuple[int, int]]


class BlockManager:
    """Sequences and their block tables over a :class:`BlockPool`.

    Args:
        pool: the physical blocks.
        policy: picks each new sequence's block size (default: the pool's smallest size).
        prefix_caching: reuse full blocks whose chained content matches.
    """

    def __init__(self, pool: BlockPool, policy=None, prefix_caching: bool = True):
        self.pool = pool
        self.policy = policy or FixedBlockSize(pool.block_sizes[0])
        self.prefix_caching = prefix_caching
        self._seqs: dict[object, _Seq] = {}

    # ---- queries -------------------------------------------------------------------
    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id) -> list[int]:
        return list(self._get(seq_id).table)

    def block_size(self, seq_id) -> int:
        return self._get(seq_id).block_size

    def num_tokens(self, seq_id) -> int:
        return len(self._get(seq_id).tokens)

    def tokens(self, seq_id) -> list[int]:
        return list(self._get(seq_id).tokens)

    def locate(self, seq_id, pos: int) -> tuple[int, int]:
        """(physical block, offset in block) of token ``pos``."""
        s = self._get(seq_id)
        if not 0 <= pos < len(s.tokens):
            raise ValueError(f"pos must be in [0, {len(s.tokens)}), got {pos}")
        return s.table[pos // s.block_size], pos % s.block_size

    def slot_mapping(self, seq_id, start: int = 0, end: int | None = None) -> list[int]:
        s = self._get(seq_id)
        end = len(s.tokens) if end is None else end
        bs, table = s.block_size, s.table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- operations ----------------------------------------------------------------
    def add(self, seq_id, prompt: Sequence[int], *, expected_len: int | None = None,
            extra_key: object = None) -> Placement:
        """Start a sequence with ``prompt`` tokens, reusing cached full blocks of the same prefix."""
        if seq_id in self._seqs:
            raise SequenceExists(f"sequence {seq_id!r} already exists")
        prompt = list(prompt)
        bs = self.policy.choose(len(prompt), expected_len)
        pool = self.pool
        pool._cls(bs)  # validates the policy's choice
        # Prefix hits: leading full blocks whose chained key is cached. A block holding the
        # last prompt token is never a hit, so at least one token is computed (as engines do).
        hits, hashes = [], []
        if self.prefix_caching:
            for i in range((len(prompt) - 1) // bs):
                key = pool.block_key(hashes[-1] if hashes else None, prompt[i * bs:(i + 1) * bs], extra_key)
                bid = pool.lookup(bs, key)
                if bid is None:
                    break
                hits.append(bid)
                hashes.append(hash(key))
        need = -(-len(prompt) // bs) - len(hits)
        c = pool._cls(bs)
        hits_in_free = sum(1 for b in hits if b in c.free)
        if need > pool._available(c) - hits_in_free:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} new blocks of {bs} tokens, "
                              f"{pool._available(c) - hits_in_free} available")
        # ---- nothing can fail below ----
        if self.prefix_caching:
            pool.hits += len(hits)
            pool.misses += len(prompt) // bs - len(hits)
        pool.incref(bs, hits)
        pool.touch(bs, hits)
        s = _Seq(bs, table=hits + pool.allocate(bs, need), prompt_len=len(prompt), extra_key=extra_key)
        self._seqs[seq_id] = s
        first = len(hits) * bs
        s.tokens = prompt[:first]
        s.hashes = hashes
        return self._fill(seq_id, s, prompt[first:], first, [])

    def append(self, seq_id, tokens: Sequence[int]) -> Placement:
        """Append generated tokens; copy-on-write a shared, partly filled last block first."""
        s = self._get(seq_id)
        tokens = list(tokens)
        bs, n = s.block_size, len(s.tokens)
        pool = self.pool
        tail_shared = bool(tokens) and n % bs != 0 and pool.ref_count(bs, s.table[-1]) > 1
        need = -(-(n + len(tokens)) // bs) - len(s.table) + (1 if tail_shared else 0)
        if need > pool.free_blocks(bs):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} new blocks of {bs} tokens, "
                              f"{pool.free_blocks(bs)} available")
        # ---- nothing can fail below ----
        copies = []
        if tail_shared:
            (dst,) = pool.allocate(bs, 1)
            src = s.table[-1]
            pool.set_valid(bs, dst, pool.valid_tokens(bs, src))
            pool.decref(bs, [src])
            s.table[-1] = dst
            copies.append((src, dst))
        s.table.extend(pool.allocate(bs, need - len(copies)))
        return self._fill(seq_id, s, tokens, n, copies)

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block of the parent (parallel sampling, beam search)."""
        p = self._get(parent_id)
        if child_id in self._seqs:
            raise SequenceExists(f"sequence {child_id!r} already exists")
        self.pool.incref(p.block_size, p.table)
        self._seqs[child_id] = _Seq(p.block_size, list(p.table), list(p.tokens), list(p.hashes),
                                    p.prompt_len, p.extra_key)

    def free(self, seq_id) -> None:
        """Release the sequence; its blocks go back in reverse order, so shared prefixes are evicted last."""
        s = self._get(seq_id)
        self.pool.decref(s.block_size, reversed(s.table))
        self.policy.observe(len(s.tokens), s.prompt_len)
        del self._seqs[seq_id]

    # ---- internals -----------------------------------------------------------------
    def _get(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"no sequence {seq_id!r}") from None

    def _fill(self, seq_id, s: _Seq, new: list[int], first: int, copies: list) -> Placement:
        """Record ``new`` tokens at positions ``first...`` (blocks already allocated); hash full blocks."""
        bs, pool = s.block_size, self.pool
        s.tokens.extend(new)
        end = len(s.tokens)
        slots = [s.table[p // bs] * bs + p % bs for p in range(first, end)]
        for i in range(first // bs, -(-end // bs)):
            pool.set_valid(bs, s.table[i], min(bs, end - i * bs))
        if self.prefix_caching:
            for i in range(len(s.hashes), end // bs):  # newly completed blocks become findable
                key = pool.block_key(s.hashes[-1] if s.hashes else None, s.tokens[i * bs:(i + 1) * bs], s.extra_key)
                s.hashes.append(hash(key))
                pool.register(bs, s.table[i], key)
        pool.touch(bs, s.table[first // bs:])
        return Placement(seq_id, bs, first, slots, copies)

    def check_invariants(self) -> None:
        """Assert the allocator's invariants (tests call this after every step)."""
        pool = self.pool
        for bs, c in pool._classes.items():
            holders = [0] * len(c.ref)
            for s in self._seqs.values():
                if s.block_size == bs:
                    for b in s.table:
                        holders[b] += 1
            carved = {b for p in c.pages for b in range(p * c.blocks_per_page, (p + 1) * c.blocks_per_page)}
            for b in range(len(c.ref)):
                assert c.ref[b] == holders[b], f"block {b}/{bs}: ref {c.ref[b]} != holders {holders[b]}"
                assert not (c.ref[b] and b in c.free), f"block {b}/{bs} is both free and in use"
                if b in carved:
                    assert c.ref[b] or b in c.free, f"block {b}/{bs} is neither free nor in use (leaked)"
                else:
                    assert not c.ref[b] and b not in c.free, f"block {b}/{bs} is in an uncarved page"
            for h, b in c.cached.items():
                assert c.key[b] is not None and hash(c.key[b]) == h, f"prefix map entry {h} -> {b} is stale"
            for p, nfree in c.free_in_page.items():
                count = sum(1 for b in range(p * c.blocks_per_page, (p + 1) * c.blocks_per_page) if b in c.free)
                assert nfree == count, f"page {p}/{bs}: free count {nfree} != {count}"
        pages = [p for c in pool._classes.values() for p in c.pages] + pool._uncarved
        assert sorted(pages) == list(range(pool.num_pages)), "pages lost or carved twice"
        assert pool.used_slots() + pool.free_slots() == pool.num_pages * pool.page_tokens
        for sid, s in self._seqs.items():
            assert len(s.table) == math.ceil(len(s.tokens) / s.block_size), f"{sid}: table length"

    # ---- compaction support (appended; workbench.compaction plans and applies) -------
    def clone(self) -> BlockManager:
        """An independent copy of the pool and the sequences (the policy object is shared)."""
        new = object.__new__(BlockManager)
        new.pool, new.policy, new.prefix_caching = self.pool.clone(), self.policy, self.prefix_caching
        new._seqs = {sid: _Seq(s.block_size, list(s.table), list(s.tokens), list(s.hashes), s.prompt_len,
                               s.extra_key) for sid, s in self._seqs.items()}
        return new

    def fingerprint(self) -> int:
        """A hash of the pool's state and every sequence's block size, table and length."""
        seqs = tuple((sid, s.block_size, tuple(s.table), len(s.tokens)) for sid, s in self._seqs.items())
        return hash((self.pool.fingerprint(), seqs))

    def move_blocks(self, block_size: int, moves: Sequence[tuple[int, int]]) -> None:
        """:meth:`BlockPool.move_blocks`, then every block table of this size class follows the moves."""
        moves = list(moves)
        self.pool.move_blocks(block_size, moves)
        rename = dict(moves)
        for s in self._seqs.values():
            if s.block_size == block_size:
                s.table = [rename.get(b, b) for b in s.table]

    def rehome(self, seq_id, block_size: int, blocks: Sequence[int]) -> list[int]:
        """Move a sequence into another size class; returns its old block table.

        ``blocks`` (``ceil(num_tokens / block_size)`` of them, takeable as in :meth:`BlockPool.take`)
        become its table, its old blocks are released (a ref count down each, so shared blocks stay
        with their other holders), and its full new blocks join the prefix cache. The K/V of token
        ``p`` must be copied by the caller from ``old_table[p // old_bs] * old_bs + p % old_bs`` to
        the new slot mapping. All or nothing.
        """
        s = self._get(seq_id)
        pool = self.pool
        pool._cls(block_size)
        blocks = list(blocks)
        n = len(s.tokens)
        if len(blocks) != -(-n // block_size):
            raise ValueError(f"blocks must hold {n} tokens in blocks of {block_size}: "
                             f"{-(-n // block_size)} blocks, got {len(blocks)}")
        pool.take(block_size, blocks)  # validates before it changes anything
        # ---- nothing can fail below ----
        old, old_bs = s.table, s.block_size
        s.block_size, s.table, s.hashes = block_size, blocks, []
        for i, bid in enumerate(blocks):
            pool.set_valid(block_size, bid, min(block_size, n - i * block_size))
        if self.prefix_caching:
            for i in range(n // block_size):
                key = pool.block_key(s.hashes[-1] if s.hashes else None,
                                     s.tokens[i * block_size:(i + 1) * block_size], s.extra_key)
                s.hashes.append(hash(key))
                pool.register(block_size, blocks[i], key)
        pool.decref(old_bs, reversed(old))
        return old
