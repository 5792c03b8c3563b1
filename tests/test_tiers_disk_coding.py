"""The disk tier's lossless coding (``workbench.tiers.disk_coding.CodedDisk``, ``disk_format="zstd"``): blocks come
back bit for bit (NaN payloads, -0.0 and Inf included), the accounting is in uncoded bytes, a flipped or cut coded
byte is a ``CorruptBlock``, a full disk refuses before writing, and a ``TieredCache`` over it round-trips every
host format through the disk, invariants held."""

import errno

import numpy as np
import pytest
import torch

from workbench.cache import PagedKVCache
from workbench.tiers import TieredCache
from workbench.tiers import formats as F
from workbench.tiers.disk import DiskPool
from workbench.tiers.disk_coding import CodedDisk
from workbench.tiers.errors import CorruptBlock, DiskFull, TierError

pytestmark = pytest.mark.kernels  # the TieredCache case moves blocks with the kernels on a GPU


def _blocks(rng, n, rows=4, cols=96, dtype=torch.float16):
    """fp16 K/V-like rows, a few special values in, as the raw bytes of ``n`` blocks ``[n, rows * cols * 2]``."""
    x = torch.from_numpy(rng.standard_normal((n, rows, cols)).astype(np.float32)).to(dtype)
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")], dtype=dtype)
    return x.view(torch.uint8).reshape(n, -1).contiguous()


def _keys(rng, n):
    return [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(n)]


def test_blocks_come_back_bit_for_bit_and_count_uncoded_bytes(tmp_path):
    rng = np.random.default_rng(0)
    pool = CodedDisk(DiskPool(tmp_path, 1 << 20, fsync=False), torch.float16, rows=4)
    blocks, keys = _blocks(rng, 5), _keys(rng, 5)
    pool.put(keys[:3], blocks[:3])  # a [n, nbytes] tensor
    pool.put(keys[3:], [blocks[3], blocks[4]])  # or 1-D views (host units pushed down)
    assert pool.used_bytes == blocks.numel() and all(pool.nbytes(k) == blocks.shape[1] for k in keys)
    out = torch.full_like(blocks, 0xAB)  # poisoned
    pool.get_into(keys, out)
    assert torch.equal(out, blocks)
    s = pool.stats()
    assert s["coding"] == "zstd" and s["raw_bytes"] == blocks.numel() and s["coded_bytes"] < s["raw_bytes"]
    pool.drop(keys[:2])
    assert pool.used_bytes == 3 * blocks.shape[1] and sorted(pool.keys()) == sorted(keys[2:])
    pool.close()


def test_a_flipped_or_cut_coded_byte_is_a_corrupt_block(tmp_path):
    rng = np.random.default_rng(1)
    pool = CodedDisk(DiskPool(tmp_path, 1 << 20, fsync=False), torch.float16, rows=4)
    blocks, keys = _blocks(rng, 2), _keys(rng, 2)
    pool.put(keys, blocks)
    (seg,) = tmp_path.glob("seg-*.kv")
    raw = bytearray(seg.read_bytes())
    raw[-10] ^= 0x5A  # inside the last block's coded bytes
    seg.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlock, match=keys[1].hex()):
        pool.get_into([keys[1]], torch.empty_like(blocks[1:]))
    out = torch.empty_like(blocks[:1])
    assert torch.equal(pool.get_into([keys[0]], out), blocks[:1])  # the other block still reads
    pool.close()


def test_a_full_disk_refuses_before_writing(tmp_path):
    rng = np.random.default_rng(2)
    blocks = _blocks(rng, 3)
    pool = CodedDisk(DiskPool(tmp_path, 2 * blocks.shape[1], fsync=False), torch.float16, rows=4)
    with pytest.raises(DiskFull, match="uncoded"):
        pool.put(_keys(rng, 3), blocks)  # coded they would fit: capacity counts uncoded bytes
    assert pool.used_bytes == 0 and not list(tmp_path.glob("seg-*.kv"))
    pool.close()


