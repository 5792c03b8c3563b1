"""A lossless coding of the disk tier's blocks: byte-plane shuffle + zstd (``workbench.coding.delta``), applied
on the CPU as blocks are written to disk and undone, every checksum verified, as they are read.

    TieredCache(cache, host_bytes=..., disk_path="/nvme/kv", disk_bytes=..., disk_format="zstd")

:class:`CodedDisk` wraps a :class:`~workbench.tiers.disk.DiskPool` with the same methods that
``workbench.tiers.host_disk_store`` uses, so the tiers above it see blocks of their plain size: ``nbytes``,
``used_bytes`` and ``capacity_bytes`` count blocks *uncoded* (the coding saves disk bytes and disk bandwidth, not
the tier's accounting, which stays exact whatever a block compresses to). The segment files, their crash safety
and their per-block checksums are the pool's own (of the coded bytes); the coding adds its own checksum of the
header and payload, so a block that decodes wrong is reported as :class:`~workbench.tiers.errors.CorruptBlock`.

What it gains, measured (docs/compression.md, real SmolLM2 K/V): ~1.2x on fp16 blocks (the low mantissa byte is
noise), ~1.4-1.5x on bf16, a little more on quantized codes; zstd at level 1 runs at a few hundred MB/s a core,
well below an NVMe disk, so it pays where the disk is slow or small, not where it is fast. The delta along tokens
is off: a block's rows here are layer planes, and over all layers and kinds no delta compressed better.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workbench.coding import delta as codec
from workbench.tiers.disk import DiskPool
from workbench.tiers.errors import CorruptBlock, DiskFull

CODINGS = ("zstd",)
LEVEL = 1  # zstd level: the same ratio as 3 on real K/V, ~3x faster (docs/compression.md)


class CodedDisk:
    """``pool``'s blocks coded: each block ``[rows, row bytes]`` viewed as ``dtype`` (the tier format's storage,
    so the shuffle splits its bytes into planes), compressed on :meth:`put`, decompressed on :meth:`get_into`."""

    def __init__(self, pool: DiskPool, dtype: torch.dtype, rows: int):
        self.pool, self.dtype, self.rows = pool, dtype, rows
        self._raw: dict[bytes, int] = {}  # key -> its uncoded bytes
        self._coded_bytes = 0

    # ---- what LowerTiers asks of a disk pool ------------------------------------------------------
    @property
    def path(self):
        return self.pool.path

    @property
    def capacity_bytes(self) -> int:
        return self.pool.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Uncoded bytes of the live blocks (what ``capacity_bytes`` bounds)."""
        return sum(self._raw.values())

    def keys(self) -> list[bytes]:
        return self.pool.keys()

    def __contains__(self, key: object) -> bool:
        return key in self.pool

    def nbytes(self, key: bytes) -> int:
        return self._raw[key]

    def stats(self) -> dict:
        s = self.pool.stats()
        raw = self.used_bytes
        return {**s, "coding": "zstd", "raw_bytes": raw, "coded_bytes": s["used_bytes"],
                "ratio": raw / s["used_bytes"] if s["used_bytes"] else None}

    def put(self, keys: Sequence[bytes], blocks) -> None:
        """Code and store ``blocks`` (a ``[n, nbytes]`` uint8 tensor or ``n`` 1-D ones) as one segment."""
        rows = list(blocks) if not isinstance(blocks, torch.Tensor) else [blocks[i] for i in range(blocks.shape[0])]
        if len(rows) != len(keys):
            raise ValueError(f"blocks must hold one block per key ({len(keys)}), got {len(rows)}")
        raw = [r.reshape(-1) for r in rows]
        need = sum(r.numel() for r in raw) - sum(self._raw.get(k, 0) for k in keys)
        if self.used_bytes + need > self.capacity_bytes:
            raise DiskFull(f"put of {len(keys)} blocks needs {need} more (uncoded) bytes but "
                           f"{self.capacity_bytes - self.used_bytes} of {self.capacity_bytes} are free in {self.path}")
        blobs = [np.frombuffer(self._encode(r), dtype=np.uint8) for r in raw]
        self.pool.put(list(keys), blobs)
        for k, r in zip(keys, raw, strict=True):
            self._raw[k] = r.numel()

    def get_into(self, keys: Sequence[bytes], out: torch.Tensor) -> torch.Tensor:
        """Read, check and decode the blocks ``keys`` into the rows of ``out`` ``[len(keys), nbytes]``."""
        blobs = self.pool.get(list(keys))  # CorruptBlock when a coded block fails the pool's checksum
        for i, (k, blob) in enumerate(zip(keys, blobs, strict=True)):
            try:
                x = codec.decode(codec.Encoded.from_bytes(blob.numpy().tobytes()))
            except ValueError as e:
                raise CorruptBlock(f"block {k.hex()} on disk does not decode: {e}", k) from e
            raw = x.reshape(-1).view(torch.uint8)
            if raw.numel() != out.shape[1]:
                raise CorruptBlock(f"block {k.hex()} decodes to {raw.numel()} bytes, expected {out.shape[1]}", k)
            out[i].copy_(raw)
        return out

    def drop(self, keys: Sequence[bytes]) -> None:
        self.pool.drop(list(keys))
        for k in keys:
            self._raw.pop(k, None)

    def close(self) -> None:
        self.pool.close()

    # ---- the coding -------------------------------------------------------------------------------
    def _encode(self, raw: torch.Tensor) -> bytes:
        x = raw.contiguous().cpu().view(self.dtype).reshape(self.rows, -1)
        return codec.encode(x, delta=False, shuffle=True, level=LEVEL).to_bytes()
