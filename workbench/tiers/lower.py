"""What lies below the device: the pinned host pool and the disk pool, as one store of blocks keyed by digest.

:class:`LowerTiers` keeps a :class:`LowerEntry` per block (which tier, where, its size class, hits, last access,
priority, pins) and moves batches: device -> host (:meth:`LowerTiers.store`), device -> disk straight through a
pinned buffer when the host cannot hold a swap (:meth:`LowerTiers.store_disk`), host or disk -> device
(:meth:`LowerTiers.load`), host -> disk when the host needs room (:meth:`LowerTiers.make_host_room`, in the
eviction policy's order, one segment per batch), and drops. Pinned entries (held by swapped-out sequences) may
move to disk but are never dropped. :class:`~workbench.tiers.tiered.TieredCache` decides *what* goes down and
comes back; this module only keeps and moves it.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from workbench.tiers import eviction as eviction_policies
from workbench.tiers.errors import DiskFull, HostFull, NotInTier, TierFull
from workbench.tiers.host import HostPool
from workbench.tiers.transfer import BlockMover, Transfer, block_bytes


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


@dataclass
class LowerCounters:
    to_disk: int = 0  # blocks written to disk (pushed from the host, or a swap's overflow)
    disk_dropped: int = 0  # blocks dropped from a full disk
    promoted_host: int = 0  # blocks read back to the device from the host
    promoted_disk: int = 0  # ... from the disk


class LowerTiers:
    """The host pool (``host_bytes``, pinned on a GPU), the optional disk pool, the mover and the entries.

    Args: see :class:`~workbench.tiers.tiered.TieredCache`, which makes one.
    """

    def __init__(self, cache, *, host_bytes: int, disk_path: str | os.PathLike | None, disk_bytes: int,
                 eviction="lru", path: str = "auto", sm_programs: int | None = None, fsync: bool = True):
        self.cache = cache
        self.policy = eviction_policies.get(eviction)
        self.unit_bytes = block_bytes(cache, min(cache.pool_sizes))
        self.host = HostPool(host_bytes, self.unit_bytes, pin=cache.device.type == "cuda")
        self.mover = BlockMover(cache, self.host, path=path, sm_programs=sm_programs)
        self.disk = None
        if disk_path is not None:
            from workbench.tiers.disk import DiskPool

            self.disk = DiskPool(disk_path, disk_bytes, fsync=fsync)
        self.entries: dict[bytes, LowerEntry] = {}
        self.clock = itertools.count(1)  # last_access stamps
        self.counters = LowerCounters()

    def store(self, bs: int, pairs: list[tuple[int, bytes]], pinned: bool) -> Transfer:
        """Copy device blocks to new host entries (room made by the caller), one batch."""
        units = self.mover.units(bs)
        starts = self.host.allocate([units] * len(pairs))
        transfer = self.mover.to_host(bs, [b for b, _ in pairs], starts)
        nbytes = units * self.unit_bytes
        for (_, d), st in zip(pairs, starts, strict=True):
            self.entries[d] = LowerEntry(d, bs, nbytes, "host", st, units, last_access=next(self.clock))
        return transfer

    def plan_room(self, copies: dict[int, list]) -> dict[int, int]:
        """Make host room for a swap-out's blocks; what cannot fit goes straight to disk (the overflow tier).
        Returns, per block size, how many of the batch's last blocks go to disk. Raises before any block moves."""
        need = sum(self.mover.units(bs) * len(v) for bs, v in copies.items())
        room = self.host.free_units + sum(e.units for e in self.entries.values() if e.tier == "host"
                                          and (e.pins == 0 or self.disk is not None))
        if need <= room and (self.disk is not None or need <= self.host.free_units
                             or self.host_droppable() >= need - self.host.free_units):
            try:
                self.make_host_room(need, protect=set())
                return {}
            except TierFull:
                if self.disk is None:
                    raise
        if self.disk is None:
            raise HostFull(f"the host tier needs {need} units ({need * self.unit_bytes} bytes), has "
                           f"{self.host.free_units} free and {room - self.host.free_units} it could free (the rest "
                           f"hold swapped-out sequences; no disk tier)")
        overflow, units_left = {}, self.host.free_units  # keep the host as it is: the overflow goes to disk
        disk_need = 0
        for bs, pairs in copies.items():
            u = self.mover.units(bs)
            fit = min(len(pairs), units_left // u)
            units_left -= fit * u
            overflow[bs] = len(pairs) - fit
            disk_need += overflow[bs] * u * self.unit_bytes
        free = self.disk.capacity_bytes - self.disk.used_bytes
        if disk_need > free:
            raise DiskFull(f"the swap needs {disk_need} bytes on disk beyond the host tier, the disk has {free} free")
        return overflow

    def host_droppable(self) -> int:
        return sum(e.units for e in self.entries.values() if e.tier == "host" and e.pins == 0)

    def store_disk(self, bs: int, pairs: list[tuple[int, bytes]]) -> Transfer:
        """Copy device blocks straight to new disk entries (through a pinned buffer), one segment."""
        units = self.mover.units(bs)
        nbytes = units * self.unit_bytes
        buf = torch.empty((len(pairs), nbytes), dtype=torch.uint8, pin_memory=self.host.pinned)
        transfer = self.mover.to_buffer(bs, [b for b, _ in pairs], buf).synchronize()
        self.disk.put([d for _, d in pairs], buf)
        for _, d in pairs:
            self.entries[d] = LowerEntry(d, bs, nbytes, "disk", None, units, last_access=next(self.clock))
        self.counters.to_disk += len(pairs)
        return transfer

    def load(self, bs: int, pairs: list[tuple[int, bytes]]) -> Transfer:
        """Fill device blocks from their entries: host ones in one batch, disk ones read then one batch."""
        host = [(b, d) for b, d in pairs if self.entries[d].tier == "host"]
        disk = [(b, d) for b, d in pairs if self.entries[d].tier == "disk"]
        transfer = Transfer("host", "device", 0, 0, self.mover.path, 0)
        if host:
            transfer = self.mover.to_device(bs, [self.entries[d].host_start for _, d in host], [b for b, _ in host])
            self.counters.promoted_host += len(host)
        if disk:
            nbytes = self.entries[disk[0][1]].nbytes
            buf = torch.empty((len(disk), nbytes), dtype=torch.uint8, pin_memory=self.host.pinned)
            self.disk.get_into([d for _, d in disk], buf)  # CorruptBlock names the block
            transfer = self.mover.from_buffer(bs, buf, [b for b, _ in disk])
            self.counters.promoted_disk += len(disk)
        for _, d in pairs:
            e = self.entries[d]
            e.hits += 1
            e.last_access = next(self.clock)
        transfer.wait()
        return transfer

    def make_host_room(self, units: int, protect: set) -> None:
        """Free host units until ``units`` are free: entries leave by the policy, to disk (batched) if there is one,
        else dropped (pinned ones only move). Raises :class:`HostFull` with the tier as it was if impossible."""
        short = units - self.host.free_units
        if short <= 0:
            return
        host = sorted((e for e in self.entries.values() if e.tier == "host" and e.digest not in protect),
                      key=self.policy.rank)
        movable = [e for e in host if e.pins == 0] if self.disk is None else host
        if sum(e.units for e in movable) < short:
            raise HostFull(f"the host tier needs {units} units ({units * self.unit_bytes} bytes), has "
                           f"{self.host.free_units} free and {sum(e.units for e in movable)} it could free "
                           f"(the rest hold swapped-out sequences{'' if self.disk else '; no disk tier'})")
        victims, freed = [], 0
        for e in movable:
            if freed >= short:
                break
            victims.append(e)
            freed += e.units
        if self.disk is not None:
            self.to_disk(victims)
        else:
            self.drop([e.digest for e in victims])

    def to_disk(self, victims: list[LowerEntry]) -> None:
        need = sum(e.nbytes for e in victims)
        room = self.disk.capacity_bytes - self.disk.used_bytes
        if room < need:  # drop unpinned disk entries by the policy
            on_disk = sorted((e for e in self.entries.values() if e.tier == "disk" and e.pins == 0),
                             key=self.policy.rank)
            drop, freed = [], 0
            for e in on_disk:
                if room + freed >= need:
                    break
                drop.append(e.digest)
                freed += e.nbytes
            if room + freed < need:
                pinned = [e for e in victims if e.pins]
                if pinned:
                    raise DiskFull(f"the disk tier needs {need} bytes for blocks pushed from the host, has {room} "
                                   f"free and {freed} it could free")
                self.drop([e.digest for e in victims])  # nothing pinned: forget them instead
                return
            self.drop(drop)
            self.counters.disk_dropped += len(drop)
        if self.mover.cuda:
            torch.cuda.synchronize(self.cache.device)  # the host copies the disk write reads must have landed
        views = [self.host.view(e.host_start, e.units) for e in victims]
        self.disk.put([e.digest for e in victims], views)
        self.host.free([e.host_start for e in victims], [e.units for e in victims])
        for e in victims:
            e.tier, e.host_start = "disk", None
        self.counters.to_disk += len(victims)

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
        from workbench.tiers.transfer import TransferStats

        moves = TransferStats()
        moves.merge(self.mover.stats.as_dict())
        if self.disk is not None:
            ds = self.disk.stats()
            moves.add("host", "disk", ds["bytes_written"], 0, 0, ds["write_seconds"])
            moves.add("disk", "host", ds["bytes_read"], 0, 0, ds["read_seconds"])
        return moves.as_dict()

    def check(self) -> None:
        """Host units in use == the host entries' units; the disk pool holds exactly the disk entries."""
        host = [e for e in self.entries.values() if e.tier == "host"]
        assert self.host.used_units == sum(e.units for e in host), "host units leaked or double-counted"
        if self.disk is not None:
            assert set(self.disk.keys()) == {d for d, e in self.entries.items() if e.tier == "disk"}, \
                "the disk pool and the entries disagree"
