"""Tiers where they meet sharing (issue 30, item 4): swapping and promotion keep reference counts and sharing as
they were (a shared block travels once and comes back shared), all or nothing; an eviction batch the host cannot
hold spills to disk; a corrupt disk block is dropped and counted, never raised for ever; ``add`` of an existing id
changes nothing; argument errors name the argument; compaction of a tiered cache is refused; and a property test
of random interleavings on device + host + disk checking invariants, bytes and sharing after every step."""

import tempfile
from collections import Counter

import pytest
import torch
from conftest import bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_allocator import snapshot
from test_tiers_cache import _kv_of  # K/V that depend only on (token, position): equal prefixes share

import workbench
from workbench.allocator import AllocatorError, OutOfBlocks, SequenceExists, UnknownSequence
from workbench.cache import PagedKVCache, compaction
from workbench.tiers.errors import CorruptBlock, DiskFull, HostFull, TierFull
from workbench.tiers.tiered import TieredCache
from workbench.tiers.transfer import block_bytes

pytestmark = pytest.mark.kernels  # TieredCache moves small batches with the SM-copy kernel

L, H, D = 2, 2, 32
DEV = workbench.device()


def _tiered(tmp, pages=16, page_tokens=4, host=2, disk=64, **kw):
    cache = PagedKVCache(L, H, D, num_pages=pages, page_tokens=page_tokens, **kw)
    unit = block_bytes(cache, page_tokens)
    disk_kw = dict(disk_path=tmp, disk_bytes=disk * unit) if disk else {}
    return cache, TieredCache(cache, host_bytes=host * unit, fsync=False, **disk_kw)


def _state(tc):
    """Everything a failed operation must leave as it was: allocator, device bytes, entries, disk, swapped set."""
    low = tc.lower
    entries = {d: tuple(vars(e).values()) for d, e in low.entries.items()}
    disk = sorted(low.disk.keys()) if low.disk is not None else None
    return (snapshot(tc.cache.manager), bits(tc.cache.pool).clone(), entries, disk, low.host.runs(),
            {s: list(sw.keys) for s, sw in tc._swapped.items()}, dict(tc._entry_digest))


def _same(tc, before):
    after = _state(tc)
    assert after[0] == before[0], "the allocator changed"
    assert torch.equal(after[1], before[1]), "device bytes changed"
    assert after[2:] == before[2:], "the tiers changed"


def _check_bytes(cache, want):
    for s, (toks, k, v) in want.items():
        assert cache.manager.tokens(s) == toks, s
        got = cache.read(s)
        assert torch.equal(got[0], k.float()) and torch.equal(got[1], v.float()), s


def _add(tc, want, s, toks):
    k, v = _kv_of(toks)
    tc.add(s, toks, k, v)
    want[s] = (toks, k, v)


def _append(tc, want, s, new):
    toks, k0, v0 = want[s]
    k, v = _kv_of(new, first=len(toks))
    tc.append(s, new, k, v)
    want[s] = (toks + new, torch.cat([k0, k], 1), torch.cat([v0, v], 1))


def _sharing(cache, batch):
    """Per (sequence, logical block) of ``batch``: (device block, shared with a sequence outside, the block the
    prefix map holds for that sequence's published prefix)."""
    m, pool = cache.manager, cache.manager.pool
    holders = Counter((m.block_size(s), b) for s in batch for b in m.block_table(s))
    out = {}
    for s in batch:
        bs, ent = m.block_size(s), m.published(s)
        for i, b in enumerate(m.block_table(s)):
            out[(s, i)] = (b, pool.ref_count(bs, b) > holders[(bs, b)], i < len(ent) and pool.entry_id(bs, b) == ent[i])
    return out


def _assert_sharing_kept(cache, batch, before):
    """The blocks the batch shared among itself are shared exactly so again; a published block it shared with a
    sequence outside is that very block again; reference counts as they were."""
    after = _sharing(cache, batch)
    assert list(after) == list(before)
    label_b, label_a = {}, {}
    for key in before:
        assert label_b.setdefault(before[key][0], key) == label_a.setdefault(after[key][0], key), \
            f"{key}: sharing changed"
    m = cache.manager
    holders = Counter((m.block_size(s), b) for s in batch for b in m.block_table(s))
    for (s, i), (b, outside, registered) in before.items():
        b2 = after[(s, i)][0]
        if outside and registered:
            assert b2 == b, f"{(s, i)}: a published block shared outside the batch came back as another block"
        if not outside:
            assert m.pool.ref_count(m.block_size(s), b2) == holders[(m.block_size(s), b2)], (s, i)


