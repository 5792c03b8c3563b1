"""Compaction: re-homing and packing plans, applied atomically to a bare allocator (with a model of the
physical memory) and to a real PagedKVCache (K/V bit-identical, prefix cache intact, bytes as reported,
stale or invalid plans and failed copies change nothing)."""

import pytest
import torch
from conftest import bits
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_allocator import snapshot

import workbench
from workbench.allocator import BlockManager, BlockPool, ByExpectedLength, FixedBlockSize, OutOfBlocks
from workbench.cache import PagedKVCache, compaction
from workbench.cache.compaction import Plan, StalePlan
from workbench.core.layout import Layout

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

LAYERS, HEADS, DIM = 1, 1, 16
VOCAB, MAX_POS = 4, 64
SYSTEM = [1, 2, 3, 0, 1, 2, 3, 0]


def _table(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, MAX_POS, LAYERS, HEADS, DIM, generator=g).half()


K_TABLE, V_TABLE = _table(1), _table(2)


def kv_for(tokens, start=0):
    """K/V of token ``t`` at position ``p``: a fixed random function (``[layers, n, heads, dim]``)."""
    pos = torch.arange(start, start + len(tokens))
    t = torch.tensor(tokens, dtype=torch.long)
    dev = workbench.device()
    return K_TABLE[t, pos].transpose(0, 1).contiguous().to(dev), V_TABLE[t, pos].transpose(0, 1).contiguous().to(dev)


def phys(pool, bs, slot):
    """(page, slot in page) of slot ``block * bs + offset`` of size class ``bs``."""
    bpp = pool.page_tokens // bs
    block, off = divmod(slot, bs)
    return block // bpp, (block % bpp) * bs + off


# ---- unit cases on a bare allocator ------------------------------------------------------
def test_rehome_moves_a_short_sequence_into_small_blocks():
    pool = BlockPool(4, 8, block_sizes=[2, 8])
    m = BlockManager(pool, ByExpectedLength(small=2, large=8, threshold=10))
    m.add("long", [1, 2, 3], expected_len=100)  # a large block, 3 of 8 slots used
    m.add("short", [1, 2, 3], expected_len=4)
    assert m.block_size("long") == 8
    p = compaction.plan(m, pack=None)
    assert [(r.seq_id, r.src_size, r.dst_size, r.tokens) for r in p.rehomes] == [("long", 8, 2, 3)]
    assert p.slots_saved == 8 - 4 and p.copied_tokens == 3 and p.bytes_copied == 3
    assert p.release == (0,) and p.pages_freed == 1  # the large block's page is wholly free again
    compaction.apply(m, p)
    assert m.block_size("long") == 2 and len(m.block_table("long")) == 2 and m.tokens("long") == [1, 2, 3]
    m.check_invariants()
    assert compaction.plan(m).empty


def test_shared_or_half_full_sequences_are_not_rehomed():
    m = BlockManager(BlockPool(4, 8, block_sizes=[2, 8]), ByExpectedLength(small=2, large=8, threshold=10))
    m.add("a", [1, 2], expected_len=100)
    m.fork("a", "b")  # ref count 2: not the seed's case
    m.add("c", [1, 2, 3, 4], expected_len=100)  # exactly half full
    assert compaction.plan(m, pack=None).rehomes == ()


def test_dense_pack_frees_pages_with_fewest_copies():
    m = BlockManager(BlockPool(4, 4, block_sizes=[1, 4]), FixedBlockSize(1), prefix_caching=False)
    for i in range(16):
        m.add(i, [i])
    for i in [0, 1, 2, 5, 6, 9, 10, 11, 13, 14]:  # pages keep 1, 2, 1 and 2 blocks
        m.free(i)
    p = compaction.plan(m, slot_bytes=10)
    assert p.moves == {1: ((3, 5), (8, 6))}  # out of the emptiest pages (0 and 2) into the fullest (1)
    assert p.release == (0, 2) and p.pages_freed == 2 and p.bytes_copied == 20
    compaction.apply(m, p)
    assert m.block_table(3) == [5] and m.block_table(8) == [6]
    assert m.pool.uncarved_pages() == [0, 2]
    m.check_invariants()


