"""The disk tier's file format: a segment's header and entries, the blocks' checksums, and what a block handed to
the store may be (keys, and blocks as byte views). :mod:`workbench.tiers.disk` is the store that writes and reads
these files.

A segment file is a header (magic, format version, count, the sequence number, per block: key, kind (data or
tombstone), offset, nbytes, checksum; then the checksum of the header) padded to 4 KiB, then the blocks back to back;
it is named ``seg-<sequence number>.kv``. Checksums are xxh3_64 (``xxhash``): a non-cryptographic 64-bit hash at
memory speed, so verifying costs little beside an NVMe read (~3 GB/s); CRC32 is slower than the disk it checks.
Measured on this machine (2-core AMD EPYC VM, best of 10 on a 32 MiB buffer): ``xxhash.xxh3_64`` 10.2 GB/s,
``zlib.crc32`` 2.0 GB/s. 64 bits also make an accidental match of a garbled block negligible (2**-64), where 32 bits
would not be over billions of reads.

Nothing here imports torch (a tensor is recognised only if torch is already loaded), so a process that only writes
bytes stays free of its seconds-long import.
"""

from __future__ import annotations

import os
import re
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

MAGIC = b"WBKVSEG\x00"
VERSION = 1
MAX_KEY_BYTES = 64
ALIGN = 4096  # data starts on a page boundary (room for O_DIRECT reads later)

_HEAD = struct.Struct("<8sHHIQ")  # magic, version, flags (0), count, sequence number
_ENTRY = struct.Struct("<BB6x64sQQQ")  # key length, kind, key (zero padded), offset, nbytes, checksum
_SUM = struct.Struct("<Q")
DATA, TOMB = 0, 1  # an entry's kind: a block, or a key the segment drops
SEGMENT_NAME = re.compile(r"seg-(\d{16})\.kv")


def checksum(buf: Any) -> int:
    """The 64-bit checksum of a block (or a header): ``xxh3_64`` of its bytes."""
    return xxhash.xxh3_64_intdigest(buf)


class BadSegment(Exception):
    """Why a segment file cannot be trusted (:func:`read_header`)."""


def data_start(count: int) -> int:
    return -(-(_HEAD.size + count * _ENTRY.size + _SUM.size) // ALIGN) * ALIGN


def encode_header(seq: int, entries: list[tuple]) -> bytes:
    """The header of a segment with ``entries`` ``(key, kind, offset, nbytes, checksum)``, padded to the data."""
    body = _HEAD.pack(MAGIC, VERSION, 0, len(entries), seq)
    body += b"".join(_ENTRY.pack(len(k), kind, k, off, n, c) for k, kind, off, n, c in entries)
    head = body + _SUM.pack(checksum(body))
    return head + bytes(data_start(len(entries)) - len(head))


def read_header(path: Path, seq: int) -> tuple[list[tuple], int]:
    """A committed segment's entries and file size; :class:`BadSegment` says why it cannot be trusted."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                raise BadSegment(f"{size} bytes, shorter than a header")
            magic, version, _, count, head_seq = _HEAD.unpack(head)
            if magic != MAGIC:
                raise BadSegment(f"magic {magic!r} is not {MAGIC!r}")
            if version != VERSION:
                raise BadSegment(f"format version {version}, this reader knows {VERSION}")
            if data_start(count) > size:
                raise BadSegment(f"header of {count} entries runs past the end of the {size}-byte file")
            rest = f.read(count * _ENTRY.size + _SUM.size)
    except OSError as e:
        raise BadSegment(f"cannot read it: {e}") from e
    body = head + rest[: -_SUM.size]
    if checksum(body) != _SUM.unpack(rest[-_SUM.size :])[0]:
        raise BadSegment("header checksum mismatch (torn or garbled)")
    if head_seq != seq:
        raise BadSegment(f"header says sequence number {head_seq}, the name says {seq}")
    entries = []
    for i in range(count):
        klen, kind, key, off, n, c = _ENTRY.unpack_from(body, _HEAD.size + i * _ENTRY.size)
        if not 1 <= klen <= MAX_KEY_BYTES or kind not in (DATA, TOMB) or (kind == DATA and off + n > size):
            raise BadSegment(f"entry {i} is out of range (key length {klen}, kind {kind}, bytes {off}..{off + n})")
        entries.append((key[:klen], kind, off, n, c))
    return entries, size


def is_tensor(x: Any) -> bool:
    # A tensor exists only if torch is loaded; not importing it here keeps a writer process (the crash test's
    # child, a standalone tool) free of torch's seconds-long import.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def check_keys(keys: Any) -> list[bytes]:
    if isinstance(keys, (bytes, bytearray, memoryview, str)) or not isinstance(keys, Sequence):
        raise ValueError(f"keys must be a list or tuple of bytes keys, got {type(keys).__name__}")
    seen: set[bytes] = set()
    for i, k in enumerate(keys):
        if not isinstance(k, bytes):
            raise ValueError(f"keys[{i}] must be bytes (1..{MAX_KEY_BYTES} long), got {type(k).__name__}")
        if not 1 <= len(k) <= MAX_KEY_BYTES:
            raise ValueError(f"keys[{i}] must be 1..{MAX_KEY_BYTES} bytes long, got {len(k)} bytes")
        if k in seen:
            raise ValueError(f"keys must be distinct within a call, but keys[{i}] = {k.hex()} comes twice")
        seen.add(k)
    return list(keys)


def check_cpu_uint8(t: Any, name: str, dim: int) -> None:
    import torch  # here: a writer process that never hands in a tensor stays free of torch's import

    if t.dtype != torch.uint8 or t.device.type != "cpu" or t.dim() != dim or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dim}-D uint8 CPU tensor, got {tuple(t.shape)} {t.dtype} on {t.device}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )


def block_views(blocks: Any, n: int) -> list[memoryview]:
    """``blocks`` (1-D uint8 CPU tensors or bytes-like, one per key; or one 2-D uint8 tensor) as byte views."""
    if is_tensor(blocks):
        check_cpu_uint8(blocks, "blocks", 2)
        rows = blocks.numpy()
        if rows.shape[0] != n or rows.shape[1] == 0:
            raise ValueError(f"blocks must be [{n} keys, nbytes > 0], got {tuple(blocks.shape)}")
        return [memoryview(r) for r in rows]
    if isinstance(blocks, (bytes, bytearray, memoryview, str)) or not isinstance(blocks, Sequence):
        raise ValueError(f"blocks must be a list of blocks or one 2-D uint8 tensor, got {type(blocks).__name__}")
    if len(blocks) != n:
        raise ValueError(f"blocks must have one block per key: {n} keys, {len(blocks)} blocks")
    views = []
    for i, b in enumerate(blocks):
        if is_tensor(b):
            check_cpu_uint8(b, f"blocks[{i}]", 1)
            mv = memoryview(b.numpy())
        else:
            try:
                mv = memoryview(b)
            except TypeError:
                raise ValueError(
                    f"blocks[{i}] must be a 1-D uint8 CPU tensor or bytes-like, got {type(b).__name__}"
                ) from None
            if mv.ndim != 1 or mv.itemsize != 1 or not mv.contiguous:
                raise ValueError(f"blocks[{i}] must be 1-D contiguous bytes, got shape {mv.shape} format {mv.format!r}")
            mv = mv.cast("B")
        if mv.nbytes == 0:
            raise ValueError(f"blocks[{i}] must not be empty")
        views.append(mv)
    return views