# ---- regressions: the examples ---------------------------------------------------------------------------
def test_undiverged_fork_overflowing_to_disk_travels_once_and_comes_back_shared(tmp_path):
    """Issue: the disk batch listed one device block twice (``device_ids must be distinct ... [1, 2, 2]``)."""
    cache, tc = _tiered(tmp_path, host=1)
    want = {}
    _add(tc, want, "a", list(range(10)))  # 3 blocks of 4, the last partly filled
    tc.fork("a", "b")
    want["b"] = want["a"]
    before = _sharing(cache, ["a", "b"])
    t_blocks = tc.stats()["moves"].get("device->host", {}).get("blocks", 0)
    tc.swap_out(["a", "b"])
    s = tc.stats()
    assert s["host"]["blocks"] + s["disk"]["blocks"] == 3  # each shared block once
    assert tc.block_table("a") == tc.block_table("b")
    assert s["moves"].get("device->host", {}).get("blocks", 0) - t_blocks + s["to_disk"] <= 3
    tc.evict()
    tc.swap_in(["a", "b"])
    _assert_sharing_kept(cache, ["a", "b"], before)
    assert cache.manager.ref_counts("a") == [2, 2, 2]
    _check_bytes(cache, want)
    tc.check_invariants()
    assert not tc.entries or all(not e.private for e in tc.entries.values())  # private copies gone with them


def test_beams_with_diverged_tails_swap_with_their_common_blocks_once(tmp_path):
    cache, tc = _tiered(tmp_path, host=2)
    want = {}
    _add(tc, want, "root", list(range(9)))
    for i in range(3):
        tc.fork("root", f"beam{i}")
        want[f"beam{i}"] = want["root"]
        _append(tc, want, f"beam{i}", [500 + i, 600 + i, 700 + i, 800 + i])  # copy-on-write of the shared tail
    tc.free("root")
    del want["root"]
    batch = list(want)
    before = _sharing(cache, batch)
    used = cache.manager.pool.used_slots()
    tc.swap_out(batch)
    tc.evict()
    tc.swap_in(batch)
    assert cache.manager.pool.used_slots() == used
    _assert_sharing_kept(cache, batch, before)
    _check_bytes(cache, want)
    tc.check_invariants()


def test_prefix_sharers_come_back_from_disk_shared(tmp_path):
    """Issue: ``keys must be distinct`` on swap_in; the device kept their blocks while the tier listed them swapped
    out, a retry got OutOfBlocks, and check_invariants() did not notice."""
    cache, tc = _tiered(tmp_path, host=1)
    want = {}
    for i in range(2):
        _add(tc, want, f"s{i}", list(range(12)) + [100 + i] * 4)
    before = _sharing(cache, ["s0", "s1"])
    tc.swap_out(["s0", "s1"])
    tc.evict()  # the device forgets the prefix: the shared blocks come from host and disk
    assert {r.tier for r in tc.block_table("s0")} == {"host", "disk"}
    tc.swap_in(["s0", "s1"])
    _assert_sharing_kept(cache, ["s0", "s1"], before)
    _check_bytes(cache, want)
    tc.check_invariants()


def test_three_sharers_through_the_host_keep_their_sharing(tmp_path):
    """Issue: through the host only, every sequence got its own copy of the common prefix (device slots 40 -> 72)."""
    cache, tc = _tiered(tmp_path, host=64, disk=0)
    want = {}
    for i in range(3):
        _add(tc, want, f"s{i}", list(range(16)) + [100 + i] * 6)  # 4 shared blocks + 2 own each: 10 blocks
    assert cache.manager.pool.used_slots() == 40
    before = _sharing(cache, list(want))
    tc.swap_out(list(want))
    tc.evict()
    tc.swap_in(list(want))
    assert cache.manager.pool.used_slots() == 40
    _assert_sharing_kept(cache, list(want), before)
    _check_bytes(cache, want)
    tc.check_invariants()