def test_low_pack_empties_the_tail():
    m = BlockManager(BlockPool(6, 2, block_sizes=[1, 2]), FixedBlockSize(2))
    for i in range(6):
        m.add(i, [i, i])
    for i in range(5):
        m.free(i)
    m.pool.evict()
    dense, low = compaction.plan(m), compaction.plan(m, pack="low")
    assert dense.moves == {} and dense.tail_after == 0  # nothing to pack: one full page
    assert low.moves == {2: ((5, 0),)} and low.tail_before == 0 and low.tail_after == 5
    compaction.apply(m, low)
    assert m.block_table(5) == [0] and m.pool.uncarved_pages() == [1, 2, 3, 4, 5]
    m.check_invariants()


def test_cached_blocks_move_or_are_evicted():
    def setup():
        m = BlockManager(BlockPool(3, 4, block_sizes=[2, 4]), FixedBlockSize(2))
        m.add("a", [1, 2, 3, 4, 5, 6])  # page 0: blocks 0, 1 full (cached), block 2 partly
        m.add("b", [7])  # page 1
        m.free("a")
        return m
    m = setup()
    keys = {b: m.pool._cls(2).key[b] for b in (0, 1)}
    p = compaction.plan(m)  # cached="move": the cached blocks are packed like live ones
    assert p.evicted == 0
    compaction.apply(m, p)
    m.check_invariants()
    for old, key in keys.items():
        new = m.pool.lookup(2, key)
        assert new is not None and new == dict(p.moves.get(2, ())).get(old, old)
    assert m.add("c", [1, 2, 3, 4, 5]).first == 4  # the prefix is still a hit
    m = setup()
    p = compaction.plan(m, cached="evict")
    assert p.evicted == 2 and p.release == (0,)
    compaction.apply(m, p)
    assert all(m.pool.lookup(2, k) is None for k in keys.values())
    m.check_invariants()


def test_stale_and_invalid_plans_change_nothing():
    m = BlockManager(BlockPool(4, 4, block_sizes=[1, 4]), FixedBlockSize(1), prefix_caching=False)
    for i in range(8):
        m.add(i, [i])
    for i in (0, 1, 2, 4, 5):
        m.free(i)
    p = compaction.plan(m)
    m.append(3, [9])
    before = snapshot(m)
    with pytest.raises(StalePlan):
        compaction.apply(m, p)
    assert snapshot(m) == before
    p = compaction.plan(m)
    used = m.block_table(7)[0]
    bad = Plan(p.rehomes, {1: ((m.block_table(3)[0], used),)}, (), 0, 1, 1, 0, 0, 0, 0, 0, p.fingerprint)
    with pytest.raises(ValueError, match="holds data"):
        compaction.apply(m, bad)
    free_dst = 15
    bad = Plan(p.rehomes, {1: ((m.block_table(3)[0], free_dst),)}, (0,), 0, 1, 1, 0, 0, 0, 0, 0, p.fingerprint)
    with pytest.raises(ValueError, match="page 0"):  # page 0 still holds a block after the move
        compaction.apply(m, bad)
    assert snapshot(m) == before
    with pytest.raises(ValueError, match="pack"):
        compaction.plan(m, pack="sideways")
    with pytest.raises(ValueError, match="target"):
        compaction.plan(object())


# ---- property: a bare allocator with a model of physical memory ----------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), st.booleans(),
              st.none() | st.integers(1, 30)),
    st.tuples(st.just("append"), st.integers(0, 99), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)),
    st.tuples(st.just("fork"), st.integers(0, 99)),
    st.tuples(st.just("free"), st.integers(0, 99)),
    st.tuples(st.just("evict"), st.integers(0, 2)),
), max_size=14)
# A burst of short sequences, then a random subset freed: pages with holes, the case compaction is for.
BURST = st.tuples(st.just("burst"), st.lists(st.tuples(st.integers(1, 5), st.none() | st.integers(1, 30)),
                                               min_size=6, max_size=20), st.lists(st.booleans(), min_size=20,
                                                                                  max_size=20))
WORKLOAD = st.builds(lambda burst, ops: [burst, *ops], BURST, OPS)
CONFIGS = [dict(num_pages=6, page_tokens=8, block_sizes=[2, 8], policy=(2, 8, 10)),
           dict(num_pages=8, page_tokens=4, block_sizes=[1, 4], policy=None),
           dict(num_pages=4, page_tokens=8, block_sizes=[1, 2, 8], policy=(1, 8, 6))]


