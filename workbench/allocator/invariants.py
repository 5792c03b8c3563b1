"""The pool's invariants, asserted: what tests check after every step.

:class:`PoolInvariants` is mixed into :class:`~workbench.allocator.pool.BlockPool` (it reads its ``_classes``
and ``_uncarved``); :meth:`~workbench.allocator.manager.BlockManager.check_invariants` calls it with the
manager's block tables, then checks the sequences.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PoolInvariants:
    """Invariant checks of :class:`~workbench.allocator.pool.BlockPool`."""

    def check_invariants(self, tables: Iterable[tuple[int, Sequence[int]]] = ()) -> None:
        """Assert every descriptor, queue, prefix-map entry and page count is consistent, and each block's ref
        count equals its holders in ``tables``: every block table that holds references, as ``(block size, ids)``."""
        holders = {bs: [0] * len(c.ref) for bs, c in self._classes.items()}
        for bs, table in tables:
            count = holders[bs]
            for b in table:
                count[b] += 1
        for bs, c in self._classes.items():
            carved = {b for p in c.pages for b in range(p * c.blocks_per_page, (p + 1) * c.blocks_per_page)}
            for b in range(len(c.ref)):
                assert c.ref[b] == holders[bs][b], f"block {b}/{bs}: ref {c.ref[b]} != holders {holders[bs][b]}"
                assert not (c.ref[b] and b in c.free), f"block {b}/{bs} is both free and in use"
                assert (c.key[b] is None) == (c.entry[b] is None), f"block {b}/{bs}: key and entry disagree"
                if b in carved:
                    assert c.ref[b] or b in c.free, f"block {b}/{bs} is neither free nor in use (leaked)"
                else:
                    assert not c.ref[b] and b not in c.free, f"block {b}/{bs} is in an uncarved page"
            for key, b in c.cached.items():
                assert c.key[b] == key, f"prefix map entry {key!r} -> {b} is stale"
            assert len(c.cached) == sum(k is not None for k in c.key), f"size {bs}: unmapped cached keys"
            for p, nfree in c.free_in_page.items():
                count = sum(1 for b in range(p * c.blocks_per_page, (p + 1) * c.blocks_per_page) if b in c.free)
                assert nfree == count, f"page {p}/{bs}: free count {nfree} != {count}"
        pages = [p for c in self._classes.values() for p in c.pages] + self._uncarved
        assert sorted(pages) == list(range(self.num_pages)), "pages lost or carved twice"
        assert self.used_slots() + self.free_slots() == self.num_pages * self.page_tokens