def test_swap_out_that_does_not_fit_writes_nothing_and_changes_nothing(tmp_path):
    cache, tc = _tiered(tmp_path, host=1, disk=2)
    want = {}
    _add(tc, want, "a", list(range(15)))  # 4 blocks: 1 on the host, 3 would overflow a 2-block disk
    tc.fork("a", "b")
    before = _state(tc)
    with pytest.raises(DiskFull):
        tc.swap_out(["a", "b"])
    _same(tc, before)
    assert not list(tmp_path.glob("seg-*"))
    tc.check_invariants()


def test_swap_in_refused_leaves_device_and_tier_as_before_and_a_retry_works(tmp_path):
    cache, tc = _tiered(tmp_path, pages=8, host=1)
    want = {}
    for i in range(2):
        _add(tc, want, f"s{i}", list(range(12)) + [100 + i] * 4)
    tc.swap_out(["s0", "s1"])
    tc.evict()
    _add(tc, {}, "big", list(range(1000, 1024)))  # 6 of the 8 blocks: 5 needed
    before = _state(tc)
    with pytest.raises(OutOfBlocks, match="needs 5 new blocks"):
        tc.swap_in(["s0", "s1"])
    _same(tc, before)
    tc.check_invariants()
    tc.free("big")
    tc.swap_in(["s0", "s1"])
    _check_bytes(cache, want)
    tc.check_invariants()


def _corrupt(tc, key, at=7):
    """Flip a byte of the disk copy of ``key`` (its data, not the segment's header)."""
    disk = tc.lower.disk
    e = disk._index[key]
    path = disk._segments[e.seq].path
    data = bytearray(path.read_bytes())
    data[e.offset + at % e.nbytes] ^= 0x5A
    path.write_bytes(bytes(data))


def test_corrupt_block_of_a_swapped_sequence_fails_its_swap_in_alone(tmp_path):
    cache, tc = _tiered(tmp_path, host=1)
    want = {}
    for i in range(2):
        _add(tc, want, f"s{i}", list(range(12)) + [100 + i] * 4)
    tc.swap_out(["s0", "s1"])
    tc.evict()
    key = next(k for k in tc._swapped["s1"].keys if tc.entries[k].tier == "disk" and k not in tc._swapped["s0"].keys)
    _corrupt(tc, key)
    before = _state(tc)
    with pytest.raises(CorruptBlock, match=r"\['s1'\] cannot come back"):
        tc.swap_in(["s0", "s1"])
    assert tc.stats()["corrupt"] == 1 and tc.entries[key].corrupt
    state = _state(tc)
    assert state[0] == before[0] and torch.equal(state[1], before[1]) and state[3:] == before[3:]
    tc.check_invariants()
    with pytest.raises(CorruptBlock, match="'s1' cannot come back"):  # known now: no second read
        tc.swap_in(["s1"])
    tc.swap_in(["s0"])
    _check_bytes(cache, {"s0": want["s0"]})
    tc.free("s1")  # its corrupt block goes with it
    assert key not in tc.entries and tc.stats()["corrupt"] == 1
    tc.check_invariants()


@pytest.mark.parametrize("how", ["swap_out", "evict"])
def test_a_corrupt_pinned_copy_is_replaced_by_the_devices_good_block(tmp_path, how):
    cache, tc = _tiered(tmp_path, host=1)
    want = {}
    prompt = list(range(13))  # 3 published blocks and a tail
    _add(tc, want, "x", prompt)
    tc.swap_out(["x"])
    tc.evict()
    key = next(k for k in tc._swapped["x"].keys[:3] if tc.entries[k].tier == "disk")
    _corrupt(tc, key)
    with pytest.raises(CorruptBlock):
        tc.swap_in(["x"])
    assert tc.entries[key].corrupt
    _add(tc, want, "y", prompt)  # promotion stops before the corrupt block: y computes it again
    if how == "swap_out":
        tc.swap_out(["y"])  # its good copy supersedes the corrupt one
    else:
        tc.free("y")
        del want["y"]
        tc.evict()  # demotion replaces the corrupt copy
    assert not tc.entries[key].corrupt and tc.stats()["corrupt"] == 1
    tc.check_invariants()
    tc.swap_in(list(tc._swapped))
    _check_bytes(cache, want)
    tc.check_invariants()


