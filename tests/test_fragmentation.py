"""Live-cache memory metrics: exact parts on hand-built pools, conservation on random workloads,
agreement with the page map and with compaction's accounting; the simulator helpers."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compaction import CONFIGS, WORKLOAD, _policy, run_ops

from workbench.allocator import BlockManager, BlockPool, ByExpectedLength
from workbench.analysis import fragmentation
from workbench.analysis.fragmentation import CACHED, FREE, SHARED, TOKEN, UNCARVED, UNUSED
from workbench.cache import PagedKVCache, compaction
from workbench.sim import sweeps

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)


def two_sizes():
    """Page 0: small blocks (2 + 1 tokens of 's'); pages 1-2: 'l' in large blocks (8 + 2); page 3 uncarved."""
    m = BlockManager(BlockPool(4, 8, block_sizes=[2, 8]), ByExpectedLength(small=2, large=8, threshold=10))
    m.add("s", [1, 2, 3], expected_len=4)
    m.add("l", list(range(10)), expected_len=100)
    return m


def parts(b):
    return {k: getattr(b, k) for k in (*fragmentation.PARTS, "cached", "stranded")}


def test_parts_of_a_hand_built_pool():
    m = two_sizes()
    b = fragmentation.breakdown(m)
    assert parts(b) == dict(token=13, reservation=0, internal=7, external=4, free=8, cached=0, stranded=4)
    assert b.total == 32 and b.residual() == 0 and b.request_block_size == 8
    assert b.block_utilization == pytest.approx(13 / 20)
    assert b.paper() == pytest.approx({"token_states": 100 * 13 / 32, "reservation": 0.0,
                                       "internal": 100 * 7 / 32, "external": 100 * 12 / 32})
    # the final lengths split the unused slots of each sequence's last block
    b = fragmentation.breakdown(m, final_lens={"s": 4, "l": 12})
    assert (b.reservation, b.internal) == (1 + 2, 7 - 3)
    # for a small request the free small blocks are usable
    b = fragmentation.breakdown(m, request_block_size=2)
    assert (b.external, b.free, b.stranded) == (0, 12, 4)
    # a shared, partly filled block will be copied before anyone appends: its tail is internal
    m.fork("l", "l2")
    b = fragmentation.breakdown(m, final_lens={"s": 4, "l": 12, "l2": 12})  # only s reserves
    assert (b.token, b.reservation, b.internal) == (13, 1, 7 - 1)
    # freeing 's' empties page 0: usable by any class, and its full block stays cached
    m.free("s")
    b = fragmentation.breakdown(m)
    assert parts(b) == dict(token=10, reservation=0, internal=6, external=0, free=16, cached=2, stranded=0)
    with pytest.raises(ValueError, match="block_size"):
        fragmentation.breakdown(m, request_block_size=4)
    with pytest.raises(ValueError, match="target"):
        fragmentation.breakdown("cache")


def test_page_map_of_a_hand_built_pool():
    m = two_sizes()
    m.fork("l", "l2")
    pm = fragmentation.page_map(m)
    assert pm.seq_ids == ("s", "l", "l2") and pm.block_size.tolist() == [2, 8, 8, 0]
    assert pm.state[0].tolist() == [TOKEN, TOKEN, TOKEN, UNUSED, FREE, FREE, FREE, FREE]
    assert pm.owner[0].tolist() == [0] * 4 + [-1] * 4
    assert pm.block[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and pm.block[1].tolist() == [1] * 8
    assert (pm.owner[1:3] == SHARED).all() and (pm.state[3] == UNCARVED).all()
    assert pm.state[2].tolist() == [TOKEN] * 2 + [UNUSED] * 6
    m.free("s")
    pm = fragmentation.page_map(m)
    assert pm.state[0].tolist() == [CACHED] * 2 + [FREE] * 6
    assert pm.counts() == {"uncarved": 8, "free": 6, "cached": 2, "unused": 6, "token": 10}


def test_cache_bytes_cover_the_whole_pool():
    cache = PagedKVCache(2, 3, 80, num_pages=5, page_tokens=4, block_sizes=[1, 4])  # padded blocks
    b = fragmentation.breakdown(cache)
    assert b.slot_bytes * b.total == cache.total_bytes
    assert b.bytes()["free"] == cache.total_bytes and b.shares()["free"] == 1.0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(CONFIGS), ops=WORKLOAD, caching=st.booleans(), rehome=st.booleans(),
       data=st.data())
def test_every_slot_is_counted_once(cfg, ops, caching, rehome, data):
    pool = BlockPool(cfg["num_pages"], cfg["page_tokens"], cfg["block_sizes"])
    m = BlockManager(pool, _policy(cfg), prefix_caching=caching)
    live = run_ops(m, ops, write=lambda p, toks: None)
    final = {sid: len(t) + data.draw(st.integers(-2, 9)) for sid, t in live.items()}
    rbs = data.draw(st.sampled_from(pool.block_sizes))
    b = fragmentation.breakdown(m, final_lens=final, request_block_size=rbs)
    assert b.residual() == 0
    assert b.token + b.reservation + b.internal == pool.used_slots()
    assert b.external + b.free == pool.free_slots() and b.cached <= b.external + b.free
    assert b.external <= b.stranded
    pm = fragmentation.page_map(m)
    counts = pm.counts()
    assert counts["token"] == b.token and counts["unused"] == b.reservation + b.internal
    assert counts["cached"] == b.cached and counts["free"] + counts["uncarved"] + b.cached == b.external + b.free
    assert (pm.owner[pm.state >= UNUSED] != -1).all() and (pm.owner[pm.state < UNUSED] == -1).all()
    # compaction copies, it does not create or lose token states; re-homing gives back what it reports
    plan = compaction.plan(m, rehome=rehome)
    compaction.apply(m, plan)
    after = fragmentation.breakdown(m, final_lens=final, request_block_size=rbs)
    assert after.token == b.token
    held = b.token + b.reservation + b.internal
    assert after.token + after.reservation + after.internal == held - plan.slots_saved
    if not rehome:
        assert after.stranded <= b.stranded


def test_churn_is_seeded_and_leaves_a_consistent_cache():
    def run():
        cache = PagedKVCache(1, 1, 16, num_pages=6, page_tokens=8, block_sizes=[2, 8],
                             policy=ByExpectedLength(2, 8, threshold=20))
        live = fragmentation.churn(cache, 12, seed=3, max_prompt=10)
        cache.manager.check_invariants()
        return live, cache
    (a, ca), (b, cb) = run(), run()
    assert a == b and a and np.array_equal(fragmentation.page_map(ca).state, fragmentation.page_map(cb).state)
    for sid, toks in a.items():
        assert ca.manager.tokens(sid) == toks


def test_simulator_helpers():
    r = sweeps.simulate("alpaca", "paged", 16, 12.0, n=300)
    assert sum(r["shares"].values()) == pytest.approx(100, abs=0.05) and r["throughput"] > 0
    assert len(r["series"]["token"]) == r["steps"]
    comp = sweeps.simulate("sharegpt", "paged-adaptive", 16, 4.0, compact_every=32, n=300)
    assert comp["label"] == "paged adaptive (16/64, compact/32)" and comp["copied_tokens"] > 0
    sweep = sweeps.block_size_sweep(("alpaca",), (16, 256), n=300)
    assert sweep["alpaca"][16]["token_states"] > sweep["alpaca"][256]["token_states"]
    with pytest.raises(ValueError, match="strategy"):
        sweeps.sim_strategy("buddy")
    with pytest.raises(ValueError, match="compact_every"):
        sweeps.sim_strategy("paged-adaptive", 16, -1)
