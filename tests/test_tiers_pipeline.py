"""A transcoding move in chunks (``workbench.tiers.pipeline``): how a batch is cut and how host runs fall in the
chunks (pure, on random batches), and moves through the mover cut into many chunks, over host runs broken at
random places, equal byte for byte to the same move in one chunk, both ways (on the GPU: the encode and decode
on their own stream beside the copies)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import workbench
from workbench.cache import PagedKVCache
from workbench.tiers import pipeline
from workbench.tiers.host import contiguous_runs
from workbench.tiers.tiered import TieredCache

L, H, D, BS = 2, 2, 32, 32
DEV = workbench.device()


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), block_bytes=st.integers(1, 1 << 20), chunk_bytes=st.one_of(st.none(),
       st.integers(1, 64 << 20)), max_chunks=st.integers(1, 12))
def test_chunks_cover_the_batch_in_order_and_are_as_large_as_asked(n, block_bytes, chunk_bytes, max_chunks):
    chunks = pipeline.chunk_ranges(n, block_bytes, chunk_bytes, max_chunks)
    if n == 0:
        assert chunks == []
        return
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a < b for a, b in chunks) and all(chunks[i][1] == chunks[i + 1][0] for i in range(len(chunks) - 1))
    assert 1 <= len(chunks) <= max_chunks
    sizes = [b - a for a, b in chunks]
    assert max(sizes) - min(sizes) <= 1  # as equal as whole blocks allow
    if chunk_bytes is None:
        assert len(chunks) == 1
    elif len(chunks) > 1:
        assert min(sizes) * block_bytes >= chunk_bytes  # every chunk as large as asked
    if chunk_bytes is not None and len(chunks) < max_chunks:
        assert (n // (len(chunks) + 1)) * block_bytes < chunk_bytes  # and no more of them would be


@pytest.mark.parametrize("bad", [dict(n=-1), dict(block_bytes=0), dict(chunk_bytes=0), dict(max_chunks=0),
                                 dict(n=True), dict(chunk_bytes=1.5)])
def test_bad_chunk_arguments_are_refused_naming_them(bad):
    args = dict(n=4, block_bytes=16, chunk_bytes=32, max_chunks=4) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        pipeline.chunk_ranges(**args)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12), lo=st.integers(0, 120), width=st.integers(0, 40))
def test_run_pieces_are_the_runs_cut_at_the_chunk(sizes, lo, width):
    runs, first = [], 0
    for s in sizes:
        runs.append((first, s))
        first += s
    hi = lo + width
    pieces = pipeline.run_pieces(runs, lo, hi)
    covered = [b for _, a, c in pieces for b in range(a, c)]
    assert covered == [b for b in range(lo, hi) if b < first]  # every block of the chunk once, in batch order
    for i, a, c in pieces:
        assert runs[i][0] <= a < c <= runs[i][0] + runs[i][1]


def _filled(kv_dtype="fp16", pages=24):
    cache = PagedKVCache(L, H, D, num_pages=pages, page_tokens=BS, kv_dtype=kv_dtype, prefix_caching=False)
    g = torch.Generator().manual_seed(3)
    blocks = cache.blocks(BS)
    if blocks.dtype.is_floating_point:
        blocks.copy_(torch.randn(blocks.shape, generator=g).to(blocks.dtype))
    else:
        blocks.copy_(torch.randint(-100, 100, blocks.shape, generator=g).to(blocks.dtype))
    return cache


@pytest.mark.kernels
@pytest.mark.parametrize("host_format, seed", [("int4/token", 0), ("fp8_e4m3/token", 1), ("int4/kivi", 2)])
def test_a_move_in_chunks_equals_the_move_at_once_both_ways(host_format, seed):
    cache = _filled()
    tc = TieredCache(cache, host_bytes=1 << 22, host_format=host_format, fsync=False, path="dma")
    try:
        mover, host = tc.lower.mover, tc.lower.host
        g = torch.Generator().manual_seed(seed)
        n = 11
        ids = torch.randperm(cache.manager.pool.num_blocks(BS), generator=g)[:n].tolist()
        u = mover.units(BS)
        # host places broken at random: runs of 1-4 blocks, some adjacent (one copy), some not
        starts, at = [], 0
        for i in range(n):
            at += u * int(torch.randint(0, 2, (1,), generator=g)) if i else 0
            starts.append(at)
            at += u
        assert len(contiguous_runs(starts, u)) > 1
        got = {}
        for chunk_bytes in (None, 1):  # the batch at once, then in as many chunks as allowed
            mover.chunk_bytes = chunk_bytes
            assert len(mover.chunks(n, BS)) == (1 if chunk_bytes is None else min(n, pipeline.MAX_CHUNKS))
            host.buffer.view(torch.uint8).fill_(0xAB)  # poisoned: a unit the move skipped shows
            mover.to_host(BS, ids, starts).synchronize()
            wire = torch.stack([host.view(s, u).clone() for s in starts])
            back = [b for b in range(cache.manager.pool.num_blocks(BS)) if b not in ids][:n]
            cache.blocks(BS)[:, :, back] = float("nan") if cache.blocks(BS).dtype.is_floating_point else 0
            mover.to_device(BS, starts, back).synchronize()
            got[chunk_bytes] = (wire, cache.blocks(BS)[:, :, back].clone())
        assert torch.equal(got[None][0], got[1][0]), "host bytes differ between one chunk and many"
        assert torch.equal(got[None][1].view(torch.uint8), got[1][1].view(torch.uint8)), "promoted blocks differ"
    finally:
        tc.close()


def test_chunk_bytes_is_checked_when_set():
    cache = _filled(pages=4)
    tc = TieredCache(cache, host_bytes=1 << 20, host_format="int4/token", fsync=False)
    try:
        with pytest.raises(ValueError, match="chunk_bytes"):
            tc.lower.mover.chunk_bytes = 0
        assert tc.lower.mover.chunk_bytes == pipeline.CHUNK_BYTES
    finally:
        tc.close()
