"""The tiered cache (device -> pinned host -> disk): bit-exact round trips for every layout and storage scheme
(scales included), prefix demotion and promotion, swapping, the two copy paths, full tiers, corruption,
"not resident", and random operation sequences with bad inputs against invariants."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workbench.kernels.swap.reference import move_blocks_ref

import workbench
from workbench.allocator import AllocatorError, OutOfBlocks
from workbench.cache import PagedKVCache
from workbench.tiers.errors import CorruptBlock, HostFull, NotResident
from workbench.tiers.host import HostPool, contiguous_runs
from workbench.tiers.tiered import TieredCache
from workbench.tiers.transfer import block_bytes

pytestmark = pytest.mark.kernels  # TieredCache moves small batches with the SM-copy kernel

L, H, D = 2, 2, 32
DEV = workbench.device()  # CPU here and in CI; the H200 run checks the same on CUDA (pinned host, two streams)

SCHEMES = ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e4m3/token", "int8/token", "int8_asym/token", "int4/kivi",
           "int2/kivi"]


def _kv(n, seed, dtype=torch.float16, head_dim=D):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(L, n, H, head_dim, generator=g).to(dtype).to(DEV) for _ in range(2))


def _cache(kv_dtype="fp16", layout="nhd", pages=8, page_tokens=8, ops="torch", head_dim=D):
    kw = {}
    if kv_dtype in ("fp8_e4m3", "int8"):
        kw = dict(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.05]))
    return PagedKVCache(L, H, head_dim, num_pages=pages, page_tokens=page_tokens, layout=layout, kv_dtype=kv_dtype,
                        ops=ops, **kw)


def _raw(cache, seq):
    """The bytes of a sequence's blocks (codes, in-block scales and padding), in table order."""
    bs = cache.manager.block_size(seq)
    blocks = cache.blocks(bs)[:, :, cache.manager.block_table(seq)]
    return blocks.contiguous().view(torch.uint8).clone()


def _kv_of(tokens, first=0):
    """K/V that depend only on (token, position): equal prefixes have equal K/V, as in a real model."""
    ks, vs = [], []
    for p, t in enumerate(tokens, first):
        g = torch.Generator().manual_seed(t * 4099 + p)
        ks.append(torch.randn(L, 1, H, D, generator=g))
        vs.append(torch.randn(L, 1, H, D, generator=g))
    return torch.cat(ks, 1).half().to(DEV), torch.cat(vs, 1).half().to(DEV)


def _tokens(n, base=0):
    return [base + i for i in range(n)]


# ---- pieces --------------------------------------------------------------------------------------------------
def test_host_pool_places_a_batch_in_one_run_and_merges_freed_runs():
    pool = HostPool(10 * 64, 64, pin=False)
    a = pool.allocate([1, 1, 1])
    b = pool.allocate([2, 2])
    assert a == [0, 1, 2] and b == [3, 5] and pool.free_units == 3
    assert contiguous_runs(a + b, [1, 1, 1, 2, 2]) == [(0, 0, 7)]
    pool.free([1], [1])
    pool.free([5], [2])
    assert pool.runs() == [(1, 1), (5, 5)]
    assert pool.allocate([3]) == [5]  # the first run long enough
    with pytest.raises(HostFull, match="needs 4 units"):
        pool.allocate([4])
    assert pool.runs() == [(1, 1), (8, 2)]  # unchanged by the refusal
    with pytest.raises(ValueError, match="free already"):
        pool.free([1], [1])


@pytest.mark.parametrize("programs", [None, 1, 3])
def test_move_blocks_kernel_equals_its_reference_between_scattered_spaces(programs, device):
    from workbench.kernels import move_blocks

    g = torch.Generator().manual_seed(3)
    rows, row, nblk = 4, 192, 9
    src = torch.randint(0, 256, (rows * nblk * row,), dtype=torch.uint8, generator=g).to(device)
    got = torch.full((6 * rows * row + 64,), 0xAB, dtype=torch.uint8, device=device)  # poisoned
    want = got.clone()
    ids_s = torch.tensor([7, 0, 4, 2], dtype=torch.int64, device=device)
    ids_d = torch.tensor([5, 1, 0, 3], dtype=torch.int64, device=device)
    geo = dict(num_rows=rows, row_bytes=row, src_row_stride=nblk * row, src_block_stride=row, dst_row_stride=row,
               dst_block_stride=rows * row, dst_offset=64)
    move_blocks(src, ids_s, got, ids_d, num_programs=programs, **geo)
    move_blocks_ref(src, ids_s, want, ids_d, **geo)
    assert torch.equal(got, want)
    assert (got[:64] == 0xAB).all()  # nothing written before the space