@pytest.mark.parametrize("host_format", [None, "int4/token", "fp8_e4m3/token"])
def test_a_tiered_cache_round_trips_through_a_coded_disk(tmp_path, host_format):
    L, H, D, bs = 2, 2, 32, 8
    cache = PagedKVCache(L, H, D, num_pages=6, page_tokens=bs, ops="torch")
    fmt = F.tier_format(cache, host_format)
    tc = TieredCache(cache, host_bytes=F.block_bytes(cache, fmt, bs), disk_path=tmp_path, disk_bytes=1 << 20,
                     host_format=host_format, disk_format="zstd", fsync=False)
    assert isinstance(tc.lower.disk, CodedDisk)
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(L, 40, H, D, generator=g).half().to(cache.device) for _ in range(2))
    tc.add("a", list(range(40)), k, v)
    staged = cache.blocks(bs)[:, :, cache.manager.block_table("a")[:4]].permute(2, 0, 1, 3).contiguous()
    want = F.roundtrip_values(cache, fmt, bs, staged.view(torch.uint8).reshape(4, -1))
    tc.free("a")
    tc.evict()
    tc.add("b", list(range(100, 140)), k, v)  # its blocks push a's down: one on the host, the rest on disk
    tc.free("b")
    tc.evict()
    tc.check_invariants()
    tc.add("c", list(range(40)), k, v)  # promoted back: 4 full blocks (the last token's block is computed)
    st = tc.stats()
    assert st["promoted_disk"] >= 3 and st["corrupt"] == 0
    table = cache.manager.block_table("c")[:4]
    got = cache.blocks(bs)[:, :, table].permute(2, 0, 1, 3).contiguous().view(torch.uint8).reshape(4, -1)
    assert torch.equal(F.roundtrip_values(cache, F.DEVICE, bs, got), want)
    assert tc.is_lossy("c") == (host_format is not None)
    tc.check_invariants()
    tc.close()


def test_a_disk_format_that_is_not_the_hosts_is_refused_before_anything(tmp_path):
    cache = PagedKVCache(2, 2, 32, num_pages=4, page_tokens=8, ops="torch")
    for bad, match in ((dict(host_format="int4/token", disk_format="int8/token"), "disk_format must be"),
                       (dict(disk_format="zstd"), "needs a disk_path"),
                       (dict(disk_format="lz4"), "disk_format")):
        kw = dict(disk_path=tmp_path, disk_bytes=1 << 20) if "needs" not in match else {}
        with pytest.raises(ValueError, match=match):
            TieredCache(cache, host_bytes=1 << 20, **kw, **bad)
        assert cache.on_evict is None and not list(tmp_path.glob("*"))


def test_a_write_that_fails_midway_leaves_the_coded_disk_as_it_was(tmp_path, monkeypatch):
    """The pool's commit (``.tmp``, fsync, rename) is the coded disk's too: a write that dies after its first
    chunk (ENOSPC here; SIGKILL is tests/test_tiers_disk.py's) stores nothing, counts nothing, and the blocks
    stored before still decode."""
    rng = np.random.default_rng(4)
    pool = CodedDisk(DiskPool(tmp_path, 1 << 22, fsync=False), torch.float16, rows=4)
    blocks, keys = _blocks(rng, 4, cols=4096), _keys(rng, 4)
    pool.put(keys[:1], blocks[:1])
    before = (pool.used_bytes, sorted(pool.keys()), sorted(p.name for p in tmp_path.glob("seg-*")))
    calls = [0]
    write = DiskPool._write_chunk

    def dies(self, fd, chunk):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "no space left")
        return write(self, fd, chunk)

    monkeypatch.setattr(DiskPool, "_write_chunk", dies)
    pool.pool.chunk_bytes = 1 << 10
    with pytest.raises(TierError):
        pool.put(keys[1:], blocks[1:])
    assert (pool.used_bytes, sorted(pool.keys()), sorted(p.name for p in tmp_path.glob("seg-*"))) == before
    assert not list(tmp_path.glob("*.tmp"))
    out = torch.empty_like(blocks[:1])
    assert torch.equal(pool.get_into(keys[:1], out), blocks[:1])
    pool.close()