def test_eviction_batch_larger_than_the_host_spills_to_disk(tmp_path):
    """Issue: a fresh 33-token sequence freed, then a 64-token add on a small pool: 4 blocks dropped, host and disk
    empty."""
    cache, tc = _tiered(tmp_path, pages=8, page_tokens=8, host=2)
    prompt = list(range(33))
    k, v = _kv_of(prompt)
    tc.add("a", prompt, k, v)
    tc.free("a")  # 4 full blocks stay cached on the device
    _add(tc, {}, "b", list(range(1000, 1064)))  # the whole pool: the 4 are evicted in one batch
    s = tc.stats()
    assert (s["dropped"], s["demoted"], s["host"]["blocks"], s["disk"]["blocks"]) == (0, 4, 2, 2)
    tc.free("b")
    kk, vv = _kv_of(list(range(2000, 2033)))  # other K/V: hit tokens must come from the tiers
    assert tc.add("a2", prompt, kk, vv).first == 32
    got = cache.read("a2")
    assert torch.equal(got[0][:, :32], k[:, :32].float()) and torch.equal(got[1][:, :32], v[:, :32].float())
    assert (tc.stats()["promoted_host"], tc.stats()["promoted_disk"]) == (2, 2)
    tc.check_invariants()


def test_corrupt_disk_block_is_dropped_counted_and_the_prompt_computed(tmp_path):
    """Issue: a disk block failing its checksum raised CorruptBlock on every later add of that prefix, for ever."""
    cache, tc = _tiered(tmp_path, pages=8, page_tokens=8, host=1)
    prompt = list(range(33))
    k, v = _kv_of(prompt)
    tc.add("a", prompt, k, v)
    tc.free("a")
    tc.evict()  # 4 blocks: 1 on the host, 3 pushed to disk
    on_disk = [d for d in tc.digests(prompt, 8, None, 4) if tc.entries[d].tier == "disk"]
    assert on_disk
    _corrupt(tc, on_disk[0])
    for i in range(3):  # never raises; the first add drops the entry, the prompt is computed from there
        p = tc.add(f"b{i}", prompt, k, v)
        got = cache.read(f"b{i}")
        assert torch.equal(got[0], k.float()) and torch.equal(got[1], v.float())
        tc.free(f"b{i}")
        tc.evict()
        tc.check_invariants()
    assert tc.stats()["corrupt"] == 1
    assert p.first == 32  # recomputed once, demoted again, promoted since
    assert on_disk[0] in tc.entries  # the recomputed block is stored under its digest again


def test_add_of_an_existing_id_raises_before_promoting_anything(tmp_path):
    cache, tc = _tiered(tmp_path, pages=8, host=8, disk=0)
    prompt = list(range(17))
    tc.add("a", prompt, *_kv_of(prompt))
    tc.free("a")
    tc.evict()  # the prompt's blocks are below
    tc.add("x", [500, 501], *_kv_of([500, 501]))
    tc.add("y", [600, 601], *_kv_of([600, 601]))
    tc.swap_out(["y"])
    for sid in ("x", "y"):
        before = _state(tc)
        with pytest.raises(SequenceExists, match=f"'{sid}' already exists"):
            tc.add(sid, prompt, *_kv_of(prompt))
        _same(tc, before)
    assert tc.stats()["promoted_host"] == 0


# ---- argument errors name the argument, before anything changes -----------------------------------------------------
def test_constructor_errors_name_the_argument(tmp_path):
    cache = PagedKVCache(L, H, D, num_pages=8, page_tokens=4)
    unit = block_bytes(cache, 4)
    for kw, name in ((dict(host_bytes=0), "host_bytes"), (dict(host_bytes=-5), "host_bytes"),
                     (dict(host_bytes=unit - 1), "host_bytes"), (dict(host_bytes="1G"), "host_bytes"),
                     (dict(host_bytes=unit, disk_bytes=unit), "disk_bytes needs a disk_path"),
                     (dict(host_bytes=unit, disk_path=tmp_path, disk_bytes=0), "disk_bytes"),
                     (dict(host_bytes=unit, disk_path=3), "disk_path"),
                     (dict(host_bytes=unit, fsync="yes"), "fsync"),
                     (dict(host_bytes=unit, sm_programs=0), "sm_programs"),
                     (dict(host_bytes=unit, eviction="mru"), "eviction"), (dict(host_bytes=unit, path="x"), "path"),
                     (dict(host_bytes=unit, on_miss="x"), "on_miss")):
        with pytest.raises(ValueError, match=name):
            TieredCache(cache, **kw)
        assert cache.on_evict is None and cache.manager.pool.evicted is None  # left as it was
    TieredCache(cache, host_bytes=unit)  # and still free to take a tier