def run_ops(target, ops, write=None):
    """Apply ``ops`` to a cache or allocator; ``write(placement, tokens)`` records K/V. Returns live tokens."""
    live, next_id = {}, 0
    expanded = []
    for op in ops:
        if op[0] == "burst":  # add them all, then free the flagged ones
            adds = [("add", [(i + j) % VOCAB for j in range(n)], False, exp) for i, (n, exp) in enumerate(op[1])]
            expanded += adds + [("free_id", i) for i, drop in enumerate(op[2][:len(adds)]) if drop]
        else:
            expanded.append(op)
    for op in expanded:
        ids = sorted(live)
        try:
            if op[0] == "free_id":
                if op[1] in live:
                    target.free(op[1])
                    del live[op[1]]
            elif op[0] == "add":
                toks = (SYSTEM if op[2] else []) + op[1]
                p = target.add(next_id, toks, *([] if write else kv_for(toks)), expected_len=op[3])
                live[next_id] = toks
                next_id += 1
                if write:
                    write(p, toks[p.first:])
            elif op[0] == "evict":
                (target.pool if write else target.manager.pool).evict(op[1])
            elif not ids:
                continue
            elif op[0] == "append":
                sid, new = ids[op[1] % len(ids)], op[2]
                if len(live[sid]) + len(new) > MAX_POS:
                    continue
                p = target.append(sid, new, *([] if write else kv_for(new, len(live[sid]))))
                live[sid] = live[sid] + new
                if write:
                    write(p, new)
            elif op[0] == "fork":
                target.fork(ids[op[1] % len(ids)], next_id)
                live[next_id] = list(live[ids[op[1] % len(ids)]])
                next_id += 1
            else:
                target.free(ids[op[1] % len(ids)])
                del live[ids[op[1] % len(ids)]]
        except OutOfBlocks:
            pass
    return live


def _policy(cfg):
    return ByExpectedLength(*cfg["policy"][:2], threshold=cfg["policy"][2]) if cfg["policy"] else None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(CONFIGS), ops=WORKLOAD, rehome=st.booleans(), pack=st.sampled_from([None, "dense", "low"]),
       cached=st.sampled_from(["move", "evict"]), caching=st.booleans())