# ---- round trips ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["nhd", "hnd", "vllm"])
@pytest.mark.parametrize("kv_dtype", SCHEMES)
def test_round_trip_device_host_disk_device_is_bit_exact(tmp_path, layout, kv_dtype):
    if layout == "vllm" and kv_dtype.endswith("kivi"):
        pytest.skip("the vllm layout cannot hold packed KIVI codes (the cache refuses it at construction)")
    kivi = kv_dtype.endswith("kivi")  # groups of 32 tokens, packed rows of >= 16 bytes: larger blocks and heads
    bs, dim, n = (32, 64, 140) if kivi else (8, D, 37)
    cache = _cache(kv_dtype, layout, pages=8, page_tokens=bs, head_dim=dim)
    unit = block_bytes(cache, bs)
    tc = TieredCache(cache, host_bytes=3 * unit, disk_path=tmp_path / "disk", disk_bytes=64 * unit, fsync=False)
    k, v = _kv(n, 1, head_dim=dim)
    tc.add("s", _tokens(n), k, v)
    raw, read = _raw(cache, "s"), cache.read("s")
    tc.swap_out(["s"])  # 5 blocks, 3 host units: the tail of the batch pushes the oldest to disk
    where = {r.tier for r in tc.block_table("s")}
    assert where == {"host", "disk"}, where
    tc.check_invariants()
    tc.evict()  # the device forgets the prefix: everything comes from below
    tc.swap_in(["s"])
    assert torch.equal(_raw(cache, "s"), raw)
    got = cache.read("s")
    assert torch.equal(got[0], read[0]) and torch.equal(got[1], read[1])
    tc.check_invariants()


@pytest.mark.parametrize("path", ["dma", "sm"])
def test_both_copy_paths_move_the_same_bytes(path):
    cache = _cache("int8/token", ops="kernels" if path == "sm" else "torch")
    tc = TieredCache(cache, host_bytes=16 * block_bytes(cache, 8), path=path)
    k, v = _kv(20, 2)
    tc.add("s", _tokens(20), k, v)
    raw = _raw(cache, "s")
    t = tc.swap_out(["s"])
    assert t.path == path and t.blocks == 3
    tc.evict()
    assert tc.swap_in(["s"]).path == path
    assert torch.equal(_raw(cache, "s"), raw)
    moves = tc.stats()["moves"]
    assert moves["device->host"]["bytes"] == moves["host->device"]["bytes"] == 3 * block_bytes(cache, 8)
    assert moves["device->host"]["copies"] == 1  # one batch, one copy (one DMA, or one kernel launch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an ordering of two CUDA streams: needs a GPU (on a CPU "
                    "every move is synchronous)")
def test_a_dma_swap_out_gathers_with_positions_made_on_its_own_stream():
    """Regression (H200: a round trip through the disk lost a block's bytes, int8/token hnd): the swap-out gather
    runs on the current stream, but its staging positions were an arange queued on the side stream, so with the
    side stream busy the gather read them unwritten (stale zeros here) and put every block in the wrong place."""
    cache = _cache("int8/token", "hnd")
    tc = TieredCache(cache, host_bytes=16 * block_bytes(cache, 8), path="dma")
    k, v = _kv(37, 1)
    tc.add("s", _tokens(37), k, v)
    ids = cache.manager.block_table("s")
    raw = _raw(cache, "s")  # [layers, 2, blocks, row bytes]
    want = raw.permute(2, 0, 1, 3).reshape(len(ids), -1).cpu()  # block-major, as the host and disk tiers keep it
    mover = tc.lower.mover
    for _ in range(3):
        with torch.cuda.stream(mover.side):
            torch.zeros(len(ids), dtype=torch.int64, device=cache.device)  # freed: stale zeros for the next ids
        torch.cuda.synchronize()
        with torch.cuda.stream(mover.side):
            torch.cuda._sleep(50_000_000)  # the side stream busy for tens of ms
        buf = torch.full((len(ids), block_bytes(cache, 8)), 7, dtype=torch.uint8, pin_memory=True)
        mover.to_buffer(8, ids, buf).synchronize()
        assert torch.equal(buf, want)


