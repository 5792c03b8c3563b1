"""The disk tier: a crash-safe block store in one local directory, the lowest tier below pinned host memory.

A block is an opaque byte string (one KV block across all layers: codes plus scales, up to a few MiB) named by
a key of 1..64 bytes (the tier manager uses 16-byte digests). The store is log-structured:

- **One segment file per** :meth:`DiskPool.put` (a batch of blocks is one large sequential write), named
  ``seg-<sequence number>.kv`` with a monotonically increasing sequence number: a header padded to 4 KiB, then
  the blocks back to back (the format: :mod:`workbench.tiers.disk_format`).
- **Atomic commit.** The file is written as ``<name>.tmp``, flushed, ``fsync``-ed, ``os.replace``-d to its
  name, and the directory is ``fsync``-ed. A writer killed mid-write leaves only a ``.tmp`` (deleted on the next
  open): the previous copy of every key stays readable and the new one is absent. A put of a stored key
  supersedes it only once the new segment is committed; the old copy's bytes leave :attr:`used_bytes` then, and
  its file is deleted once none of its blocks is live (there is no compaction: a file with one live block
  keeps all its bytes on disk; ``stats()["dead_bytes"]`` says how many).
- **Recovery.** Opening a directory replays the committed segments in sequence order (a later copy of a key
  supersedes an earlier one) into the in-memory index ``key -> (segment, offset, nbytes, checksum)``. A segment
  whose header fails its own checksum (torn, garbled) is skipped with a warning and left in place for
  inspection; note that its blocks are then unknown, so an older copy of a key it superseded is served again.
- **Durable drops.** Forgetting a key that an older file still holds would bring it (perhaps an older value of
  it) back on the next open, so :meth:`DiskPool.drop` first commits a *tombstone* segment naming those keys
  (no data; skipped when the only file holding a key is deleted outright). A tombstone file is deleted once no
  older file holds any key it names.
- **Checksums** (xxh3_64, :mod:`workbench.tiers.disk_format`) per block and for the header, verified on every
  read.

``fsync=False`` skips the ``fsync`` calls: a killed process still loses nothing committed (the page cache
outlives it), a power loss may. One :class:`DiskPool` per directory at a time (an ``flock`` on ``LOCK``).
Capacity counts live block bytes; headers (4 KiB a file) and superseded bytes in partly live files come on top.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from workbench.tiers.disk_format import (
    DATA,
    MAX_KEY_BYTES,
    SEGMENT_NAME,
    TOMB,
    BadSegment,
    block_views,
    check_cpu_uint8,
    check_keys,
    checksum,
    data_start,
    encode_header,
    is_tensor,
    read_header,
)
from workbench.tiers.errors import CorruptBlock, DiskFull, NotInTier, TierError

if TYPE_CHECKING:
    import torch

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class Entry:
    """Where the live copy of one block is: segment ``seq``, byte ``offset`` in its file, size and checksum."""

    seq: int
    offset: int
    nbytes: int
    checksum: int


@dataclass
class _Segment:
    """One committed segment file as the index sees it."""

    seq: int
    path: Path
    size: int
    data_keys: frozenset[bytes]  # every block the file holds, live or superseded
    tomb_keys: frozenset[bytes]  # the keys it records as dropped
    live: set[bytes] = field(default_factory=set)


class DiskPool:
    """A crash-safe block store in the directory ``path``, holding at most ``capacity_bytes`` of live blocks.

    Args:
        path: the directory (created if needed; an existing pool there is reopened and recovered).
        capacity_bytes: the most live block bytes it may hold (``put`` raises :class:`DiskFull` beyond; reopening
            with less than is stored keeps every block, and puts fail until drops make room).
        fsync: ``fsync`` each segment and the directory on commit (off: safe against a killed process only).
    """

    chunk_bytes = 8 << 20  # the most one write() call is handed

    def __init__(self, path: Path | str, capacity_bytes: int, *, fsync: bool = True) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be an int > 0, got {capacity_bytes!r}")
        if not isinstance(fsync, bool):
            raise ValueError(f"fsync must be a bool, got {fsync!r}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_bytes
        self._fsync = fsync
        lock = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise TierError(f"{self.path} is in use by another DiskPool (close that one first)") from None
        self._release = weakref.finalize(self, os.close, lock)  # the lock goes with the pool, however it ends
        self._index: dict[bytes, Entry] = {}
        self._segments: dict[int, _Segment] = {}
        self._copies: dict[bytes, set[int]] = {}  # key -> data segments whose file holds a copy (live or not)
        self._used = 0
        self._skipped: list[Path] = []
        self._io = {"bytes_written": 0, "bytes_read": 0, "write_seconds": 0.0, "read_seconds": 0.0}
        self._next_seq = self._recover() + 1

    # ---- the mapping side ----------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of live blocks (what ``capacity_bytes`` bounds)."""
        return self._used

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list[bytes]:
        return list(self._index)

    def nbytes(self, key: bytes) -> int:
        """The size of the stored block ``key``."""
        if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be bytes of 1..{MAX_KEY_BYTES} bytes, got {key!r:.80}")
        return self._index[self._stored([key])[0]].nbytes

    def stats(self) -> dict[str, Any]:
        """I/O so far (bytes and seconds written/read) and what is on disk (segments, files, their bytes)."""
        files = list(self._segments.values())
        return {
            **self._io,
            "blocks": len(self._index),
            "used_bytes": self._used,
            "segments": sum(1 for s in files if s.live),
            "tombstones": sum(1 for s in files if s.tomb_keys),
            "files": len(files),
            "file_bytes": sum(s.size for s in files),
            "dead_bytes": sum(s.size - data_start(len(s.data_keys) + len(s.tomb_keys)) for s in files) - self._used,
            "skipped_files": [str(p) for p in self._skipped],
        }

    # ---- writes --------------------------------------------------------------------------------------------
    def put(self, keys: Sequence[bytes], blocks: Any) -> None:
        """Store ``blocks[i]`` under ``keys[i]`` as one new segment (all or nothing; a stored key is superseded).

        Raises:
            ValueError: bad keys or blocks (nothing checked against the store yet).
            DiskFull: the blocks do not fit in ``capacity_bytes`` (checked before writing), or the file system is
                full; nothing was stored.
            TierError: another I/O error while writing; nothing was stored, the pool stays usable.
        """
        self._check_open()
        keys = check_keys(keys)
        views = block_views(blocks, len(keys))
        if not keys:
            return
        need = sum(v.nbytes for v in views) - sum(self._index[k].nbytes for k in keys if k in self._index)
        if self._used + need > self._capacity:
            raise DiskFull(
                f"put of {len(keys)} blocks needs {need} more bytes but {self._capacity - self._used} of "
                f"capacity_bytes={self._capacity} are free in {self.path}"
            )
        entries, off = [], data_start(len(keys))
        for k, v in zip(keys, views, strict=True):
            entries.append((k, DATA, off, v.nbytes, checksum(v)))
            off += v.nbytes
        self._install(self._commit(entries, views), entries)
        self._collect()

    def drop(self, keys: Sequence[bytes]) -> None:
        """Forget ``keys`` (all must be stored: checked first, all or nothing); emptied files are deleted."""
        self._check_open()
        keys = self._stored(check_keys(keys))
        gone = set(keys)
        emptied = {s.seq for s in self._segments.values() if s.live and s.live <= gone}
        # A key needs a tombstone if a file holding it survives this drop, or if several do (deleting them in
        # some order, a crash could leave an older value behind).
        hold = [k for k in keys if len(self._copies[k]) > 1 or self._copies[k] - emptied]
        if hold:
            tombs = [(k, TOMB, 0, 0, 0) for k in hold]
            self._install(self._commit(tombs, []), tombs)
        for k in keys:
            self._forget(k)
        self._collect()

    def _commit(self, entries: list[tuple], views: list[memoryview]) -> _Segment:
        """Write one segment (``.tmp``, fsync, rename, fsync the directory) and return it, not yet installed."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1  # never reused, even if this write fails
        final = self.path / f"seg-{seq:016d}.kv"
        tmp = final.with_name(final.name + ".tmp")
        t0, fd, renamed = time.perf_counter(), None, False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            self._write_all(fd, encode_header(seq, entries))
            for v in views:
                self._write_all(fd, v)
            if self._fsync:
                os.fsync(fd)
            os.close(fd)
            fd = None
            os.replace(tmp, final)
            renamed = True
            self._sync_dir()
        except BaseException as e:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            for p in (tmp, final) if renamed else (tmp,):
                with contextlib.suppress(OSError):  # best effort: the next open deletes a leftover .tmp
                    p.unlink(missing_ok=True)
            if isinstance(e, OSError):
                kind = DiskFull if e.errno in _FULL_ERRNOS else TierError
                raise kind(f"writing segment {final} failed ({e}); nothing was stored") from e
            raise
        finally:
            self._io["write_seconds"] += time.perf_counter() - t0
        keys = frozenset(k for k, kind, *_ in entries if kind == DATA)
        return _Segment(seq, final, data_start(len(entries)) + sum(v.nbytes for v in views), keys,
                        frozenset(k for k, *_ in entries) - keys)

    def _write_all(self, fd: int, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = self._write_chunk(fd, view[: self.chunk_bytes])
            self._io["bytes_written"] += n
            view = view[n:]

    def _write_chunk(self, fd: int, chunk: memoryview) -> int:
        """One ``os.write`` (its own method so that tests can slow it down or make it fail)."""
        return os.write(fd, chunk)

    def _sync_dir(self) -> None:
        if self._fsync:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # ---- reads ---------------------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes]) -> list[torch.Tensor]:
        """The blocks ``keys`` as new 1-D uint8 tensors (each checksum verified: :class:`CorruptBlock`)."""
        import torch  # here: a process that only puts bytes (the crash test's writer) never imports torch

        self._check_open()
        keys = self._stored(check_keys(keys))
        out = [torch.empty(self._index[k].nbytes, dtype=torch.uint8) for k in keys]
        self._read(keys, [memoryview(t.numpy()) for t in out])
        return out

    def get_into(self, keys: Sequence[bytes], out: torch.Tensor) -> torch.Tensor:
        """Read the blocks ``keys`` straight into the rows of ``out`` (a contiguous uint8 CPU tensor
        ``[len(keys), nbytes]``, pinned or not; no intermediate copy) and return it. On :class:`CorruptBlock`
        the rows read so far are filled, the rest untouched or partly written."""
        self._check_open()
        keys = check_keys(keys)
        if not is_tensor(out):
            raise ValueError(f"out must be a uint8 CPU tensor [{len(keys)}, nbytes], got {type(out).__name__}")
        check_cpu_uint8(out, "out", 2)
        keys = self._stored(keys)
        sizes = {self._index[k].nbytes for k in keys}
        if out.shape[0] != len(keys) or (keys and sizes != {out.shape[1]}):
            raise ValueError(
                f"out must be [{len(keys)} keys, nbytes of each block], got {tuple(out.shape)} for blocks of "
                f"{sorted(sizes)} bytes"
            )
        rows = out.numpy()
        self._read(keys, [memoryview(rows[i]) for i in range(len(keys))])
        return out

    def _read(self, keys: list[bytes], dests: list[memoryview]) -> None:
        order = sorted(range(len(keys)), key=lambda i: (self._index[keys[i]].seq, self._index[keys[i]].offset))
        t0, fd, fd_seq = time.perf_counter(), None, None
        try:
            for i in order:  # file by file, in offset order: sequential reads, one open per file
                key, e, mv = keys[i], self._index[keys[i]], dests[i]
                path = self._segments[e.seq].path
                try:
                    if e.seq != fd_seq:
                        if fd is not None:
                            os.close(fd)
                            fd = None
                        fd, fd_seq = os.open(path, os.O_RDONLY), e.seq
                    got = 0
                    while got < e.nbytes:
                        n = os.preadv(fd, [mv[got:]], e.offset + got)
                        if n == 0:
                            raise CorruptBlock(f"block {key.hex()} in {path} at offset {e.offset}: the file ends "
                                               f"after {got} of its {e.nbytes} bytes", key)
                        got += n
                        self._io["bytes_read"] += n
                except OSError as err:
                    raise TierError(f"reading block {key.hex()} from {path} at offset {e.offset} failed "
                                    f"({err})") from err
                if checksum(mv) != e.checksum:
                    raise CorruptBlock(f"block {key.hex()} in {path} at offset {e.offset} ({e.nbytes} bytes) does "
                                       "not match its checksum", key)
        finally:
            if fd is not None:
                os.close(fd)
            self._io["read_seconds"] += time.perf_counter() - t0

    # ---- the index -----------------------------------------------------------------------------------------
    def _stored(self, keys: list[bytes]) -> list[bytes]:
        missing = [k for k in keys if k not in self._index]
        if missing:
            more = f" (and {len(missing) - 1} more of the {len(keys)} keys asked for)" if len(missing) > 1 else ""
            raise NotInTier(f"key {missing[0].hex()} is not stored in the disk pool at {self.path}{more}")
        return keys

    def _install(self, seg: _Segment, entries: list[tuple]) -> None:
        """Make a committed segment current: its blocks supersede older copies, its tombstones drop keys."""
        self._segments[seg.seq] = seg
        for key, kind, off, n, c in entries:
            self._forget(key)
            if kind == DATA:
                self._index[key] = Entry(seg.seq, off, n, c)
                self._used += n
                seg.live.add(key)
                self._copies.setdefault(key, set()).add(seg.seq)

    def _forget(self, key: bytes) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self._used -= old.nbytes
            self._segments[old.seq].live.discard(key)

    def _collect(self) -> None:
        """Delete the files nothing needs: data files with no live block, then tombstones no older file
        contradicts (the directory synced in between, so a crash never keeps a tombstone's target alone)."""

        def needed(t: _Segment) -> bool:
            return any(min(self._copies.get(k, ()), default=t.seq) < t.seq for k in t.tomb_keys)

        for tombs in (False, True):
            dead = [s for s in self._segments.values() if not s.live and bool(s.tomb_keys) == tombs]
            dead = [s for s in dead if not (tombs and needed(s))]
            for s in dead:
                try:
                    s.path.unlink(missing_ok=True)
                except OSError as e:
                    warnings.warn(f"DiskPool: could not delete {s.path} ({e}); it stays until the next open",
                                  stacklevel=3)
                    continue
                del self._segments[s.seq]
                for k in s.data_keys:
                    self._copies[k].discard(s.seq)
                    if not self._copies[k]:
                        del self._copies[k]
            if dead:
                self._sync_dir()

    def _recover(self) -> int:
        """Rebuild the index from the committed segments; returns the highest sequence number seen."""
        found, last = [], 0
        for p in self.path.iterdir():
            if p.name.startswith("seg-") and p.name.endswith(".tmp"):
                p.unlink()  # a writer died before its commit: this file never happened
            elif m := SEGMENT_NAME.fullmatch(p.name):
                found.append((int(m.group(1)), p))
        for seq, p in sorted(found):
            last = max(last, seq)
            try:
                entries, size = read_header(p, seq)
            except BadSegment as e:
                warnings.warn(f"DiskPool: skipping segment {p}: {e}; the file is left in place", stacklevel=3)
                self._skipped.append(p)
                continue
            data = frozenset(k for k, kind, *_ in entries if kind == DATA)
            self._install(_Segment(seq, p, size, data, frozenset(k for k, *_ in entries) - data), entries)
        self._collect()  # finish the deletions a crash interrupted
        return last

    # ---- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the directory (another DiskPool may open it); later calls raise :class:`TierError`."""
        self._release()

    def __enter__(self) -> DiskPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._release.alive:
            raise TierError(f"the DiskPool at {self.path} is closed")

    def __repr__(self) -> str:
        return (f"DiskPool({str(self.path)!r}, capacity_bytes={self._capacity}, blocks={len(self)}, "
                f"used_bytes={self._used})")
