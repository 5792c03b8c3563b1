"""Address-space allocators for contiguous KV reservations: binary buddy and first-fit (offsets in token slots).

Both keep real free structures over one address space, so external fragmentation is measured, not assumed:
``unusable(size)`` is the free memory in holes (buddy blocks) too small for a reservation of ``size`` slots.
"""

from __future__ import annotations

import bisect


def pow2ceil(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    return 1 << (x - 1).bit_length()




class BuddyAllocator:
    """Binary buddy allocator over ``total`` slots.

    A pool that is not a power of two is split into aligned power-of-two chunks, largest first
    (15728 = 8192 + 4096 + 2048 + 1024 + 256 + 64 + 32 + 16); buddies merge only inside a chunk.
    A request of ``size`` gets a block of ``pow2ceil(size)`` slots: the free block of the smallest order that
    fits, at the lowest address (address-ordered free lists) or the most recently freed one (``lifo``).
    """

    def __init__(self, total: int, lifo: bool = False):
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        self.total = total
        self.lifo = lifo
        self.top = total.bit_length() - 1
        self.free: list[dict[int, None]] = [{} for _ in range(self.top + 1)]  # free[k]: offsets of 2**k blocks
        self.chunk_starts: list[int] = []
        self.chunk_orders: list[int] = []
        off = 0
        for k in range(self.top, -1, -1):
            if total >> k & 1:
                self.free[k][off] = None
                self.chunk_starts.append(off)
                self.chunk_orders.append(k)
                off += 1 << k
        self.free_total = total

    @staticmethod
    def order(size: int) -> int:
        return (size - 1).bit_length()

    def fits_ever(self, size: int) -> bool:
        return self.order(size) <= self.top

    def alloc(self, size: int) -> tuple[int, int] | None:
        """``(offset, order)`` of a block of at least ``size`` slots, or None."""
        k = self.order(size)
        for j in range(k, self.top + 1):
            if self.free[j]:
                off = next(reversed(self.free[j])) if self.lifo else min(self.free[j])
                del self.free[j][off]
                while j > k:  # split, keeping the lower half
                    j -= 1
                    self.free[j][off + (1 << j)] = None
                self.free_total -= 1 << k
                return off, k
        return None

    def release(self, handle: tuple[int, int]) -> None:
        off, k = handle
        self.free_total += 1 << k
        cmax = self.chunk_orders[bisect.bisect_right(self.chunk_starts, off) - 1]
        while k < cmax:
            buddy = off ^ (1 << k)
            if buddy not in self.free[k]:
                break
            del self.free[k][buddy]
            off = min(off, buddy)
            k += 1
        self.free[k][off] = None

    def block_slots(self, handle: tuple[int, int]) -> int:
        return 1 << handle[1]

    def unusable(self, size: int) -> int:
        """Free slots in blocks too small to hold ``size`` (external fragmentation for that request)."""
        k = self.order(size)
        return sum(len(self.free[j]) << j for j in range(min(k, self.top + 1)))

    def count_free(self) -> int:
        return sum(len(f) << k for k, f in enumerate(self.free))


class FirstFitAllocator:
    """First-fit over a sorted list of free holes ``(start, length)``; freed ranges coalesce with neighbours."""

    def __init__(self, total: int):
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        self.total = total
        self.starts, self.lens = [0], [total]
        self.free_total = total

    def fits_ever(self, size: int) -> bool:
        return size <= self.total

    def alloc(self, size: int) -> tuple[int, int] | None:
        for i, length in enumerate(self.lens):
            if length >= size:
                off = self.starts[i]
                if length == size:
                    del self.starts[i], self.lens[i]
                else:
                    self.starts[i] += size
                    self.lens[i] -= size
                self.free_total -= size
                return off, size
        return None

    def release(self, handle: tuple[int, int]) -> None:
        off, size = handle
        self.free_total += size
        i = bisect.bisect_left(self.starts, off)
        if i > 0 and self.starts[i - 1] + self.lens[i - 1] == off:  # merge with the hole before
            i -= 1
            self.lens[i] += size
        else:
            self.starts.insert(i, off)
            self.lens.insert(i, size)
        if i + 1 < len(self.starts) and self.starts[i] + self.lens[i] == self.starts[i + 1]:  # and after
            self.lens[i] += self.lens.pop(i + 1)
            self.starts.pop(i + 1)

    def block_slots(self, handle: tuple[int, int]) -> int:
        return handle[1]

    def unusable(self, size: int) -> int:
        return sum(length for length in self.lens if length < size)

    def count_free(self) -> int:
        return sum(self.lens)