# ---- the prefix cache across tiers -----------------------------------------------------------------------------
def test_evicted_prefix_is_demoted_then_promoted_by_a_later_hit():
    cache = _cache(pages=4)  # 4 blocks of 8
    tc = TieredCache(cache, host_bytes=8 * block_bytes(cache, 8))
    prompt = _tokens(25, 100)
    k, v = _kv(25, 3)
    tc.add("a", prompt, k, v)
    want = cache.read("a")
    tc.free("a")  # 3 full blocks stay cached on the device
    for i in range(2):  # other prompts need the memory: the allocator evicts a's blocks, the tier keeps them
        tc.add(f"x{i}", _tokens(16, 1000 * (i + 1)), *_kv(16, 10 + i))
        tc.free(f"x{i}")
    s = tc.stats()
    assert s["demoted"] >= 3 and s["dropped"] == 0
    before = cache.manager.pool.hits
    kk, vv = _kv(25, 99)  # different K/V for the prompt: hit tokens must come from the tier, not from these
    p = tc.add("b", prompt, kk, vv)
    assert p.first == 24  # 3 blocks found below the device, promoted, hit; only the last token computed
    assert cache.manager.pool.hits - before == 3
    got = cache.read("b")
    assert torch.equal(got[0][:, :24], want[0][:, :24]) and torch.equal(got[1][:, :24], want[1][:, :24])
    assert tc.stats()["promoted_host"] == 3
    tc.check_invariants()


def test_read_prefix_promotes_and_reads_what_add_will_reuse():
    cache = _cache(pages=3)
    tc = TieredCache(cache, host_bytes=8 * block_bytes(cache, 8))
    prompt = _tokens(17, 5)
    k, v = _kv(17, 4)
    tc.add("a", prompt, k, v)
    want = cache.read("a")
    tc.free("a")
    tc.evict()  # forget everything on the device (demoted: the tier is listening)
    assert cache.manager.pool.cached_blocks() == 0
    pk, pv = tc.read_prefix(prompt)
    assert pk.shape[1] == 16 and torch.equal(pk, want[0][:, :16]) and torch.equal(pv, want[1][:, :16])


@pytest.mark.parametrize("policy, survivor", [("lru", "p1"), ("lfu", "p0"), ("priority", "p1")])
def test_host_eviction_order_follows_the_policy(policy, survivor):
    """p0: demoted first, then hit twice (LFU keeps it); p1: demoted last, priority 5 (LRU and priority keep it)."""
    cache = _cache(pages=2, page_tokens=8)
    tc = TieredCache(cache, host_bytes=2 * block_bytes(cache, 8), eviction=policy)  # two blocks below, no disk
    prompts = {f"p{i}": _tokens(9, 100 * (i + 1)) for i in range(3)}

    def visit(seq, name, priority=0):
        tc.add(seq, prompts[name], *_kv(9, len(seq)), priority=priority)
        tc.free(seq)
        tc.evict()  # its full block leaves the device (demoted, or already below)

    visit("p0", "p0")
    visit("again", "p0")
    visit("again2", "p0")
    visit("p1", "p1", priority=5)
    assert {e.hits for e in tc.entries.values()} == {2, 0}
    visit("p2", "p2")  # needs a host unit: p0 or p1 leaves (no disk: dropped)
    kept = {name for name in ("p0", "p1") if tc.digests(prompts[name], 8, None, 1)[0] in tc.entries}
    assert kept == {survivor}
    assert tc.stats()["host"]["blocks"] == 2


# ---- swapping and residency ---------------------------------------------------------------------------------------
def test_decode_of_a_swapped_sequence_fetches_it_or_says_where_its_blocks_are(tmp_path):
    cache = _cache(pages=6)
    unit = block_bytes(cache, 8)
    q = torch.randn(1, H, D, dtype=torch.float16, device=DEV)
    tc = TieredCache(cache, host_bytes=2 * unit, disk_path=tmp_path / "d", disk_bytes=32 * unit, on_miss="raise",
                     fsync=False)
    tc.add("s", _tokens(30), *_kv(30, 5))
    want = tc.decode(q, ["s"], 1)
    tc.swap_out(["s"])
    with pytest.raises(NotResident, match=r"sequence 's': \d blocks on host, \d on disk"):
        tc.decode(q, ["s"], 1)
    fetch = TieredCache.__new__(TieredCache)
    fetch.__dict__.update(tc.__dict__)
    fetch.on_miss = "fetch"
    assert torch.equal(fetch.decode(q, ["s"], 1), want)
    assert tc.is_resident("s")


def test_a_swapped_sequence_survives_pressure_on_the_host_tier_by_moving_to_disk(tmp_path):
    cache = _cache(pages=8)
    unit = block_bytes(cache, 8)
    tc = TieredCache(cache, host_bytes=4 * unit, disk_path=tmp_path / "d", disk_bytes=64 * unit, fsync=False)
    tc.add("s", _tokens(30), *_kv(30, 6))
    raw = _raw(cache, "s")
    tc.swap_out(["s"])
    for i in range(6):  # churn: other prompts come and go, their prefixes are demoted and push s's blocks down
        tc.add(f"x{i}", _tokens(24, 1000 * (i + 1)), *_kv(24, 20 + i))
        tc.free(f"x{i}")
        tc.evict()
    assert any(r.tier == "disk" for r in tc.block_table("s"))
    tc.swap_in(["s"])
    assert torch.equal(_raw(cache, "s"), raw)
    tc.check_invariants()


