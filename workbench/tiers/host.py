"""The host tier: one pinned buffer of fixed-size units, handed out in contiguous runs.

A block of the cache's smallest size class takes ``blocks_per_unit`` = 1 unit; a block of a larger size class
takes proportionally more (block bytes grow with the block's token count). The allocator keeps the free units
as sorted, merged runs ``(start, length)`` and places a *batch* of blocks in one run when one is long enough
(first fit): a swap of that batch is then a single copy into one contiguous range, which is what the copy
engine needs to reach the link's bandwidth (``workbench.tiers.link``). When no run fits the whole batch, each
block goes first-fit on its own and the mover issues one copy per run it touches.

The buffer is pinned (page-locked) when a GPU is present: pageable memory moves at a fraction of the link
(~12-16 GB/s against ~54 GB/s pinned on the H200) and cannot be read by a copy kernel. A pinned allocation the
OS refuses raises :class:`~workbench.tiers.errors.HostFull` naming the size, before anything exists.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from workbench.tiers.errors import HostFull


class HostPool:
    """``capacity_bytes // unit_bytes`` units of ``unit_bytes`` in one (pinned) uint8 buffer.

    Args:
        capacity_bytes: the tier's size (rounded down to whole units).
        unit_bytes: bytes of the smallest block (all planes of all layers: what one swap moves per block).
        pin: page-lock the buffer (default: when CUDA is available).
    """

    def __init__(self, capacity_bytes: int, unit_bytes: int, *, pin: bool | None = None):
        for name, v in (("capacity_bytes", capacity_bytes), ("unit_bytes", unit_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.unit_bytes = unit_bytes
        self.num_units = capacity_bytes // unit_bytes
        if self.num_units < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes} holds no unit of {unit_bytes} bytes")
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        try:
            self.buffer = torch.empty((self.num_units, unit_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        except RuntimeError as e:
            raise HostFull(f"cannot {'pin' if self.pinned else 'allocate'} {self.num_units * unit_bytes} bytes of "
                           f"host memory for the host tier: {e}") from e
        self._starts = [0]  # free runs, sorted by start; merged on free (no two adjacent)
        self._lengths = [self.num_units]

    # ---- queries -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.num_units * self.unit_bytes

    @property
    def free_units(self) -> int:
        return sum(self._lengths)

    @property
    def used_units(self) -> int:
        return self.num_units - self.free_units

    def runs(self) -> list[tuple[int, int]]:
        """The free runs ``(start unit, units)``, in address order."""
        return list(zip(self._starts, self._lengths, strict=True))

    def view(self, start: int, units: int) -> torch.Tensor:
        """Units ``start .. start + units - 1`` as one contiguous uint8 tensor ``[units * unit_bytes]``."""
        if not (type(start) is int and type(units) is int and 0 <= start and units >= 1
                and start + units <= self.num_units):
            raise ValueError(f"start and units must be ints with 0 <= start, units >= 1, start + units <= "
                             f"{self.num_units}, got start={start!r}, units={units!r}")
        return self.buffer[start:start + units].view(-1)

    # ---- allocation ----------------------------------------------------------------
    def allocate(self, sizes: Sequence[int]) -> list[int]:
        """Start units for blocks of ``sizes`` units each; all or nothing (:class:`HostFull` naming need and free).

        The whole batch goes in one run when a free run is long enough (the first such, by address), in order;
        else each block takes the first run it fits."""
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or \
                any(isinstance(s, bool) or not hasattr(s, "__index__") for s in sizes):
            raise ValueError(f"sizes must be a list of positive unit counts, got {sizes!r}")
        sizes = [int(s) for s in sizes]
        if any(s < 1 for s in sizes):
            raise ValueError(f"sizes must be positive unit counts, got {sizes}")
        total = sum(sizes)
        if not sizes:
            return []
        for i, length in enumerate(self._lengths):
            if length >= total:
                start = self._starts[i]
                self._take(i, total)
                out, at = [], start
                for s in sizes:
                    out.append(at)
                    at += s
                return out
        if total > self.free_units:
            raise HostFull(f"the host tier needs {total} units ({total * self.unit_bytes} bytes), "
                           f"{self.free_units} free of {self.num_units}")
        starts, lengths = list(self._starts), list(self._lengths)  # to undo a batch that does not fit
        out = []
        for s in sizes:
            i = next((j for j, length in enumerate(self._lengths) if length >= s), None)
            if i is None:
                self._starts, self._lengths = starts, lengths
                raise HostFull(f"the host tier has {self.free_units} free units but no run of {s} "
                               f"(fragmented into {len(self._starts)} runs)")
            out.append(self._starts[i])
            self._take(i, s)
        return out

    def free(self, starts: Sequence[int], sizes: Sequence[int]) -> None:
        """Give back blocks (``starts`` from :meth:`allocate`, with their ``sizes``); merges adjacent runs."""
        pairs = sorted(zip((int(s) for s in starts), (int(n) for n in sizes), strict=True))
        for start, n in pairs:
            if not (0 <= start and n >= 1 and start + n <= self.num_units):
                raise ValueError(f"block at unit {start} of {n} units is outside the host tier")
            i = bisect.bisect_left(self._starts, start)
            if (i < len(self._starts) and self._starts[i] < start + n) or \
                    (i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start):
                raise ValueError(f"block at unit {start} of {n} units is (partly) free already")
        for start, n in pairs:
            i = bisect.bisect_left(self._starts, start)
            self._starts.insert(i, start)
            self._lengths.insert(i, n)
            if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:  # merge with the next run
                self._lengths[i] += self._lengths.pop(i + 1)
                self._starts.pop(i + 1)
            if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # and with the previous one
                self._lengths[i - 1] += self._lengths.pop(i)
                self._starts.pop(i)

    def _take(self, i: int, n: int) -> None:
        if self._lengths[i] == n:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i] += n
            self._lengths[i] -= n


def contiguous_runs(starts: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group blocks (in batch order) into runs of adjacent units: ``(first block index, start unit, units)``.
    A batch the allocator placed in one run gives one run: one copy. (numpy: a prefetch of a thousand blocks
    is issued while the decode runs, and its host-side cost is what delays the copy.)"""
    st = np.asarray(starts, dtype=np.int64)
    sz = np.asarray(sizes, dtype=np.int64)
    if sz.ndim and sz.shape != st.shape:
        raise ValueError(f"sizes must be one size or one per start ({st.size}), got {sz.size}")
    sz = np.broadcast_to(sz, st.shape)
    if st.size == 0:
        return []
    breaks = np.flatnonzero(st[1:] != st[:-1] + sz[:-1]) + 1  # a block that does not follow the one before
    firsts = np.concatenate(([0], breaks))
    totals = np.add.reduceat(sz, firsts)
    return [(int(f), int(st[f]), int(t)) for f, t in zip(firsts, totals, strict=True)]