def test_compaction_preserves_every_sequence_in_a_memory_model(cfg, ops, rehome, pack, cached, caching):
    pool = BlockPool(cfg["num_pages"], cfg["page_tokens"], cfg["block_sizes"])
    m = BlockManager(pool, _policy(cfg), prefix_caching=caching)
    mem = {}  # (page, slot in page) -> token: what a K/V write would have stored

    def write(p, toks):
        for src, dst in p.copies:
            for off in range(p.block_size):
                a = phys(pool, p.block_size, src * p.block_size + off)
                if a in mem:
                    mem[phys(pool, p.block_size, dst * p.block_size + off)] = mem[a]
        for slot, tok in zip(p.slots, toks, strict=True):
            mem[phys(pool, p.block_size, slot)] = tok

    live = run_ops(m, ops, write)
    for _ in range(2):  # a second pass may find more (memory freed by the first is clean for it)
        cached_before = {(bs, k): b for bs in pool.block_sizes for b, k in enumerate(pool._cls(bs).key)
                         if k is not None}
        plan = compaction.plan(m, rehome=rehome, pack=pack, cached=cached)
        for r in plan.rehomes:  # the copies, in the order apply makes them
            for pos in range(r.tokens):
                src = phys(pool, r.src_size, r.src_blocks[pos // r.src_size] * r.src_size + pos % r.src_size)
                dst = phys(pool, r.dst_size, r.dst_blocks[pos // r.dst_size] * r.dst_size + pos % r.dst_size)
                mem[dst] = mem[src]
        for bs, moves in plan.moves.items():
            for src, dst in moves:
                for off in range(bs):
                    mem[phys(pool, bs, dst * bs + off)] = mem.get(phys(pool, bs, src * bs + off))
        for name, n in (("rehomed", len(plan.rehomes)), ("moved", plan.num_moves), ("released", len(plan.release))):
            event(f"{name} {'0' if n == 0 else '1-3' if n <= 3 else '4+'}")
        assert compaction.apply(m, plan) == 0
        m.check_invariants()
        for sid, toks in live.items():
            assert m.tokens(sid) == toks
            bs = m.block_size(sid)
            got = [mem.get(phys(pool, bs, s)) for s in m.slot_mapping(sid)]
            assert got == toks, f"sequence {sid} reads {got}, holds {toks}"
        released = {(bs, b) for p in plan.release for bs in pool.block_sizes
                    for b in range(p * pool.page_tokens // bs, (p + 1) * pool.page_tokens // bs)}
        for (bs, key), old in cached_before.items():
            if cached == "move" or (bs, old) not in released:
                assert pool.lookup(bs, key) == dict(plan.moves.get(bs, ())).get(old, old), "cached block lost"
        assert plan.bytes_copied == plan.copied_tokens == sum(r.tokens for r in plan.rehomes) + sum(
            bs * len(mv) for bs, mv in plan.moves.items())
        assert len(pool.uncarved_pages()) == plan.uncarved_after


# ---- the real cache: K/V through the kernels ----------------------------------------------
def block_region_mask(cache, plan):
    """True where the plan may write: its destination blocks, every layer, K and V."""
    mask = torch.zeros(cache.pool.shape, dtype=torch.bool)
    pool = cache.manager.pool
    dsts = [(r.dst_size, b) for r in plan.rehomes for b in r.dst_blocks]
    dsts += [(bs, d) for bs, mv in plan.moves.items() for _, d in mv]
    for bs, b in dsts:
        bpp = pool.page_tokens // bs
        stride = cache.page_elems // bpp
        mask[:, :, b // bpp, (b % bpp) * stride:(b % bpp + 1) * stride] = True
    return mask


def raw_block(cache, bs, b):
    return bits(cache.blocks(bs)[:, :, b])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # kernels interpreted
@given(layout=st.sampled_from(list(Layout)), cfg=st.sampled_from(CONFIGS[:2]), ops=WORKLOAD, rehome=st.booleans(),
       pack=st.sampled_from(["dense", "low"]), cached=st.sampled_from(["move", "evict"]), caching=st.booleans())
def test_compaction_keeps_kv_bit_identical(layout, cfg, ops, rehome, pack, cached, caching):
    cache = PagedKVCache(LAYERS, HEADS, DIM, cfg["num_pages"], page_tokens=cfg["page_tokens"],
                         block_sizes=cfg["block_sizes"], policy=_policy(cfg), layout=layout, prefix_caching=caching)
    pool = cache.manager.pool
    live = run_ops(cache, ops)
    before = {sid: cache.gather(sid) for sid in live}
    cached_before = {(bs, k): raw_block(cache, bs, b).clone()
                     for bs in pool.block_sizes for b, k in enumerate(pool._cls(bs).key) if k is not None}
    plan = compaction.plan(cache, rehome=rehome, pack=pack, cached=cached)
    event(f"cache: {'moves' if plan.num_moves else 'no moves'}, {'rehomes' if plan.rehomes else 'no rehomes'}")
    pool_before = bits(cache.pool).clone()
    copied = []
    real_copy = cache.copy_blocks
    cache.copy_blocks = lambda bs, pairs: (copied.append((bs, len(pairs))), real_copy(bs, pairs))  # records
    written = compaction.apply(cache, plan)
    cache.manager.check_invariants()
    for sid, (k, v) in before.items():
        k2, v2 = cache.gather(sid)
        k_ref, v_ref = kv_for(live[sid])
        assert torch.equal(bits(k2), bits(k)) and torch.equal(bits(v2), bits(v)), f"seq {sid} changed"
        assert torch.equal(bits(k2), bits(k_ref)) and torch.equal(bits(v2), bits(v_ref)), f"seq {sid} wrong"
    for (bs, key), raw in cached_before.items():
        b = pool.lookup(bs, key)
        assert b is not None or cached == "evict", "a cached prefix block was lost"
        if b is not None:
            assert torch.equal(raw_block(cache, bs, b), raw), "a cached block's K/V changed"
    elem = cache.dtype.itemsize
    expect = sum(2 * LAYERS * n * cache.block_stride(bs) * elem for bs, n in copied)
    expect += 2 * LAYERS * cache.token_bytes * sum(r.tokens for r in plan.rehomes)
    assert written == plan.bytes_copied == expect
    assert copied == [(bs, len(mv)) for bs, mv in plan.moves.items()]
    outside = (~block_region_mask(cache, plan)).repeat_interleave(elem, dim=-1)  # per byte
    assert torch.equal(bits(cache.pool)[outside], pool_before[outside]), "wrote outside the plan"
    # a plan made before a change is refused, and changes nothing
    stale = compaction.plan(cache, rehome=rehome, pack=pack, cached=cached)
    if live:
        cache.fork(min(live), "child")
    else:
        cache.add("child", [1], *kv_for([1]))
    snap, raw = snapshot(cache.manager), bits(cache.pool).clone()
    with pytest.raises(StalePlan):
        compaction.apply(cache, stale)
    assert snapshot(cache.manager) == snap and torch.equal(bits(cache.pool), raw)


def test_failed_copy_leaves_the_cache_as_it_was(monkeypatch):
    cache = PagedKVCache(LAYERS, HEADS, DIM, 6, page_tokens=4, block_sizes=[1, 4], policy=FixedBlockSize(1),
                         prefix_caching=False)
    for i in range(12):
        cache.add(i, [i % VOCAB], *kv_for([i % VOCAB]))
    for i in (0, 1, 2, 5, 6, 9):
        cache.free(i)
    before = {sid: cache.gather(sid) for sid in cache.manager.seq_ids}
    plan = compaction.plan(cache)
    assert plan.num_moves > 0
    snap = snapshot(cache.manager)

    def broken(bs, pairs):
        raise RuntimeError("device lost")
    monkeypatch.setattr(cache, "copy_blocks", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        compaction.apply(cache, plan)
    assert snapshot(cache.manager) == snap
    for sid, (k, v) in before.items():
        k2, v2 = cache.gather(sid)
        assert torch.equal(bits(k2), bits(k)) and torch.equal(bits(v2), bits(v))
    monkeypatch.undo()
    compaction.apply(cache, plan)  # the same plan still applies: nothing had changed
    for sid, (k, _v) in before.items():
        assert torch.equal(bits(cache.gather(sid)[0]), bits(k))


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3", "int8"])
def test_rehome_and_pack_copy_any_layout_and_dtype_exactly(layout, kv_dtype):
    scale = {"k_scale": torch.tensor([0.05]), "v_scale": torch.tensor([0.07])} if kv_dtype in ("fp8_e4m3",
                                                                                                 "int8") else {}
    cache = PagedKVCache(1, 2, 32, 6, page_tokens=8, block_sizes=[2, 8], layout=layout, kv_dtype=kv_dtype,
                         policy=ByExpectedLength(2, 8, threshold=10), prefix_caching=False, **scale)
    g = torch.Generator().manual_seed(0)
    dev = workbench.device()
    for sid, n, exp in [("long", 3, 100)] + [(f"s{i}", 2, 4) for i in range(12)]:  # page 0; small: pages 1-3
        k, v = (torch.randn(1, n, 2, 32, generator=g).to(dev) for _ in range(2))
        cache.add(sid, list(range(n)), k, v, expected_len=exp)
    for i in (1, 2, 3, 6, 7, 9, 10, 11):  # pages 1-3 keep 1, 2 and 1 small blocks
        cache.free(f"s{i}")
    before = {sid: cache.gather(sid) for sid in cache.manager.seq_ids}
    plan = compaction.plan(cache)
    assert [r.seq_id for r in plan.rehomes] == ["long"] and plan.rehomes[0].dst_blocks == (10, 11)
    assert plan.moves == {2: ((12, 5),)} and plan.release == (0, 3)
    assert compaction.apply(cache, plan) == plan.bytes_copied > 0
    assert cache.manager.block_size("long") == 2 and cache.manager.block_table("s8") == [5]
    cache.manager.check_invariants()
    for sid, (k, v) in before.items():
        k2, v2 = cache.gather(sid)
        assert torch.equal(bits(k2), bits(k)) and torch.equal(bits(v2), bits(v)), sid
