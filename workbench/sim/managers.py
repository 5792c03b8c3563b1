"""The runtime state of each allocation strategy in the simulator: which slots each running request holds.

``Seq`` is one request's progress; a ``Manager`` admits, grows and frees them. The configs that build
these (and what each strategy means) are in :mod:`workbench.sim.strategies`.
"""

from __future__ import annotations

import math

from workbench.sim.allocators import BuddyAllocator, FirstFitAllocator, pow2ceil


class Seq:
    """Runtime state of a request inside the engine (shared with the managers).

    ``g`` tokens were generated before the current admission at step ``a``; after the growth of step ``s``
    the request stores ``p + g + 1 + (s - a)`` tokens. ``cap`` slots are held for it; ``h`` is the
    manager's handle (an address range, a block count, page lists).
    """

    __slots__ = ("idx", "p", "o", "F", "g", "a", "cap", "h", "ver")

    def __init__(self, idx: int, p: int, o: int):
        self.idx, self.p, self.o, self.F = idx, p, o, p + o
        self.g, self.a, self.cap, self.h, self.ver = 0, 0, 0, None, 0


# ----------------------------------------------------------------------------------------------------------
# Managers: the engine calls fits_ever / admit / grow / release / external / compact


class Manager:
    """Common interface. ``allocated`` counts slots taken from the pool (>= the ``cap`` held by requests)."""

    block_size: int | None = None  # waste bound per request of an on-demand paged manager
    compact_every: int | None = None

    def __init__(self, slots: int):
        self.slots = slots
        self.allocated = 0

    def fits_ever(self, seq: Seq, c0: int) -> bool:  # can this request ever run to completion alone?
        raise NotImplementedError

    def admit(self, seq: Seq, c0: int) -> bool:  # hold at least c0 slots for seq (sets seq.cap, seq.h)
        raise NotImplementedError

    def grow(self, seq: Seq, c: int) -> bool:  # extend seq.cap to >= c
        raise NotImplementedError(f"{type(self).__name__} never grows a reservation")

    def release(self, seq: Seq) -> None:
        raise NotImplementedError

    def external(self, head: Seq | None) -> int:  # free slots that cannot serve `head` (None: nobody waits)
        raise NotImplementedError

    def count_free(self) -> int:  # free slots counted from the allocator's own structures (for checks)
        raise NotImplementedError

    def on_finish(self, final_len: int) -> None:
        pass

    def compact(self, running: list[tuple[Seq, int]]) -> tuple[int, list[tuple[Seq, int]]]:
        """Copy data to reduce waste: returns (tokens copied, [(seq, old cap)] for seqs whose cap changed)."""
        return 0, []


class ContiguousManager(Manager):
    def __init__(self, slots: int, reserve: str, allocator: str, max_len: int):
        super().__init__(slots)
        self.reserve, self.max_len = reserve, max_len
        self.alloc = FirstFitAllocator(slots) if allocator == "first-fit" else BuddyAllocator(
            slots, lifo=allocator == "buddy-lifo")

    def size(self, seq: Seq) -> int:
        """Slots reserved for ``seq`` at admission."""
        if self.reserve == "max":
            return self.max_len
        if self.reserve == "pow2":
            return min(self.max_len, seq.p + pow2ceil(seq.o))
        return seq.F

    def fits_ever(self, seq: Seq, c0: int) -> bool:
        return self.alloc.fits_ever(self.size(seq))

    def admit(self, seq: Seq, c0: int) -> bool:
        size = self.size(seq)
        handle = self.alloc.alloc(size)
        if handle is None:
            return False
        seq.h, seq.cap = handle, size
        self.allocated += self.alloc.block_slots(handle)
        return True

    def release(self, seq: Seq) -> None:
        self.allocated -= self.alloc.block_slots(seq.h)
        self.alloc.release(seq.h)
        seq.h, seq.cap = None, 0

    def external(self, head: Seq | None) -> int:
        return 0 if head is None else self.alloc.unusable(self.size(head))

    def count_free(self) -> int:
        return self.alloc.count_free()