def test_method_errors_name_the_argument_and_change_nothing(tmp_path):
    cache, tc = _tiered(tmp_path, host=4)
    tc.add("a", list(range(9)), *_kv_of(list(range(9))))
    tc.free("a")
    tc.evict()  # something below that a careless check would promote
    tc.add("r", [1, 2, 3], *_kv_of([1, 2, 3]))
    tc.add("s", [4, 5, 6], *_kv_of([4, 5, 6]))
    tc.swap_out(["s"])
    prompt = list(range(9))
    kv = _kv_of(prompt)
    q = torch.randn(1, H, D, dtype=torch.float16, device=DEV)
    calls = [
        (lambda: tc.add(["x"], prompt, *kv), "seq_id must be hashable"),
        (lambda: tc.add("n", prompt, *kv, expected_len=0), "expected_len"),
        (lambda: tc.add("n", prompt, *kv, extra_key=[1]), "extra_key must be hashable"),
        (lambda: tc.add("n", prompt, kv[0][:, :3], kv[1]), "k must be"),
        (lambda: tc.add("n", [], kv[0][:, :0], kv[1][:, :0]), "tokens must hold at least one"),
        (lambda: tc.add("n", "abc", *kv), "tokens must be"),
        (lambda: tc.add("n", prompt, *kv, priority=1.5), "priority"),
        (lambda: tc.read_prefix(prompt, expected_len=-1), "expected_len"),
        (lambda: tc.promote_prefix(prompt, extra_key={}), "extra_key must be hashable"),
        (lambda: tc.fork("s", "r"), "'r' already exists"),
        (lambda: tc.fork("s", ["c"]), "child_id must be hashable"),
        (lambda: tc.fork("nobody", "c"), "no sequence 'nobody'"),
        (lambda: tc.append("s", [7], *_kv_of([7, 8])), "k must be"),
        (lambda: tc.append("s", [1.5], *_kv_of([7])), "tokens must hold integer"),
        (lambda: tc.append_batch(["s", "r"], [7], *_kv_of([7, 8])), "tokens must hold one token per sequence"),
        (lambda: tc.append_batch(["s", "s"], [7, 8], *_kv_of([7, 8])), "seq_ids must not repeat"),
        (lambda: tc.decode(q, ["s"], 5), "layer"),
        (lambda: tc.decode(q[:, :, :8], ["s"], 0), "q must be"),
        (lambda: tc.decode(q, ["nobody"], 0), "no sequence 'nobody'"),
        (lambda: tc.swap_out([["s"]]), "seq_ids entry must be hashable"),
        (lambda: tc.swap_out("r"), "seq_ids must be a non-empty list"),
        (lambda: tc.swap_in(["r"]), "'r' is not swapped out"),
        (lambda: tc.swap_out(["s"]), "'s' is swapped out already"),
        (lambda: tc.evict(-1), "n must be"),
        (lambda: tc.digests(prompt, 3), "block_size"),
        (lambda: tc.digests(prompt, 4, None, 5), "n must be"),
        (lambda: tc.free("nobody"), "no sequence 'nobody'"),
    ]
    for call, match in calls:
        before = _state(tc)
        with pytest.raises((ValueError, UnknownSequence, SequenceExists), match=match):
            call()
        _same(tc, before)
    tc.check_invariants()