def test_full_host_without_disk_refuses_a_swap_and_changes_nothing():
    cache = _cache(pages=8)
    tc = TieredCache(cache, host_bytes=2 * block_bytes(cache, 8))
    tc.add("s", _tokens(30), *_kv(30, 7))
    table, stats = cache.manager.block_table("s"), tc.stats()
    with pytest.raises(HostFull, match="needs 4 units"):
        tc.swap_out(["s"])
    assert tc.is_resident("s") and cache.manager.block_table("s") == table
    assert tc.stats()["host"] == stats["host"]
    tc.check_invariants()


def test_swap_in_without_device_room_raises_and_leaves_it_swapped():
    cache = _cache(pages=4)
    tc = TieredCache(cache, host_bytes=16 * block_bytes(cache, 8))
    tc.add("s", _tokens(30), *_kv(30, 8))
    tc.swap_out(["s"])
    tc.add("big", _tokens(32, 500), *_kv(32, 9))  # takes the whole device
    with pytest.raises(OutOfBlocks):
        tc.swap_in(["s"])
    assert not tc.is_resident("s")
    tc.free("big")
    tc.swap_in(["s"])
    tc.check_invariants()


def test_a_flipped_byte_on_disk_is_named_on_promotion(tmp_path):
    cache = _cache(pages=8)
    unit = block_bytes(cache, 8)
    tc = TieredCache(cache, host_bytes=1 * unit, disk_path=tmp_path / "d", disk_bytes=8 * unit, fsync=False)
    tc.add("s", _tokens(17), *_kv(17, 11))
    tc.swap_out(["s"])  # 3 blocks, 1 host unit: two on disk
    seg = sorted((tmp_path / "d").glob("seg-*.kv"))[0]
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0x40
    seg.write_bytes(bytes(data))
    tc.evict()
    with pytest.raises(CorruptBlock, match="checksum"):
        tc.swap_in(["s"])


def test_fork_and_kivi_residual_survive_a_swap():
    cache = _cache("int4/kivi", pages=8, page_tokens=32)
    tc = TieredCache(cache, host_bytes=16 * block_bytes(cache, 32))
    k, v = _kv(40, 12)
    tc.add("a", _tokens(40), k, v)
    tc.fork("a", "b")
    want = cache.read("b")
    assert cache.residual("b") is not None  # KIVI keeps the newest tokens in fp16, outside the blocks
    tc.swap_out(["b"])
    tc.swap_in(["b"])
    got = cache.read("b")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    tc.free("a")
    tc.free("b")
    tc.check_invariants()


# ---- bad input, checked before anything changes ---------------------------------------------------------------
def test_bad_arguments_are_refused_naming_them(tmp_path):
    cache = _cache()
    with pytest.raises(ValueError, match="cache must be a PagedKVCache"):
        TieredCache(object(), host_bytes=1 << 20)
    with pytest.raises(ValueError, match="on_miss"):
        TieredCache(cache, host_bytes=1 << 20, on_miss="wait")
    with pytest.raises(ValueError, match="eviction must be one of"):
        TieredCache(cache, host_bytes=1 << 20, eviction="fifo")
    with pytest.raises(ValueError, match="disk_bytes"):
        TieredCache(cache, host_bytes=1 << 20, disk_path=tmp_path)
    with pytest.raises(ValueError, match="path must be one of"):
        TieredCache(cache, host_bytes=1 << 20, path="pcie")
    tc = TieredCache(cache, host_bytes=1 << 20)
    with pytest.raises(ValueError, match="already has a tier"):
        TieredCache(cache, host_bytes=1 << 20)
    tc.add("s", _tokens(9), *_kv(9, 0))
    for bad, match in ((["s", "s"], "must not repeat"), ([], "non-empty"), ("s", "non-empty")):
        with pytest.raises(ValueError, match=match):
            tc.swap_out(bad)
    with pytest.raises(ValueError, match="is not swapped out"):
        tc.swap_in(["s"])
    with pytest.raises(ValueError, match="priority must be an int"):
        tc.add("t", _tokens(3), *_kv(3, 0), priority="high")
    tc.check_invariants()