class PagedManager(Manager):
    """Fixed blocks of ``block_size`` slots; on demand, or with the seed's preallocation at admission."""

    def __init__(self, slots: int, block_size: int, watermark: float, prealloc: tuple[float, int, float] | None):
        super().__init__(slots)
        self.B = block_size
        self.total_blocks = slots // block_size
        self.tail = slots - self.total_blocks * block_size  # slots that no block covers
        self.free_blocks = self.total_blocks
        self.wm = int(watermark * self.total_blocks)
        self.prealloc = prealloc  # (safety, max_prealloc_tokens, ema_alpha) or None
        self.avg: float | None = None
        self.block_size = None if prealloc else block_size

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.B)

    def fits_ever(self, seq: Seq, c0: int) -> bool:
        return self._blocks(c0) <= self.total_blocks - self.wm and self._blocks(seq.F) <= self.total_blocks

    def admit(self, seq: Seq, c0: int) -> bool:
        need = self._blocks(c0)
        if self.free_blocks - need < self.wm:
            return False
        want = need
        if self.prealloc and self.avg is not None:
            safety, max_tokens, _ = self.prealloc
            want = max(need, self._blocks(min(max_tokens, math.ceil(self.avg * safety))))
            if self.free_blocks - want < self.wm:
                want = need  # not enough for the preallocation: take what the prompt needs
        self.free_blocks -= want
        self.allocated += want * self.B
        seq.h, seq.cap = want, want * self.B
        return True

    def grow(self, seq: Seq, c: int) -> bool:
        k = self._blocks(c) - seq.h
        if k > self.free_blocks:
            return False
        self.free_blocks -= k
        self.allocated += k * self.B
        seq.h += k
        seq.cap = seq.h * self.B
        return True

    def release(self, seq: Seq) -> None:
        self.free_blocks += seq.h
        self.allocated -= seq.h * self.B
        seq.h, seq.cap = None, 0

    def external(self, head: Seq | None) -> int:
        return self.tail

    def count_free(self) -> int:
        return self.free_blocks * self.B + self.tail

    def on_finish(self, final_len: int) -> None:
        if self.prealloc:
            alpha = self.prealloc[2]
            self.avg = final_len if self.avg is None else (1 - alpha) * self.avg + alpha * final_len


