"""What compaction needs from the pool: snapshots (and adopting one), taking chosen blocks, moving blocks,
releasing pages.

:class:`PoolMoves` is mixed into :class:`~workbench.allocator.pool.BlockPool`; ``workbench.cache.compaction``
plans on a clone and applies with these. Every method validates the whole request before it
changes anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from workbench.allocator.errors import as_index
from workbench.allocator.size_class import SizeClass


class PoolMoves:
    """Compaction support of :class:`~workbench.allocator.pool.BlockPool` (uses its ``_classes`` and ``_uncarved``)."""

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

    def clone(self) -> PoolMoves:
        """An independent copy of the pool (prefix keys are shared: they are immutable tuples)."""
        new = object.__new__(type(self))
        vars(new).update(vars(self))
        new.block_sizes = self.block_sizes
        new._uncarved = list(self._uncarved)
        new._classes = {bs: c.copy() for bs, c in self._classes.items()}
        new.evicted = None  # a clone (a compaction plan) has no tier below it
        return new

    def adopt(self, other: PoolMoves) -> None:
        """Take ``other``'s whole state (a :meth:`clone` a plan was made on, now applied) as this pool's."""
        vars(self).update(vars(other))

    def fingerprint(self) -> int:
        """A hash of every descriptor, queue and page assignment (equal states, equal fingerprints)."""
        parts = [tuple(self._uncarved)]
        for bs, c in self._classes.items():
            parts.append((bs, tuple(c.ref), tuple(c.valid), tuple(c.key), tuple(c.entry), tuple(c.free),
                          tuple(sorted(c.pages))))
        return hash(tuple(parts))

    def take(self, block_size: int, ids: Sequence[int]) -> None:
        """Take these specific blocks (ref count 1, no valid tokens); all or nothing.

        Each must be a clean free block of this class (not in the prefix cache), or lie in an
        uncarved page, or in a wholly free page of another class holding no cached block (that
        page is re-carved for this class).
        """
        c = self._cls(block_size)
        ids = self._check_ids(c, ids)
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
        try:
            moves = [(self._check_id(c, s, "src"), self._check_id(c, d, "dst")) for s, d in moves]
        except (TypeError, ValueError) as e:  # not pairs, or bad ids
            raise ValueError(f"moves must be (src, dst) pairs of block ids: {e}") from None
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
            c.valid[d], c.key[d], c.entry[d], c.last_access[d] = c.valid[s], key, c.entry[s], c.last_access[s]
            if key is not None:
                c.cached[key] = d
            c.key[s], c.entry[s], c.valid[s] = None, None, 0
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
            c.free = c.free.reordered(order + list(rename))  # freed sources go to the tail

    def release_pages(self, pages: Iterable[int] | None = None) -> list[int]:
        """Return wholly free carved pages to the uncarved stock, evicting cached blocks in them.

        ``pages=None`` releases every wholly free page. Afterwards the uncarved stock hands out
        the lowest page first. Returns the released pages, ascending; all or nothing.
        """
        owner = {p: c for c in self._classes.values() for p in c.pages}
        if pages is None:
            pages = [p for p, c in owner.items() if c.free_in_page[p] == c.blocks_per_page]
        pages = sorted({as_index("pages entry", p) for p in pages})
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

    def _check_takeable(self, c: SizeClass, ids: list[int]) -> None:
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

    def _carve_for(self, c: SizeClass, ids: Iterable[int]) -> None:
        """Carve the pages of ``ids`` that are not carved for ``c`` yet (taking back free pages of other classes)."""
        for page in sorted({bid // c.blocks_per_page for bid in ids} - c.pages):
            for o in self._classes.values():
                if page in o.pages:  # wholly free and clean: checked
                    self._uncarve(o, page)
            self._carve_page(c, page)