def test_compaction_of_a_tiered_cache_is_refused_before_anything_changes(tmp_path):
    cache, tc = _tiered(tmp_path, pages=8, host=4)
    for i in range(3):
        tc.add(f"s{i}", list(range(100 * i, 100 * i + 5)), *_kv_of(list(range(100 * i, 100 * i + 5))))
    tc.free("s1")
    before = _state(tc)
    for target in (cache, cache.manager, tc):
        for call in (compaction.plan, compaction.compact):
            with pytest.raises(ValueError, match="tier below"):
                call(target)
            _same(tc, before)
    tc.close()
    compaction.compact(cache)  # without a tier below it works as before


def test_check_invariants_notices_broken_tier_state(tmp_path):
    cache, tc = _tiered(tmp_path, host=4)
    tc.add("a", list(range(9)), *_kv_of(list(range(9))))
    tc.swap_out(["a"])
    tc.check_invariants()
    cache.manager.add("a", list(range(9)))  # the device holds a sequence the tier lists swapped out
    with pytest.raises(AssertionError, match="swapped out and on the device"):
        tc.check_invariants()
    cache.manager.free("a")
    tc.entries[tc._swapped["a"].keys[0]].pins += 1
    with pytest.raises(AssertionError, match="pins"):
        tc.check_invariants()


def test_kivi_forks_swapped_together_come_back_sharing_with_their_residual(tmp_path):
    cache = PagedKVCache(L, H, 64, num_pages=8, page_tokens=32, kv_dtype="int4/kivi")
    tc = TieredCache(cache, host_bytes=1 * block_bytes(cache, 32), disk_path=tmp_path, fsync=False,
                     disk_bytes=16 * block_bytes(cache, 32))
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(L, 80, H, 64, generator=g).half().to(DEV) for _ in range(2))
    tc.add("a", list(range(80)), k, v)
    tc.fork("a", "b")
    want = {s: cache.read(s) for s in ("a", "b")}
    before = _sharing(cache, ["a", "b"])
    tc.swap_out(["a", "b"])
    tc.evict()
    tc.swap_in(["a", "b"])
    _assert_sharing_kept(cache, ["a", "b"], before)
    for s in ("a", "b"):
        got = cache.read(s)
        assert torch.equal(got[0], want[s][0]) and torch.equal(got[1], want[s][1])
    tc.check_invariants()


# ---- property: random interleavings on device + host + disk ---------------------------------------------------------
KINDS = ["add", "add", "fork", "fork", "append", "free", "swap_out", "swap_out", "swap_in", "swap_in", "roundtrip",
         "roundtrip", "evict", "corrupt", "bad"]


def _bad_calls(tc, want, n):
    """Calls with one bad argument, against the sequences there are (resident, swapped, or none)."""
    s = list(want)[n % len(want)] if want else "s"
    kv = _kv_of([1, 2])
    q = torch.randn(1, H, D, dtype=torch.float16, device=DEV)
    return [lambda: tc.add(s, [1, 2], *kv) if s in want else tc.add(s, [1, 2], *kv, expected_len=0),
            lambda: tc.add("new", [1, 2], kv[0][:, :1], kv[1]),
            lambda: tc.add("new", [1, 2], *kv, extra_key=[]),
            lambda: tc.fork(s, s),
            lambda: tc.fork("nobody", "new"),
            lambda: tc.append(s, [3], *kv),
            lambda: tc.append_batch([s, s], [3, 4], *kv),
            lambda: tc.decode(q, [s], -1),
            lambda: tc.swap_out([s, s]),
            lambda: tc.swap_in(["nobody"]),
            lambda: tc.swap_out([[s]]),
            lambda: tc.read_prefix([], expected_len=2),
            lambda: tc.evict(-n - 1),
            lambda: tc.free(["x"])][n % 14]