class AdaptiveManager(Manager):
    """Small blocks while ``cap < switch_at``, large blocks after; small blocks are carved from large pages.

    Free small sub-blocks of a carved page are external fragmentation: they can serve only the small class.
    Compaction every ``compact_every`` steps (the seed's rule plus slab packing):
      1. a request whose last block is large and less than half full has its valid tokens copied into
         small blocks and the large page freed, if that copies fewer tokens than it frees slots. The request
         is then *re-homed*: it grows in small blocks from now on (also after a preemption), so it is
         converted at most once and its tail wastes less than one small block. Without this, a running
         request past ``switch_at`` takes a fresh large block, less than half full by construction, and a
         short period converts it again and again (copies grow, the token share falls);
      2. small blocks are packed into the fewest pages (moved from the emptiest carved pages), so whole
         pages return to the free pool.
    ``conversions`` counts step 1's conversions over the run (at most one per request).
    """

    def __init__(self, slots: int, small: int, large: int, switch_at: int, watermark: float,
                 compact_every: int | None):
        super().__init__(slots)
        self.S, self.L, self.switch_at = small, large, switch_at
        self.per = large // small
        pages = slots // large
        self.tail = slots - pages * large
        self.free_pages = list(range(pages - 1, -1, -1))  # stack of page ids
        self.total_pages = pages
        self.used: dict[int, int] = {}  # carved page -> small blocks in use
        self.partial: dict[int, None] = {}  # carved pages with a free sub-block (insertion ordered)
        self.owners: dict[int, list[Seq]] = {}  # carved page -> owners of its small blocks
        self.free_sub = 0
        self.wm = int(watermark * pages)
        self.compact_every = compact_every
        self.block_size = large  # on demand: waste < the largest block
        self.rehomed: set[int] = set()  # request indices whose tail was re-homed: small blocks only, for good
        self.conversions = 0

    def _plan(self, seq: Seq, cap: int, c: int) -> tuple[int, int, int]:
        """Small and large blocks needed to grow ``seq`` from ``cap`` to ``>= c``, and the new cap."""
        if cap >= c:
            return 0, 0, cap
        if seq.idx in self.rehomed:  # re-homed: never back to large blocks
            ns = -(-(c - cap) // self.S)
            return ns, 0, cap + ns * self.S
        ns = nl = 0
        if cap < self.switch_at:  # small blocks up to switch_at (a multiple of S), then large ones
            ns = -(-(min(c, self.switch_at) - cap) // self.S)
            cap += ns * self.S
        if cap < c:
            nl = -(-(c - cap) // self.L)
            cap += nl * self.L
        return ns, nl, cap

    def _available(self, ns: int, nl: int, reserve_pages: int) -> bool:
        pages = len(self.free_pages) - reserve_pages - nl
        if pages < 0:
            return False
        from_pages = max(0, ns - self.free_sub)
        return -(-from_pages // self.per) <= pages

    def fits_ever(self, seq: Seq, c0: int) -> bool:
        ns, nl, _ = self._plan(seq, 0, c0)
        nsf, nlf, _ = self._plan(seq, 0, seq.F)
        return (nl + -(-ns // self.per) <= self.total_pages - self.wm
                and nlf + -(-nsf // self.per) <= self.total_pages)

    def _alloc_small(self, seq: Seq) -> int:
        if self.partial:
            page = next(reversed(self.partial))
            self.free_sub -= 1
        else:
            page = self.free_pages.pop()
            self.used[page] = 0
            self.owners[page] = []
            self.partial[page] = None
            self.free_sub += self.per - 1
        self.used[page] += 1
        self.owners[page].append(seq)
        if self.used[page] == self.per:
            del self.partial[page]
        self.allocated += self.S
        return page

    def _free_small(self, seq: Seq, page: int) -> None:
        self.used[page] -= 1
        self.owners[page].remove(seq)
        self.allocated -= self.S
        if self.used[page] == 0:
            del self.used[page], self.owners[page], self.partial[page]
            self.free_sub -= self.per - 1
            self.free_pages.append(page)
        else:
            self.partial[page] = None
            self.free_sub += 1

    def _take(self, seq: Seq, ns: int, nl: int) -> None:
        small, large = seq.h[0], seq.h[1]
        for _ in range(ns):
            small.append(self._alloc_small(seq))
            seq.h[2] = False  # last block is small
        for _ in range(nl):
            large.append(self.free_pages.pop())
            self.allocated += self.L
            seq.h[2] = True

    def admit(self, seq: Seq, c0: int) -> bool:
        ns, nl, cap = self._plan(seq, 0, c0)
        if not self._available(ns, nl, self.wm):
            return False
        seq.h = [[], [], False]  # small-block pages, large pages, last block is large
        self._take(seq, ns, nl)
        seq.cap = cap
        return True

    def grow(self, seq: Seq, c: int) -> bool:
        ns, nl, cap = self._plan(seq, seq.cap, c)
        if not self._available(ns, nl, 0):
            return False
        self._take(seq, ns, nl)
        seq.cap = cap
        return True

    def release(self, seq: Seq) -> None:
        small, large, _ = seq.h
        for page in small:
            self._free_small(seq, page)
        self.free_pages.extend(large)
        self.allocated -= self.L * len(large)
        seq.h, seq.cap = None, 0

    def external(self, head: Seq | None) -> int:
        return self.free_sub * self.S + self.tail

    def count_free(self) -> int:
        carved_free = sum(self.per - u for u in self.used.values()) * self.S
        return len(self.free_pages) * self.L + carved_free + self.tail

    def compact(self, running: list[tuple[Seq, int]]) -> tuple[int, list[tuple[Seq, int]]]:
        copied, changed = 0, []
        for seq, c in running:  # 1. the seed's rule: a large tail block less than half full -> small blocks
            small, large, last_large = seq.h
            if not last_large:
                continue
            valid = c - (seq.cap - self.L)  # tokens in the large tail block
            k = -(-valid // self.S)  # small blocks that take them
            if valid >= self.L // 2 or valid >= self.L - k * self.S:  # not under half full, or copies >= freed
                continue
            old = seq.cap
            self.free_pages.append(large.pop())
            self.allocated -= self.L
            for _ in range(k):
                small.append(self._alloc_small(seq))
            seq.h[2] = False
            seq.cap = old - self.L + k * self.S
            self.rehomed.add(seq.idx)  # grows in small blocks from now on: converted once
            self.conversions += 1
            copied += valid
            changed.append((seq, old))
        n_small = sum(self.used.values())  # 2. pack small blocks into the fewest pages
        keep_n = -(-n_small // self.per)
        if len(self.used) > keep_n:
            order = sorted(self.used, key=lambda pg: -self.used[pg])
            keep, donors = order[:keep_n], order[keep_n:]
            targets = [pg for pg in keep if self.used[pg] < self.per]
            for donor in donors:
                for seq in list(self.owners[donor]):
                    target = targets[-1]
                    pages = seq.h[0]
                    pages[pages.index(donor)] = target
                    self.owners[donor].remove(seq)
                    self.owners[target].append(seq)
                    self.used[donor] -= 1
                    self.used[target] += 1
                    copied += self.S
                    if self.used[target] == self.per:
                        targets.pop()
                        del self.partial[target]
                del self.used[donor], self.owners[donor], self.partial[donor]
                self.free_pages.append(donor)
            self.free_sub = sum(self.per - u for u in self.used.values())
        return copied, changed


# ----------------------------------------------------------------------------------------------------------
# Configs (frozen, hashable): build a fresh manager per run
