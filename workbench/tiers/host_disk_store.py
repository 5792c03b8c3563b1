"""What lies below the device: the pinned host pool and the disk pool, as one store of blocks keyed by digest.

:class:`LowerTiers` keeps a :class:`LowerEntry` per block (which tier, where, its size class, hits, last access,
priority, pins) and moves batches: device -> host (:meth:`LowerTiers.store`), device -> disk straight through a
pinned buffer (:meth:`LowerTiers.store_disk`: a swap or an eviction batch the host cannot hold), disk -> a pinned
buffer with every checksum verified (:meth:`LowerTiers.fetch`, done before the device changes), host or that
buffer -> device (:meth:`LowerTiers.load`), host -> disk when the host needs room (:meth:`LowerTiers.make_host_room`,
in the eviction policy's order, one segment per batch), and drops.

Pinned entries (held by swapped-out sequences) may move to disk but are never dropped. ``protect`` (a set of
keys) keeps entries an operation in flight is about to read or pin where they are. A disk block that fails its
checksum is dropped and counted (``counters.corrupt``), so a prompt with that prefix is computed again; a pinned
one is marked ``corrupt`` (its sequence cannot come back) and dropped with its last pin.
:class:`~workbench.tiers.tiered.TieredCache` decides *what* goes down and comes back; this module only keeps and
moves it.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from workbench.allocator.errors import positive
from workbench.tiers import eviction as eviction_policies
from workbench.tiers import formats
from workbench.tiers.disk import DiskPool
from workbench.tiers.disk_coding import CodedDisk
from workbench.tiers.errors import CorruptBlock, DiskFull, HostFull, NotInTier, TierError
from workbench.tiers.host import HostPool
from workbench.tiers.transfer import BlockMover, Transfer, TransferStats


@dataclass
class LowerEntry:
    """One block below the device. ``tier`` is ``"host"`` (at ``host_start``, ``units`` units) or ``"disk"``."""

    digest: bytes
    block_size: int
    nbytes: int
    tier: str
    host_start: int | None = None
    units: int = 1
    hits: int = 0
    last_access: int = 0
    priority: int = 0
    pins: int = 0  # swapped-out sequences that need this block: never dropped while > 0
    corrupt: bool = False  # failed its checksum while pinned: its sequences cannot come back (dropped with them)
    private: bool = False  # a swapped sequence's own block (no chain digest): dropped with its last pin


@dataclass
class LowerCounters:
    to_disk: int = 0  # blocks written to disk (pushed from the host, or a swap's or an eviction's overflow)
    disk_dropped: int = 0  # blocks dropped for want of disk room
    promoted_host: int = 0  # blocks read back to the device from the host
    promoted_disk: int = 0  # ... from the disk
    corrupt: int = 0  # disk blocks that failed their checksum (dropped, or marked while pinned)


class LowerTiers:
    """The host pool (``host_bytes``, pinned on a GPU), the optional disk pool, the mover and the entries.

    Args: see :class:`~workbench.tiers.tiered.TieredCache`, which makes one.
    """

    def __init__(self, cache, *, host_bytes: int, disk_path: str | os.PathLike | None, disk_bytes: int,
                 eviction="lru", path: str = "auto", sm_programs: int | None = None, fsync: bool = True,
                 fmt: formats.TierFormat = formats.DEVICE, disk_coding: str | None = None):
        self.cache, self.fmt = cache, fmt
        self.policy = eviction_policies.get(eviction)
        self.unit_bytes = formats.block_bytes(cache, fmt, min(cache.pool_sizes))
        positive("host_bytes", host_bytes)
        if host_bytes < self.unit_bytes:
            raise ValueError(f"host_bytes must hold at least one block of the cache ({self.unit_bytes} bytes), "
                             f"got {host_bytes}")
        self.host = HostPool(host_bytes, self.unit_bytes, pin=cache.device.type == "cuda")
        self.mover = BlockMover(cache, self.host, path=path, sm_programs=sm_programs, fmt=fmt)
        self.disk = None
        if disk_path is not None:
            self.disk = DiskPool(disk_path, disk_bytes, fsync=fsync)
            if disk_coding is not None:  # the disk's blocks coded losslessly (workbench.tiers.disk_coding)
                storage = fmt.scheme.format.storage if fmt.scheme is not None else cache.dtype
                self.disk = CodedDisk(self.disk, storage, cache.num_layers * 2)
        self.entries: dict[bytes, LowerEntry] = {}
        self.clock = itertools.count(1)  # last_access stamps
        self.counters = LowerCounters()

    # ---- room ----------------------------------------------------------------------------
    def _host_victims(self, short: int, protect: set) -> list[LowerEntry] | None:
        """Host entries (policy order) that free ``short`` units: pinned ones only if the disk can take them.
        None if no such set exists. Changes nothing."""
        host = sorted((e for e in self.entries.values() if e.tier == "host" and e.digest not in protect),
                      key=self.policy.rank)
        for allow_pinned in ((True, False) if self.disk is not None else (False,)):
            victims, freed = [], 0
            for e in host:
                if freed >= short:
                    break
                if e.pins and not allow_pinned:
                    continue
                victims.append(e)
                freed += e.units
            if freed >= short and self.disk_room(protect) >= sum(e.nbytes for e in victims if e.pins):
                return victims
        return None

    def disk_room(self, protect: set) -> int:
        """Bytes the disk could hold now: free, plus unpinned entries not in ``protect`` (0 without a disk)."""
        if self.disk is None:
            return 0
        loose = sum(e.nbytes for e in self.entries.values() if e.tier == "disk" and not e.pins
                    and e.digest not in protect)
        return self.disk.capacity_bytes - self.disk.used_bytes + loose

    def make_disk_room(self, nbytes: int, protect: set) -> None:
        """Drop unpinned disk entries (policy order, none in ``protect``) until ``nbytes`` are free."""
        free = self.disk.capacity_bytes - self.disk.used_bytes
        if free >= nbytes:
            return
        drop, freed = [], 0
        for e in sorted((e for e in self.entries.values() if e.tier == "disk" and not e.pins
                         and e.digest not in protect), key=self.policy.rank):
            if free + freed >= nbytes:
                break
            drop.append(e.digest)
            freed += e.nbytes
        if free + freed < nbytes:
            raise DiskFull(f"the disk tier needs {nbytes} bytes, has {free} free and {freed} it could free")
        self.drop(drop)
        self.counters.disk_dropped += len(drop)

    def make_host_room(self, units: int, protect: set) -> None:
        """Free host units until ``units`` are free: entries leave by the policy, to disk (batched) if there is one,
        else dropped (pinned ones only move). Raises :class:`HostFull` with the tier as it was if impossible."""
        short = units - self.host.free_units
        if short <= 0:
            return
        victims = self._host_victims(short, protect)
        if victims is None:
            where = "" if self.disk is not None else "; no disk tier"
            raise HostFull(f"the host tier needs {units} units ({units * self.unit_bytes} bytes), has "
                           f"{self.host.free_units} free and cannot free {short} more (the rest hold swapped-out "
                           f"sequences{where}, or an operation in flight needs them)")
        if self.disk is not None:
            self.to_disk(victims, protect)
        else:
            self.drop([e.digest for e in victims])

    def plan_room(self, copies: dict[int, list], protect: set) -> tuple[int, dict[int, int]]:
        """Where a swap-out's new blocks go, changing nothing: ``(host units to make room for, {block size: how many
        of the batch's last blocks go straight to disk})``. All on the host if room can be made there (entries
        pushed to disk or dropped by the policy); else the host keeps what it has, its free units take the first
        blocks and the rest go to disk. Raises :class:`HostFull` / :class:`DiskFull` when neither works."""
        need = sum(self.mover.units(bs) * len(v) for bs, v in copies.items())
        if need <= self.host.free_units or self._host_victims(need - self.host.free_units, protect) is not None:
            return need, {}
        if self.disk is None:
            raise HostFull(f"the host tier needs {need} units ({need * self.unit_bytes} bytes), has "
                           f"{self.host.free_units} free and cannot free the rest (they hold swapped-out sequences; "
                           f"no disk tier)")
        overflow, units_left, disk_need = {}, self.host.free_units, 0
        for bs, pairs in copies.items():
            u = self.mover.units(bs)
            fit = min(len(pairs), units_left // u)
            units_left -= fit * u
            overflow[bs] = len(pairs) - fit
            disk_need += overflow[bs] * u * self.unit_bytes
        room = self.disk_room(protect)
        if disk_need > room:
            raise DiskFull(f"the swap needs {disk_need} bytes on disk beyond the host tier, the disk has {room} "
                           f"free or held by unpinned blocks")
        return 0, overflow

    def host_fit(self, bs: int, n: int, protect: set) -> int:
        """How many of ``n`` blocks of size ``bs`` the host can take (after pushing or dropping by the policy)."""
        u, free = self.mover.units(bs), self.host.free_units
        for k in (min(n, (free + sum(e.units for e in self.entries.values() if e.tier == "host"
                                     and e.digest not in protect and (self.disk is not None or not e.pins))) // u),
                  min(n, (free + sum(e.units for e in self.entries.values() if e.tier == "host" and not e.pins
                                     and e.digest not in protect)) // u)):
            if k * u <= free or self._host_victims(k * u - free, protect) is not None:
                return k
        return 0

    # ---- moves ---------------------------------------------------------------------------
    def store(self, bs: int, pairs: list[tuple[int, bytes]]) -> Transfer:
        """Copy device blocks to new host entries (room made by the caller), one batch."""
        units = self.mover.units(bs)
        starts = self.host.allocate([units] * len(pairs))
        try:
            transfer = self.mover.to_host(bs, [b for b, _ in pairs], starts)
        except BaseException:  # the move failed (its transcode out of device memory, say): the units are free again
            self.host.free(starts, [units] * len(pairs))
            raise
        nbytes = units * self.unit_bytes
        for (_, d), st in zip(pairs, starts, strict=True):
            self.entries[d] = LowerEntry(d, bs, nbytes, "host", st, units, last_access=next(self.clock))
        return transfer

    def store_disk(self, bs: int, pairs: list[tuple[int, bytes]], protect: set) -> Transfer:
        """Copy device blocks straight to disk entries (through a pinned buffer), one segment; room is made by
        dropping unpinned disk entries. A key already below (a corrupt copy) is superseded, keeping its pins."""
        units = self.mover.units(bs)
        nbytes = units * self.unit_bytes
        new = sum(nbytes for _, d in pairs if d not in self.entries or self.entries[d].tier != "disk")
        self.make_disk_room(new, protect | {d for _, d in pairs})
        buf = torch.empty((len(pairs), nbytes), dtype=torch.uint8, pin_memory=self.host.pinned)
        transfer = self.mover.to_buffer(bs, [b for b, _ in pairs], buf).synchronize()
        self.disk.put([d for _, d in pairs], buf)
        for _, d in pairs:
            old = self.entries.get(d)
            if old is not None and old.tier == "host":
                self.host.free([old.host_start], [old.units])
            e = self.entries[d] = LowerEntry(d, bs, nbytes, "disk", None, units, last_access=next(self.clock))
            if old is not None:
                e.pins, e.priority, e.hits, e.private = old.pins, old.priority, old.hits, old.private
        self.counters.to_disk += len(pairs)
        return transfer

    def demote(self, bs: int, pairs: list[tuple[int, bytes]], protect: set) -> list[tuple[int, bytes]]:
        """Store evicted device blocks below: the newest the host can take (after pushing entries down), the rest
        straight to disk while it has room (dropping unpinned entries). Returns the pairs stored; the others
        have nowhere to go (an I/O error included: demotion is best effort)."""
        k = self.host_fit(bs, len(pairs), protect)
        spill, host_part = pairs[:len(pairs) - k], pairs[len(pairs) - k:]
        stored = []
        if host_part:
            try:
                self.make_host_room(k * self.mover.units(bs), protect)
                self.store(bs, host_part)
                stored += host_part
            except TierError:
                spill = pairs  # the host could not take its share after all: the disk may
        nbytes = self.mover.units(bs) * self.unit_bytes
        fit = min(len(spill), self.disk_room(protect) // nbytes) if self.disk is not None else 0
        if fit:
            try:
                self.store_disk(bs, spill[len(spill) - fit:], protect)
                stored += spill[len(spill) - fit:]
            except TierError:
                pass
        return stored

    def heal(self, bs: int, pairs: list[tuple[int, bytes]], protect: set) -> None:
        """Replace corrupt (pinned) disk copies by the device's good blocks; on an I/O error they stay marked."""
        try:
            self.store_disk(bs, pairs, protect)
        except TierError:
            return
        for _, d in pairs:
            self.entries[d].corrupt = False

    def fetch(self, keys: list[bytes]) -> torch.Tensor | None:
        """Read disk entries into one pinned buffer ``[len(keys), nbytes]``, every checksum verified, before the
        device changes. A corrupt block is dropped (or marked, if pinned), counted, and re-raised."""
        if not keys:
            return None
        buf = torch.empty((len(keys), self.entries[keys[0]].nbytes), dtype=torch.uint8, pin_memory=self.host.pinned)
        try:
            self.disk.get_into(keys, buf)
        except CorruptBlock as e:
            if e.key in self.entries:
                self.found_corrupt(e.key)
            raise
        return buf

    def load(self, bs: int, pairs: list[tuple[int, bytes]], fetched: tuple[list[bytes], torch.Tensor | None]
             ) -> Transfer:
        """Fill device blocks from their entries: the host ones in one batch, the ``fetched`` disk ones
        (``(keys, buffer)`` from :meth:`fetch`) in another."""
        keys, buf = fetched
        row = {k: i for i, k in enumerate(keys)}
        host = [(b, d) for b, d in pairs if d not in row]
        transfer = Transfer("host", "device", 0, 0, self.mover.path, 0)
        if host:
            transfer = self.mover.to_device(bs, [self.entries[d].host_start for _, d in host], [b for b, _ in host])
            self.counters.promoted_host += len(host)
        if keys:
            dev = {d: b for b, d in pairs}
            transfer = self.mover.from_buffer(bs, buf, [dev[k] for k in keys])
            self.counters.promoted_disk += len(keys)
        for _, d in pairs:
            e = self.entries[d]
            e.hits += 1
            e.last_access = next(self.clock)
        transfer.wait()
        return transfer

    def to_disk(self, victims: list[LowerEntry], protect: set) -> None:
        """Push host entries to disk in one segment; unpinned ones the disk has no room for are dropped instead."""
        loose = [e for e in victims if not e.pins]
        room = self.disk_room(protect | {e.digest for e in victims})
        need = sum(e.nbytes for e in victims)
        gone = []
        while need > room and loose:  # the coldest first (victims are in policy order)
            e = loose.pop(0)
            gone.append(e.digest)
            need -= e.nbytes
        if need > room:
            raise DiskFull(f"the disk tier needs {need} bytes for blocks pushed from the host, has {room} free or "
                           f"held by unpinned blocks")
        staying = {e.digest for e in loose}
        movers = [e for e in victims if e.pins or e.digest in staying]
        self.make_disk_room(need, protect | {e.digest for e in victims})
        if gone:
            self.drop(gone)
            self.counters.disk_dropped += len(gone)
        if not movers:
            return
        if self.mover.cuda:
            torch.cuda.synchronize(self.cache.device)  # the host copies the disk write reads must have landed
        views = [self.host.view(e.host_start, e.units) for e in movers]
        self.disk.put([e.digest for e in movers], views)
        self.host.free([e.host_start for e in movers], [e.units for e in movers])
        for e in movers:
            e.tier, e.host_start = "disk", None
        self.counters.to_disk += len(movers)

    def found_corrupt(self, key: bytes) -> None:
        """A disk block failed its checksum: count it; drop it, or mark it if swapped-out sequences pin it."""
        e = self.entries[key]
        if not e.corrupt:
            self.counters.corrupt += 1
        if e.pins:
            e.corrupt = True
        else:
            self.drop([key])

    def unpin(self, keys: list[bytes]) -> None:
        """A swapped-out sequence let go of its entries: a private or corrupt one nobody pins any more is dropped."""
        gone = []
        for d in keys:
            e = self.entries[d]
            e.pins -= 1
            if not e.pins and (e.private or e.corrupt):
                gone.append(d)
        self.drop(gone)

    def drop(self, digests: list[bytes]) -> None:
        host = [self.entries[d] for d in digests if self.entries[d].tier == "host"]
        disk = [d for d in digests if self.entries[d].tier == "disk"]
        if host:
            self.host.free([e.host_start for e in host], [e.units for e in host])
        if disk:
            try:
                self.disk.drop(disk)
            except NotInTier:
                pass
        for d in digests:
            del self.entries[d]

    # ---- reports -----------------------------------------------------------------------
    def occupancy(self) -> dict:
        """Blocks and bytes on the host and the disk (``disk`` None without a disk tier)."""
        on = lambda t: sum(1 for e in self.entries.values() if e.tier == t)
        host = {"blocks": on("host"), "used_bytes": self.host.used_units * self.unit_bytes,
                "capacity_bytes": self.host.capacity_bytes, "pinned": self.host.pinned}
        disk = None if self.disk is None else {"blocks": on("disk"), "used_bytes": self.disk.used_bytes,
                                               "capacity_bytes": self.disk.capacity_bytes}
        return {"host": host, "disk": disk}

    def moves(self) -> dict:
        """Bytes, blocks, batches, copy calls and seconds per direction, the disk's included."""
        moves = TransferStats()
        moves.merge(self.mover.stats.as_dict())
        if self.disk is not None:
            ds = self.disk.stats()
            moves.add("host", "disk", ds["bytes_written"], 0, 0, ds["write_seconds"])
            moves.add("disk", "host", ds["bytes_read"], 0, 0, ds["read_seconds"])
        return moves.as_dict()

    def check(self) -> None:
        """Host entries hold disjoint unit ranges that the host pool counts as used; the disk pool holds exactly
        the disk entries, at their sizes; a corrupt entry is a pinned disk entry."""
        used = bytearray(self.host.num_units)
        for e in self.entries.values():
            assert e.nbytes == self.mover.units(e.block_size) * self.unit_bytes == e.units * self.unit_bytes, \
                f"entry {e.digest.hex()}: {e.nbytes} bytes for a block of {e.block_size}"
            assert not e.corrupt or (e.pins and e.tier == "disk"), f"entry {e.digest.hex()}: corrupt and unpinned"
            assert not e.private or e.pins, f"entry {e.digest.hex()}: a private block nobody holds (leaked)"
            if e.tier == "host":
                for u in range(e.host_start, e.host_start + e.units):
                    assert not used[u], f"host unit {u} held by two entries"
                    used[u] = 1
            else:
                assert e.tier == "disk" and self.disk is not None and e.host_start is None, f"entry {e.digest.hex()}"
        for start, n in self.host.runs():
            assert not any(used[start:start + n]), "a host unit is both free and held"
        assert self.host.used_units == sum(used), "host units leaked or double-counted"
        if self.disk is not None:
            assert set(self.disk.keys()) == {d for d, e in self.entries.items() if e.tier == "disk"}, \
                "the disk pool and the entries disagree"
            for d in self.disk.keys():
                assert self.disk.nbytes(d) == self.entries[d].nbytes, f"disk block {d.hex()}: size"