OP = st.tuples(st.sampled_from(KINDS), st.integers(0, 255), st.integers(1, 14))  # (kind, which, how many)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # ~15 s on 2 busy cores
@given(st.lists(OP, min_size=6, max_size=25))
def test_random_interleavings_keep_bytes_sharing_and_invariants(ops):
    """add / fork / append / free / swap_out / swap_in / evict / corrupt-a-disk-block / a call with a bad argument,
    then after every step: the invariants hold, every resident sequence reads exactly the (random) K/V written for
    it, a swap_out + swap_in round trip keeps the batch's sharing and reference counts, a refused operation or bad
    argument changed nothing, and a corrupt block is raised only by the swap-in of a sequence whose only copy it
    was."""
    with tempfile.TemporaryDirectory() as tmp:
        cache, tc = _tiered(tmp, pages=10, host=3, disk=12)
        want: dict = {}  # resident or swapped sequence -> (tokens, k, v) as written
        _add(tc, want, "p0", list(range(10)))  # a prelude, so that every example starts with sharing to keep
        _add(tc, want, "p1", list(range(6)))
        tc.fork("p0", "p2")
        want["p2"] = want["p0"]
        for step, op in enumerate(ops):
            resident = [s for s in want if tc.is_resident(s)]
            swapped = [s for s in want if not tc.is_resident(s)]
            new = f"s{step}"
            try:
                if op[0] == "add":
                    _add(tc, want, new, [op[1] % 2 * 1000 + j for j in range(op[2])])  # two families of prefixes
                elif op[0] == "fork" and resident:
                    tc.fork(resident[op[1] % len(resident)], new)
                    want[new] = want[resident[op[1] % len(resident)]]
                elif op[0] == "append" and resident:
                    new_tokens = [10_000 + 20 * step + j for j in range(op[2] % 6 + 1)]
                    _append(tc, want, resident[op[1] % len(resident)], new_tokens)
                elif op[0] == "free" and want:
                    s = list(want)[op[1] % len(want)]
                    tc.free(s)
                    del want[s]
                elif op[0] in ("swap_out", "roundtrip"):
                    batch = [s for i, s in enumerate(resident) if op[1] >> i & 1]
                    if batch:
                        before, shared = _state(tc), _sharing(cache, batch)
                        try:
                            tc.swap_out(batch)
                        except TierFull:
                            _same(tc, before)
                            raise
                        if op[0] == "roundtrip":
                            tc.swap_in(batch)  # the blocks it just freed are enough, and nothing is corrupt
                            _assert_sharing_kept(cache, batch, shared)
                elif op[0] == "swap_in":
                    batch = [s for i, s in enumerate(swapped) if op[1] >> i & 1]
                    if batch:
                        before = _state(tc)
                        try:
                            tc.swap_in(batch)
                        except OutOfBlocks:
                            _same(tc, before)
                        except CorruptBlock as e:
                            after = _state(tc)
                            assert after[0] == before[0] and after[3:] == before[3:]
                            assert tc.entries[e.key].corrupt
                            for s in [s for s in batch if e.key in tc._swapped[s].keys]:
                                tc.free(s)  # its only copy is gone: the caller computes it again
                                del want[s]
                elif op[0] == "evict":
                    tc.evict(op[2])
                elif op[0] == "bad":
                    before = _state(tc)
                    with pytest.raises((ValueError, AllocatorError)):
                        _bad_calls(tc, want, op[1])()
                    _same(tc, before)
                elif op[0] == "corrupt" and tc.lower.disk is not None and len(tc.lower.disk):
                    keys = sorted(tc.lower.disk.keys(), key=lambda d: -tc.entries[d].pins)  # swapped ones first
                    _corrupt(tc, keys[op[1] % min(len(keys), 2)], at=op[1])
            except (OutOfBlocks, TierFull):
                pass  # a full device or tier refuses: the checks below say nothing changed for anyone
            tc.check_invariants()
            _check_bytes(cache, {s: w for s, w in want.items() if tc.is_resident(s)})
        swapped = [s for s in want if not tc.is_resident(s)]
        for s in [s for s in want if s not in swapped]:  # make room, then every swapped sequence reads back
            tc.free(s)
        for s in swapped:
            try:
                tc.swap_in([s])
            except CorruptBlock:
                tc.free(s)
                continue
            _check_bytes(cache, {s: want[s]})
            tc.free(s)
            tc.check_invariants()
        tc.close()


def test_host_full_without_disk_refuses_a_shared_swap_and_changes_nothing(tmp_path):
    cache, tc = _tiered(tmp_path, host=2, disk=0)
    _add(tc, {}, "a", list(range(14)))
    tc.fork("a", "b")
    before = _state(tc)
    with pytest.raises(HostFull, match="needs 4 units"):
        tc.swap_out(["a", "b"])
    _same(tc, before)
