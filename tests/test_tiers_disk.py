"""The disk tier (``workbench.tiers.disk.DiskPool``): blocks come back bit-exact (``get``, ``get_into``, after a
reopen), a later put supersedes, drops stay dropped across a reopen, a writer killed by SIGKILL mid-write loses
nothing committed, corrupt data and headers are caught, capacity and ENOSPC leave the pool unchanged and usable,
and bad arguments raise ValueError before anything changes."""

import errno
import os
import select
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.tiers import disk_format
from workbench.tiers.disk import DiskPool
from workbench.tiers.errors import CorruptBlock, DiskFull, NotInTier, TierError, TierFull

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def block(rng, nbytes):
    """Random bytes 1..255 (never a zero, so a block of zeros read back can never pass)."""
    return torch.from_numpy(rng.integers(1, 256, nbytes, dtype=np.uint8))


def key(rng):
    return bytes(rng.integers(0, 256, 16, dtype=np.uint8))


def same(a, b):
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def files(path):
    return sorted(p.name for p in Path(path).iterdir() if p.name != "LOCK")


def state(pool):
    return pool.keys(), pool.used_bytes, files(pool.path)


@pytest.fixture
def rng(request):
    """A generator seeded by the test's name: random data, the same on every run."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


# ---- round trips ---------------------------------------------------------------------------------------------
def test_round_trip_sizes_and_forms(tmp_path, rng):
    sizes = [1, 7, 4095, 4096, 4097, 100_003, (1 << 20) + 3]
    keys = [key(rng) for _ in sizes]
    blocks = [block(rng, n) for n in sizes]
    with DiskPool(tmp_path / "pool", 16 << 20) as pool:  # fsync on: the real commit path
        pool.put(keys, blocks)
        more = [key(rng) for _ in range(4)]  # bytes-like blocks, and one 2-D tensor of equal rows
        raw = [block(rng, 333) for _ in range(4)]
        pool.put(more[:2], [raw[0].numpy().tobytes(), bytearray(raw[1].numpy().tobytes())])
        pool.put(more[2:], torch.stack(raw[2:]))
        assert len(pool) == len(keys) + 4 and set(pool.keys()) == set(keys + more)
        assert pool.used_bytes == sum(sizes) + 4 * 333
        assert all(k in pool for k in keys) and key(rng) not in pool
        assert [pool.nbytes(k) for k in keys] == sizes
        got = pool.get(keys[::-1] + more)
        assert all(same(g, b) for g, b in zip(got, blocks[::-1] + raw, strict=True))
        assert all(g.dtype == torch.uint8 and g.dim() == 1 for g in got)
        st_ = pool.stats()
        assert st_["segments"] == st_["files"] == 3 and len(files(pool.path)) == 3
        assert st_["bytes_read"] == sum(sizes) + 4 * 333 and st_["bytes_written"] >= st_["bytes_read"]
        assert st_["write_seconds"] > 0 and st_["read_seconds"] > 0 and st_["dead_bytes"] == 0


def test_get_into_preallocated(tmp_path, rng):
    nbytes, n = 40_000, 6
    keys = [key(rng) for _ in range(n)]
    blocks = torch.stack([block(rng, nbytes) for _ in range(n)])
    with DiskPool(tmp_path, GiB, fsync=False) as pool:
        pool.put(keys[:3], blocks[:3])  # two segments: reads cross files
        pool.put(keys[3:], list(blocks[3:]))
        out = torch.empty(4, nbytes, dtype=torch.uint8)
        ptr = out.data_ptr()
        order = [5, 0, 3, 1]
        assert pool.get_into([keys[i] for i in order], out) is out and out.data_ptr() == ptr
        assert same(out, blocks[order])
        for bad in (torch.empty(3, nbytes, dtype=torch.uint8), torch.empty(4, nbytes + 1, dtype=torch.uint8),
                    torch.empty(4, nbytes, dtype=torch.int8), torch.empty(nbytes, 4, dtype=torch.uint8).t(),
                    torch.empty(4 * nbytes, dtype=torch.uint8)):
            with pytest.raises(ValueError, match="out"):
                pool.get_into([keys[i] for i in order], bad)
        with pytest.raises(NotInTier):
            pool.get_into([keys[0], key(rng)], torch.empty(2, nbytes, dtype=torch.uint8))


def test_reopen_reads_everything_back(tmp_path, rng):
    stored = {}
    with DiskPool(tmp_path, GiB) as pool:
        for _ in range(4):
            ks = [key(rng) for _ in range(3)]
            bs = [block(rng, int(n)) for n in rng.integers(1, 200_000, 3)]
            pool.put(ks, bs)
            stored.update(zip(ks, bs, strict=True))
        used = pool.used_bytes
    with DiskPool(tmp_path, GiB) as pool:
        assert set(pool.keys()) == set(stored) and pool.used_bytes == used
        assert all(same(g, stored[k]) for k, g in zip(stored, pool.get(list(stored)), strict=True))


def test_supersede(tmp_path, rng):
    a, b = key(rng), key(rng)
    a1, a2, b1, a3 = block(rng, 5000), block(rng, 7000), block(rng, 3000), block(rng, 100)
    with DiskPool(tmp_path, GiB) as pool:
        pool.put([a], [a1])
        first = files(tmp_path)
        pool.put([a], [a2])
        assert same(pool.get([a])[0], a2) and pool.used_bytes == 7000
        assert not set(first) & set(files(tmp_path)) and len(files(tmp_path)) == 1  # the emptied file is gone
        pool.put([a, b], [a2, b1])
        pool.put([a], [a3])  # a's old file still holds b: it stays, a's bytes there are dead
        assert len(files(tmp_path)) == 2 and pool.used_bytes == 3100 and pool.stats()["dead_bytes"] == 7000
    with DiskPool(tmp_path, GiB) as pool:
        assert same(pool.get([a])[0], a3) and same(pool.get([b])[0], b1)


def test_later_segment_wins_on_reopen(tmp_path, rng):
    """A crash between committing a new copy and deleting the emptied old file: reopening keeps the new copy."""
    a, a1, a2 = key(rng), block(rng, 999), block(rng, 1001)
    with DiskPool(tmp_path / "p", GiB) as pool:
        pool.put([a], [a1])
        (old,) = (tmp_path / "p").glob("seg-*.kv")
        saved = old.read_bytes()
        pool.put([a], [a2])
    old.write_bytes(saved)
    with DiskPool(tmp_path / "p", GiB) as pool:
        assert same(pool.get([a])[0], a2) and pool.used_bytes == 1001
        assert not old.exists()  # recovery finished the deletion


def test_drop_all_or_nothing_and_durable(tmp_path, rng):
    a, b, c = key(rng), key(rng), key(rng)
    with DiskPool(tmp_path, GiB) as pool:
        pool.put([a, b], [block(rng, 100), block(rng, 200)])
        pool.put([a], [block(rng, 300)])  # two files hold a copy of a
        pool.put([c], [block(rng, 50)])
        before = state(pool)
        missing = key(rng)
        with pytest.raises(NotInTier, match=f"key {missing.hex()} is not stored") as e:
            pool.drop([a, missing])
        assert isinstance(e.value, KeyError) and state(pool) == before
        pool.drop([a])  # a tombstone: the older file (still holding b) would bring a's first value back
        assert a not in pool and pool.used_bytes == 250 and pool.stats()["tombstones"] == 1
        pool.drop([c])  # c's only file is simply deleted
        assert pool.stats()["tombstones"] == 1
    with DiskPool(tmp_path, GiB) as pool:
        assert pool.keys() == [b] and pool.used_bytes == 200
        pool.drop([b])  # the last file holding a goes, and with it the tombstone
        assert len(pool) == 0 and files(tmp_path) == [] and pool.used_bytes == 0
        with pytest.raises(NotInTier, match=b.hex()):
            pool.get([b])


# ---- a writer killed mid-write --------------------------------------------------------------------------------
# The child loads only workbench.tiers.disk (stub packages skip the __init__s, which import torch: seconds), puts
# A version 1, then A version 2 with B and C through a writer that stops after its third chunk and says so.
CHILD = r"""
import sys, time, types
from pathlib import Path
repo, pool_dir, data = sys.argv[1:]
for name, sub in (("workbench", "workbench"), ("workbench.tiers", "workbench/tiers")):
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [str(Path(repo) / sub)]
from workbench.tiers.disk import DiskPool