def apply_op(tc, want: dict, op: str, i: int, n: int, step: int, bad, errors: tuple) -> None:
    """One step of a generated operation sequence on ``tc``, ``want`` (seq -> tokens, k, v as written) kept beside
    it; ``"bad"`` calls one of ``bad()``'s refusals (picked by ``n``), which must raise one of ``errors`` and change
    nothing. A full tier or device refuses (nothing changes: the caller's checks say so)."""
    cache, s = tc.cache, f"s{i}"
    try:
        if op == "add" and s not in want:
            toks = _tokens(n, 7 * (i % 2))  # two prompt families: shared prefixes
            k, v = _kv_of(toks)
            tc.add(s, toks, k, v)
            want[s] = (toks, k, v)
        elif op == "append" and s in want and tc.is_resident(s):
            k, v = _kv_of([step], first=len(want[s][0]))
            tc.append(s, [step], k, v)
            t, k0, v0 = want[s]
            want[s] = (t + [step], torch.cat([k0, k], 1), torch.cat([v0, v], 1))
        elif op == "free" and s in want:
            tc.free(s)
            del want[s]
        elif op == "swap_out" and s in want and tc.is_resident(s):
            tc.swap_out([s])
        elif op == "swap_in" and s in want and not tc.is_resident(s):
            tc.swap_in([s])
        elif op == "fork" and s in want and tc.is_resident(s) and f"f{step}" not in want:
            tc.fork(s, f"f{step}")
            want[f"f{step}"] = want[s]
        elif op == "evict":
            tc.evict(n)
        elif op == "bad":
            snapshot = (cache.manager.fingerprint(), tc.stats()["host"], len(tc.entries))
            calls = bad()
            with pytest.raises(errors):
                calls[n % len(calls)]()
            assert (cache.manager.fingerprint(), tc.stats()["host"], len(tc.entries)) == snapshot
    except (OutOfBlocks, HostFull):
        pass


OPS = st.lists(st.tuples(st.sampled_from(["add", "append", "free", "swap_out", "swap_in", "fork", "evict", "bad"]),
                         st.integers(0, 3), st.integers(1, 20)), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_operations_keep_every_sequence_exact_and_the_tiers_consistent(ops):
    """An fp16 cache reads back exactly what was written: after any sequence of adds, appends, forks, swaps,
    evictions and refused bad calls, every sequence reads its own K/V, and the invariants hold."""
    cache = _cache(pages=6, page_tokens=4)
    tc = TieredCache(cache, host_bytes=10 * block_bytes(cache, 4))
    want: dict = {}  # seq -> (tokens, k, v) as written
    for step, (op, i, n) in enumerate(ops):
        s = f"s{i}"
        bad = lambda s=s: [lambda: tc.swap_in([s] if s in want and tc.is_resident(s) else ["nobody"]),  # noqa: E731
                           lambda: tc.swap_out(["nobody"]),
                           lambda: tc.add("z", [], *_kv(0, 0)),
                           lambda: tc.fork("nobody", "y")]
        apply_op(tc, want, op, i, n, step, bad, (ValueError, AllocatorError))
        tc.check_invariants()
        for seq, (toks, k, v) in want.items():
            if tc.is_resident(seq):
                assert cache.manager.tokens(seq) == toks
                got = cache.read(seq)
                assert torch.equal(got[0], k.float()) and torch.equal(got[1], v.float()), seq


def test_host_memory_the_os_refuses_raises_host_full(monkeypatch):
    real = torch.empty

    def refuse(*a, **kw):
        if kw.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real(*a, **kw)

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(HostFull, match="cannot pin"):
        HostPool(1 << 20, 4096, pin=True)


def test_full_disk_refuses_a_swap_before_anything_moves(tmp_path):
    from workbench.tiers.errors import DiskFull

    cache = _cache(pages=8)
    unit = block_bytes(cache, 8)
    tc = TieredCache(cache, host_bytes=1 * unit, disk_path=tmp_path / "d", disk_bytes=2 * unit, fsync=False)
    tc.add("s", _tokens(30), *_kv(30, 13))  # 4 blocks: 1 fits on the host, 3 would overflow a 2-block disk
    table = cache.manager.block_table("s")
    with pytest.raises(DiskFull, match="on disk beyond the host tier"):
        tc.swap_out(["s"])
    assert tc.is_resident("s") and cache.manager.block_table("s") == table and not tc.entries
    assert not list((tmp_path / "d").glob("seg-*"))
    tc.free("s")  # the cache stays usable: a shorter sequence swaps fine
    tc.add("t", _tokens(10, 77), *_kv(10, 14))
    tc.swap_out(["t"])
    tc.swap_in(["t"])
    tc.check_invariants()
