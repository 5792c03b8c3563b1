"""The prefix map of :class:`~workbench.allocator.pool.BlockPool`: which full block holds which content.

A full block's key is ``(parent_entry, tokens, extra_key)``: its own tokens
plus the *entry id* of the block before it, a number the pool hands out once per cached
entry and never reuses. The map is a dict keyed by the whole key, so two contents never
alias, and a chain is only as long as its links: once a parent entry leaves the cache, no
prompt can form its children's keys again (they are unreachable and age out of the queue).
When its last user frees a cached block it stays in the queue *and* in the map, so a later
prompt with the same prefix reuses it without copying, until allocation pops it from the
head of the queue (eviction).
"""

from __future__ import annotations

from collections.abc import Sequence


class PrefixMap:
    """Prefix-cache lookups and registration of :class:`~workbench.allocator.pool.BlockPool` (mixed into it: uses
    its size classes' ``cached``/``key``/``entry`` and its ``_next_entry`` counter)."""

    def record_lookups(self, hits: int, misses: int) -> None:
        """Count prefix-cache lookups (the manager reports each prompt's hits and misses)."""
        self.hits += hits
        self.misses += misses

    @staticmethod
    def block_key(parent_entry: int | None, tokens: Sequence[int], extra_key: object = None) -> tuple:
        """The exact identity of a full block's content: its tokens after the cached entry ``parent_entry``.

        ``parent_entry`` is the :meth:`entry_id` of the previous block's content (None for a first block).
        """
        return (parent_entry, tuple(tokens), extra_key)

    def lookup(self, block_size: int, key: tuple) -> int | None:
        """The cached block holding exactly ``key``, or None. Does not take a reference."""
        c = self._cls(block_size)
        try:
            return c.cached.get(key)
        except TypeError:
            raise ValueError(f"key must be hashable (see block_key), got {key!r}") from None

    def cached_chain(self, block_size: int, tokens: Sequence[int], extra_key: object = None, *,
                     end: int | None = None) -> tuple[list[int], list[int]]:
        """The cached blocks that hold ``tokens`` block by block from the first, up to the first miss: ``(block
        ids, their entry ids)``. Only whole blocks inside ``tokens[:end]`` (default all) count. Takes no
        reference and counts no hit; ``extra_key`` must be hashable (the caller checks it)."""
        c = self._cls(block_size)
        bs, cached, entry = c.block_size, c.cached, c.entry
        hits, entries = [], []
        for i in range((len(tokens) if end is None else end) // bs):
            bid = cached.get(self.block_key(entries[-1] if entries else None, tokens[i * bs:(i + 1) * bs], extra_key))
            if bid is None:
                break
            hits.append(bid)
            entries.append(entry[bid])
        return hits, entries

    def entry_id(self, block_size: int, block_id: int) -> int | None:
        """The prefix-cache entry this block holds (what a child block's key chains on), or None."""
        c = self._cls(block_size)
        return c.entry[self._check_id(c, block_id)]

    def register(self, block_size: int, block_id: int, key: tuple) -> int | None:
        """Make a full, in-use block findable by ``key``; returns the entry id that now holds ``key``.

        If another block caches ``key`` already, that block's entry id is returned and this block
        stays unregistered; if this block caches a different key, returns None.
        """
        c = self._cls(block_size)
        block_id = self._check_id(c, block_id)
        if c.ref[block_id] < 1:
            raise ValueError(f"block {block_id} of size {block_size} must be in use to be registered")
        try:
            other = c.cached.get(key)
        except TypeError:
            raise ValueError(f"key must be hashable (see block_key), got {key!r}") from None
        if other is not None:
            return c.entry[other]
        if c.key[block_id] is not None:
            return None
        c.cached[key] = block_id
        c.key[block_id], c.entry[block_id] = key, self._next_entry
        self._next_entry += 1
        return c.entry[block_id]