blob = {n: (Path(data) / n).read_bytes() for n in ("a1", "a2", "b", "c")}
A, B, C = b"A" * 16, b"B" * 16, b"C" * 16
pool = DiskPool(pool_dir, 1 << 30)
pool.put([A], [blob["a1"]])
write, calls = DiskPool._write_chunk, [0]

def slow(self, fd, chunk):
    n = write(self, fd, chunk)
    calls[0] += 1
    if calls[0] == 3:
        print("mid-write", flush=True)
        time.sleep(60)
    return n

DiskPool._write_chunk = slow
pool.chunk_bytes = 64 << 10
pool.put([A, B, C], [blob["a2"], blob["b"], blob["c"]])
print("finished", flush=True)
"""


def test_writer_killed_mid_write(tmp_path, rng):
    data, pool_dir = tmp_path / "data", tmp_path / "pool"
    data.mkdir()
    blobs = {n: block(rng, size) for n, size in (("a1", 250_000), ("a2", 300_000), ("b", 70_000), ("c", 5))}
    for n, t in blobs.items():
        (data / n).write_bytes(t.numpy().tobytes())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO), str(pool_dir), str(data)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        died = proc.poll() is not None
        assert line == "mid-write\n", f"child said {line!r}; stderr: {proc.stderr.read() if died else ''}"
        assert len(list(pool_dir.glob("*.tmp"))) == 1
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    A, B, C = b"A" * 16, b"B" * 16, b"C" * 16
    with DiskPool(pool_dir, GiB) as pool:
        assert pool.keys() == [A] and same(pool.get([A])[0], blobs["a1"])
        assert B not in pool and C not in pool and pool.used_bytes == 250_000
        assert not list(pool_dir.glob("*.tmp"))
        pool.put([A, B], [blobs["a2"], blobs["b"]])
    with DiskPool(pool_dir, GiB) as pool:
        assert [same(g, blobs[n]) for g, n in zip(pool.get([A, B]), ("a2", "b"), strict=True)] == [True, True]


# ---- corruption -----------------------------------------------------------------------------------------------
def flip(path, offset):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_corrupt_data_is_caught(tmp_path, rng):
    keys, blocks = [key(rng) for _ in range(3)], [block(rng, n) for n in (1000, 2000, 3000)]
    with DiskPool(tmp_path, GiB, fsync=False) as pool:
        pool.put(keys, blocks)
        (seg,) = tmp_path.glob("seg-*.kv")
        offset = disk_format.ALIGN + 1000  # the format: data on the first page boundary, blocks in put order
        flip(seg, offset + 1234)
        with pytest.raises(CorruptBlock, match=rf"{keys[1].hex()} in .*{seg.name} at offset {offset}\b"):
            pool.get([keys[0], keys[1]])
        with pytest.raises(CorruptBlock, match=keys[1].hex()):
            pool.get_into([keys[1]], torch.empty(1, 2000, dtype=torch.uint8))
        assert same(pool.get([keys[2]])[0], blocks[2]) and same(pool.get([keys[0]])[0], blocks[0])
        with seg.open("r+b") as f:  # cut short: also a corrupt block, not a short tensor
            f.truncate(disk_format.ALIGN + 4000)
        with pytest.raises(CorruptBlock, match=keys[2].hex()):
            pool.get([keys[2]])


OFFSETS = {"magic": 0, "version": 8, "count": 12, "sequence": 16, "key": 24 + 8 + 3, "header checksum": 24 + 2 * 96 + 1}


@pytest.mark.parametrize("where", list(OFFSETS))
def test_corrupt_header_is_skipped(tmp_path, rng, where):
    k1, k2 = [key(rng), key(rng)], [key(rng)]
    b1, b2 = [block(rng, 500), block(rng, 600)], [block(rng, 700)]
    with DiskPool(tmp_path, GiB, fsync=False) as pool:
        pool.put(k1, b1)
        pool.put(k2, b2)
    seg = sorted(tmp_path.glob("seg-*.kv"))[0]
    flip(seg, OFFSETS[where])
    with pytest.warns(UserWarning, match=seg.name), DiskPool(tmp_path, GiB) as pool:
        assert pool.keys() == k2 and same(pool.get(k2)[0], b2[0]) and pool.used_bytes == 700
        assert seg.exists() and pool.stats()["skipped_files"] == [str(seg)]
        pool.put(k1[:1], b1[:1])  # a new segment gets a new name, the skipped file is kept
        assert seg.exists() and len(files(tmp_path)) == 3 and same(pool.get(k1[:1])[0], b1[0])


# ---- space ---------------------------------------------------------------------------------------------------
def test_disk_full_before_writing(tmp_path, rng):
    a, b = key(rng), key(rng)
    with DiskPool(tmp_path, 10_000, fsync=False) as pool:
        pool.put([a], [block(rng, 6000)])
        before = state(pool)
        with pytest.raises(DiskFull, match=r"needs 5000 more bytes but 4000 of capacity_bytes=10000") as e:
            pool.put([b], [block(rng, 5000)])
        assert isinstance(e.value, TierFull) and state(pool) == before
        pool.put([a, b], [block(rng, 9000), block(rng, 1000)])  # superseding a frees its 6000 bytes first
        assert pool.used_bytes == 10_000


@pytest.mark.parametrize("code, raised", [(errno.ENOSPC, DiskFull), (errno.EDQUOT, DiskFull), (errno.EIO, TierError)])
def test_write_error_leaves_pool_usable(tmp_path, rng, monkeypatch, code, raised):
    a, b = key(rng), key(rng)
    a1, a2, b1 = block(rng, 100_000), block(rng, 100_000), block(rng, 50_000)
    with DiskPool(tmp_path, GiB, fsync=False) as pool:
        pool.put([a], [a1])
        before = state(pool)
        calls = []
        write = DiskPool._write_chunk

        def failing(self, fd, chunk):
            calls.append(len(chunk))
            if len(calls) == 3:  # mid-file: the header and a chunk already written
                raise OSError(code, os.strerror(code))
            return write(self, fd, chunk)

        monkeypatch.setattr(DiskPool, "_write_chunk", failing)
        pool.chunk_bytes = 16 << 10
        with pytest.raises(raised, match="nothing was stored") as e:
            pool.put([a, b], [a2, b1])
        assert type(e.value) is raised and isinstance(e.value.__cause__, OSError)
        assert e.value.__cause__.errno == code
        assert state(pool) == before and not list(tmp_path.glob("*.tmp"))
        assert same(pool.get([a])[0], a1)
        monkeypatch.undo()
        pool.put([a, b], [a2, b1])
        assert same(pool.get([a])[0], a2) and same(pool.get([b])[0], b1)


# ---- lifetime and errors --------------------------------------------------------------------------------------
def test_one_pool_per_directory(tmp_path, rng):
    a = key(rng)
    pool = DiskPool(tmp_path, GiB, fsync=False)
    pool.put([a], [block(rng, 10)])
    with pytest.raises(TierError, match="in use"):
        DiskPool(tmp_path, GiB)
    pool.close()
    with pytest.raises(TierError, match="closed"):
        pool.get([a])
    with DiskPool(tmp_path, GiB) as again, pytest.raises(NotInTier, match=f"key {'01' * 16} is not stored") as e:
        assert a in again
        again.get([a, b"\x01" * 16])
    assert isinstance(e.value, KeyError) and not str(e.value).startswith("'")  # the message, not its repr


# ---- bad arguments --------------------------------------------------------------------------------------------
GOOD_KEYS = [bytes([i + 1]) * 16 for i in range(4)]
bad_key = st.one_of(st.just(b""), st.binary(min_size=65, max_size=80), st.text(max_size=4), st.integers(),
                    st.binary(min_size=1, max_size=8).map(bytearray), st.none())


BAD_BLOCKS = [  # factories (hypothesis hashes what it samples; a writable memoryview cannot be hashed)
    lambda: torch.empty(0, dtype=torch.uint8), lambda: b"", lambda: torch.ones(8, dtype=torch.float32),
    lambda: torch.ones(8, dtype=torch.int8), lambda: torch.ones(2, 4, dtype=torch.uint8),
    lambda: torch.ones(16, dtype=torch.uint8)[::2], lambda: "text", lambda: 7, lambda: None,
    lambda: np.ones((2, 4), dtype=np.uint8), lambda: np.ones(4, dtype=np.float32),
    lambda: memoryview(np.ones((2, 2), dtype=np.uint8)), lambda: torch.ones(8, dtype=torch.uint8).to("meta"),
]
bad_block = st.sampled_from(BAD_BLOCKS).map(lambda make: make())


@st.composite
def bad_put(draw):
    n = draw(st.integers(1, 4))
    keys, blocks = list(GOOD_KEYS[:n]), [torch.full((100 + i,), i + 1, dtype=torch.uint8) for i in range(n)]
    i = draw(st.integers(0, n - 1))
    what = draw(st.sampled_from(["key", "duplicate", "block", "count", "rows", "keys type", "blocks type"]))
    if what == "key":
        keys[i] = draw(bad_key)
    elif what == "duplicate":
        keys.insert(i, keys[draw(st.integers(0, n - 1))])
        blocks.insert(i, torch.ones(5, dtype=torch.uint8))
    elif what == "block":
        blocks[i] = draw(bad_block)
    elif what == "count":
        blocks = blocks[:-1] if draw(st.booleans()) else blocks + [torch.ones(3, dtype=torch.uint8)]
    elif what == "rows":
        blocks = torch.ones(n + draw(st.sampled_from([-1, 1])), 64, dtype=torch.uint8)
    elif what == "keys type":
        keys = draw(st.sampled_from([GOOD_KEYS[0], "k", 3, None, {GOOD_KEYS[0]}]))
    else:
        blocks = draw(st.sampled_from([b"\x01" * 64, "x", 5, None, torch.ones(64, dtype=torch.uint8)]))
    return keys, blocks


@pytest.fixture(scope="module")
def shared_pool(tmp_path_factory):
    with DiskPool(tmp_path_factory.mktemp("bad-args"), 1 << 20, fsync=False) as pool:
        pool.put(GOOD_KEYS[:2], [torch.full((64,), 9, dtype=torch.uint8), torch.full((64,), 8, dtype=torch.uint8)])
        yield pool


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=bad_put())
def test_bad_put_arguments(shared_pool, args):
    before = state(shared_pool)
    with pytest.raises(ValueError, match="keys|blocks"):
        shared_pool.put(*args)
    assert state(shared_pool) == before


@settings(max_examples=40, deadline=None)
@given(k=bad_key, i=st.integers(0, 2), op=st.sampled_from(["get", "get_into", "drop", "nbytes"]))
def test_bad_keys_everywhere(shared_pool, k, i, op):
    before = state(shared_pool)
    keys = GOOD_KEYS[:2]
    keys = keys[:i] + [k] + keys[i:]
    with pytest.raises(ValueError, match="key"):
        if op == "get":
            shared_pool.get(keys)
        elif op == "get_into":
            shared_pool.get_into(keys, torch.empty(3, 64, dtype=torch.uint8))
        elif op == "drop":
            shared_pool.drop(keys)
        else:
            shared_pool.nbytes(k)
    with pytest.raises(ValueError, match="distinct"):
        shared_pool.drop([GOOD_KEYS[0], GOOD_KEYS[1], GOOD_KEYS[0]])
    assert state(shared_pool) == before


def test_bad_constructor_arguments(tmp_path):
    for cap in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="capacity_bytes"):
            DiskPool(tmp_path, cap)
    with pytest.raises(ValueError, match="fsync"):
        DiskPool(tmp_path, 100, fsync=1)


def test_checksum_speed_against_crc32():
    """The numbers in the module docstring (xxh3_64 against zlib.crc32, 32 MiB): xxh3 must stay the faster."""
    buf = np.random.default_rng(0).integers(1, 256, 32 << 20, dtype=np.uint8)

    def gbps(f):
        best = min(_timed(f, buf) for _ in range(3))
        return buf.nbytes / best / 1e9

    xxh, crc = gbps(disk_format.checksum), gbps(zlib.crc32)
    print(f"\nxxh3_64 {xxh:.1f} GB/s, zlib.crc32 {crc:.2f} GB/s (32 MiB)")
    assert xxh > crc


def _timed(f, buf):
    t = time.perf_counter()
    f(buf)
    return time.perf_counter() - t
