"""The API boundary (issue 8): every public entry point of the allocator, the cache and
compaction refuses bad arguments with an exception naming the argument, *before* it changes
anything; a failed operation leaves tables, prefix map, LRU order and cache bytes as they were.

Two kinds of tests: the reproductions from the hardening review as regression tests, and
property tests that build a random live state, throw a random bad argument at a random
entry point, and compare a full snapshot before and after.
"""

import pytest
import torch
import workbench.kernels
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_allocator import snapshot
from test_cache import bits, kv_for

import workbench
from workbench.allocator import AllocatorError, BlockManager, BlockPool, SequenceExists, UnknownSequence
from workbench.cache import PagedKVCache, compaction

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

DEV = workbench.device()


def cache_state(cache):
    return snapshot(cache.manager), bits(cache.pool).clone()


def assert_unchanged(cache, before):
    snap, raw = before
    assert snapshot(cache.manager) == snap, "the allocator changed"
    assert torch.equal(bits(cache.pool), raw), "cache bytes changed"


# ---- 1. a failed K/V write must not leave a sequence, blocks or prefix entries behind -------
def test_failed_write_on_add_leaves_nothing_behind():
    c = PagedKVCache(1, 2, 16, num_pages=8, page_tokens=4)
    t = list(range(1, 10))
    k = torch.randn(1, 9, 2, 16, device=DEV)
    before = cache_state(c)
    with pytest.raises(ValueError, match="k must be float32"):
        c.add("x", t, k.double(), k.double())
    assert "x" not in c.manager
    assert_unchanged(c, before)
    assert c.add("y", t, k, k).first == 0  # no prefix hit on K/V that was never written


@pytest.mark.parametrize("bad", ["float64", "fp8", "strided", "int"])
def test_failed_write_on_append_changes_nothing(bad):
    c = PagedKVCache(1, 2, 16, num_pages=8, page_tokens=4)
    k, v = kv_for([1, 2, 3, 0, 1, 2])[0][:1], kv_for([1, 2, 3, 0, 1, 2])[1][:1]
    c.add("a", [1, 2, 3, 0, 1, 2], k, v)
    c.fork("a", "b")  # a shared, partly filled tail: an append would copy-on-write first
    new = torch.randn(1, 3, 2, 16, device=DEV)
    bad_new = {"float64": new.double(), "fp8": new.to(torch.float8_e4m3fn),
               "strided": new.transpose(2, 3).contiguous().transpose(2, 3), "int": new.to(torch.int16)}[bad]
    before = cache_state(c)
    with pytest.raises(ValueError, match="k"):
        c.append("a", [3, 0, 1], bad_new, new)
    assert_unchanged(c, before)


@pytest.mark.parametrize("op", ["add", "add_hit", "append", "append_cow"])
def test_unexpected_write_failure_rolls_back(monkeypatch, op):
    """If the kernel fails after validation anyway, the operation is undone: no leak, nothing published."""
    c = PagedKVCache(1, 2, 16, num_pages=8, page_tokens=4)
    toks = [1, 2, 3, 0, 1, 2]
    c.add("a", toks, *[t[:1] for t in kv_for(toks)])
    if op == "append_cow":
        c.fork("a", "b")
    before_snap = snapshot(c.manager)
    cached, used = c.manager.pool.cached_blocks(), c.manager.pool.used_slots()

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(workbench.kernels, "write_kv", broken)
    new = [3, 0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="device lost"):
        if op.startswith("add"):
            prompt = toks + new if op == "add_hit" else new
            c.add("n", prompt, *[t[:1] for t in kv_for(prompt)])
        else:
            c.append("a", new, *[t[:1] for t in kv_for(new, start=len(toks))])
    c.manager.check_invariants()  # ref counts = holders: nothing leaked
    assert "n" not in c.manager
    assert c.manager.pool.cached_blocks() == cached, "a failed write published blocks"
    assert c.manager.pool.used_slots() == used
    snap = snapshot(c.manager)
    assert snap[2:4] == before_snap[2:4], "hit counters changed"
    assert snap[-1] == before_snap[-1], "sequences changed"
    assert c.manager.tokens("a") == toks


# ---- 2. the prefix cache never aliases two contents -----------------------------------------
@pytest.mark.parametrize("first_a, first_b", [(0, 2**61 - 1), (-1, -2)])
def test_prefix_chain_is_exact_when_parent_hashes_collide(first_a, first_b):
    assert hash(first_a) == hash(first_b)  # the collision the old hash chain could not tell apart
    m = BlockManager(BlockPool(16, 2))
    m.add("a", [first_a, 5, 6, 7, 8])
    a0, a1 = m.block_table("a")[:2]
    m.free("a")
    m.pool.release_pages([a0])  # a's first block leaves the cache; its child [6, 7] stays cached
    m.add("b", [first_b, 5, 9, 9, 1])
    p = m.add("c", [first_b, 5, 6, 7, 1])
    assert p.first == 2, "c must reuse b's first block and nothing computed after a different prefix"
    assert a1 not in m.block_table("c")
    m.check_invariants()


def test_child_of_an_evicted_parent_is_unreachable():
    m = BlockManager(BlockPool(16, 2))
    m.add("a", [0, 5, 6, 7, 8])
    a0, a1 = m.block_table("a")[:2]
    m.free("a")
    m.pool.release_pages([a0])
    assert m.add("d", [0, 5, 6, 7, 1]).first == 0  # the parent is gone, so the chain starts over
    assert a1 not in m.block_table("d")
    m.free("d")
    p = m.add("e", [0, 5, 6, 7, 2])
    assert p.first == 4 and m.block_table("e")[1] != a1


def test_prefix_hits_survive_compaction_moves():
    c = PagedKVCache(1, 2, 16, num_pages=8, page_tokens=4)
    toks = list(range(13))
    c.add("a", toks, *[t[:1] for t in kv_for([x % 4 for x in toks])])
    c.add("tmp", [9, 9], *[t[:1] for t in kv_for([1, 1])])
    c.free("tmp")
    c.free("a")
    compaction.compact(c, pack="low")
    c.manager.check_invariants()
    assert c.add("b", toks, *[t[:1] for t in kv_for([x % 4 for x in toks])]).first == 12


# ---- 3. ranges -----------------------------------------------------------------------------
def test_slot_mapping_range_is_checked():
    m = BlockManager(BlockPool(8, 4))
    m.add("a", [1, 2, 3, 4, 5])
    assert m.slot_mapping("a", 1, 3) == m.slot_mapping("a")[1:3]
    assert m.slot_mapping("a", 5, 5) == []
    for start, end in [(-1, 1), (0, 1000), (3, 2), (0, 6), (1.5, None)]:
        with pytest.raises(ValueError, match="start|end"):
            m.slot_mapping("a", start, end)


# ---- 4. inputs that used to be accepted ----------------------------------------------------
def test_token_containers_are_normalised():
    m = BlockManager(BlockPool(16, 4))
    m.add("t", torch.tensor([1, 2, 3, 4, 5]))
    assert m.add("l", [1, 2, 3, 4, 6]).first == 4  # a tensor prompt caches like a list
    assert m.add("z", [torch.tensor(1), torch.tensor(2), torch.tensor(3), torch.tensor(4), 7]).first == 4
    assert m.tokens("z") == [1, 2, 3, 4, 7] and all(type(t) is int for t in m.tokens("z"))


@pytest.mark.parametrize("prompt", [[], [[1]], [1.5, 2], "abc", [None], torch.tensor([1.0, 2.0]),
                                    torch.tensor([[1, 2]]), 5])
def test_bad_prompts_are_refused_before_commit(prompt):
    m = BlockManager(BlockPool(8, 4))
    m.add("a", [1, 2, 3])
    before = snapshot(m)
    with pytest.raises(ValueError, match="prompt"):
        m.add("b", prompt)
    assert snapshot(m) == before and "b" not in m


@pytest.mark.parametrize("expected", [-5, 0, "long", 1.5, True])
def test_expected_len_is_checked(expected):
    m = BlockManager(BlockPool(8, 4))
    with pytest.raises(ValueError, match="expected_len"):
        m.add("a", [1, 2], expected_len=expected)
    assert m.seq_ids == []


def test_kv_dtype_names():
    one = torch.ones(1)
    c = PagedKVCache(1, 1, 16, num_pages=2, kv_dtype="fp8", k_scale=one, v_scale=one)
    assert c.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8_e4m3.*fp8_e5m2"):
        PagedKVCache(1, 1, 16, num_pages=2, kv_dtype="fp7")
    with pytest.raises(ValueError, match="kv_dtype"):
        PagedKVCache(1, 1, 16, num_pages=2, kv_dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale"):
        PagedKVCache(1, 2, 16, num_pages=2, kv_dtype="int8", k_scale=torch.ones(3), v_scale=torch.ones(2))


def test_vllm_metadata_right_padding():
    c = PagedKVCache(1, 1, 16, num_pages=8, page_tokens=4)
    one = torch.randn(1, 6, 1, 16, device=DEV)
    c.add("a", list(range(6)), one, one)
    md = c.vllm_metadata(["a"], pad_blocks=3)
    assert md.block_table.shape == (1, 5) and md.block_table[0, 2:].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="pad_blocks"):
        c.vllm_metadata(["a"], pad_blocks=-1)
    fi = c.flashinfer_metadata(["a"])
    assert fi.kv_last_page_len.tolist() == [2]


# ---- 5. storage initialisation -------------------------------------------------------------
def test_zero_storage_and_nan_pool_never_leaks():
    assert not bool(PagedKVCache(1, 2, 16, num_pages=3, zero_storage=True).pool.float().abs().sum())
    for layout in ("nhd", "hnd", "vllm"):
        c = PagedKVCache(2, 2, 16, num_pages=6, page_tokens=4, layout=layout)
        c.pool.fill_(float("nan"))
        toks = [1, 2, 3, 0, 1, 2, 3]  # ends mid-block: the unwritten slots stay NaN
        k, v = kv_for(toks)
        c.add("a", toks, k, v)
        gk, gv = c.gather("a")
        assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v)), layout


# ---- property tests: random bad arguments at every entry point ------------------------------
BAD_IDS = st.sampled_from(["num_blocks", -1, 10**6, 1.5, "3", None, True])
BAD_COUNTS = st.sampled_from([-1, 1.5, "2", None])
BAD_SIZES = st.sampled_from([3, 0, "4", None, 4.0, 64])
BAD_TOKENS = st.sampled_from([[1.5], "abc", [None], [[1]], 7, [1, "2"]])


def _resolve(bad, nb):
    return nb if bad == "num_blocks" else bad


def _manager_cases(m, live, nb, data):
    """(callable, expected exception, regex the message must match) for a random entry point."""
    bs = m.pool.block_sizes[0]
    sid = data.draw(st.sampled_from(live))
    bad_id = _resolve(data.draw(BAD_IDS), nb)
    free_clean = next((b for b in range(nb) if m.pool.ref_count(bs, b) == 0 and m.pool.entry_id(bs, b) is None),
                      None)
    used = m.block_table(sid)[0]
    n = m.num_tokens(sid)
    cases = [
        (lambda: m.pool.allocate(bs, data.draw(BAD_COUNTS)), ValueError, "n must"),
        (lambda: m.pool.allocate(data.draw(BAD_SIZES), 1), ValueError, "block_size"),
        (lambda: m.pool.incref(bs, [used, bad_id]), ValueError, "ids entry"),
        (lambda: m.pool.decref(bs, [bad_id]), ValueError, "ids entry"),
        (lambda: m.pool.decref(bs, [used] * (m.pool.ref_count(bs, used) + 1)), ValueError, "users|not in use"),
        (lambda: m.pool.touch(bs, [used, bad_id]), ValueError, "ids entry"),
        (lambda: m.pool.take(bs, [bad_id]), ValueError, "ids entry"),
        (lambda: m.pool.block(bs, bad_id), ValueError, "block_id"),
        (lambda: m.pool.ref_count(bs, bad_id), ValueError, "block_id"),
        (lambda: m.pool.is_free(bs, bad_id), ValueError, "block_id"),
        (lambda: m.pool.entry_id(bs, bad_id), ValueError, "block_id"),
        (lambda: m.pool.valid_tokens(bs, bad_id), ValueError, "block_id"),
        (lambda: m.pool.set_valid(bs, used, data.draw(st.sampled_from([-1, bs + 1, 1.5, None]))), ValueError,
         "valid"),
        (lambda: m.pool.evict(data.draw(st.sampled_from([-1, 1.5, "1"]))), ValueError, "n must"),
        (lambda: m.pool.move_blocks(bs, [(bad_id, 0)]), ValueError, "moves"),
        (lambda: m.pool.move_blocks(bs, [1, 2]), ValueError, "moves"),
        (lambda: m.pool.release_pages([data.draw(st.sampled_from([-1, 1.5, "0", 10**6]))]), ValueError, "page"),
        (lambda: m.pool.page_block_size(data.draw(st.sampled_from([-1, 1.5, 10**6]))), ValueError, "page"),
        (lambda: m.pool.lookup(bs, (None, [1, 2], None)), ValueError, "key"),
        (lambda: m.add(sid, [1, 2]), SequenceExists, "exists"),
        (lambda: m.add([1], [1, 2]), ValueError, "seq_id"),
        (lambda: m.add("new", data.draw(BAD_TOKENS)), ValueError, "prompt"),
        (lambda: m.add("new", [1, 2], expected_len=data.draw(st.sampled_from([-5, 0, "long", 2.5]))), ValueError,
         "expected_len"),
        (lambda: m.add("new", [1, 2], extra_key=[1]), ValueError, "extra_key"),
        (lambda: m.append("nobody", [1]), UnknownSequence, "nobody"),
        (lambda: m.append(sid, data.draw(BAD_TOKENS)), ValueError, "tokens"),
        (lambda: m.fork("nobody", "x"), UnknownSequence, "nobody"),
        (lambda: m.fork(sid, sid), SequenceExists, "exists"),
        (lambda: m.fork(sid, {}), ValueError, "child_id"),
        (lambda: m.free("nobody"), UnknownSequence, "nobody"),
        (lambda: m.publish("nobody"), UnknownSequence, "nobody"),
        (lambda: m.locate(sid, data.draw(st.sampled_from([-1, n, 1.5]))), ValueError, "pos"),
        (lambda: m.slot_mapping(sid, *data.draw(st.sampled_from([(-1, 1), (0, n + 1), (1, 0), (0.5, None)]))),
         ValueError, "start"),
        (lambda: m.rehome(sid, data.draw(BAD_SIZES), []), ValueError, "block_size"),
        (lambda: m.rehome(sid, bs, [bad_id] * -(-n // bs)), ValueError, "ids entry|block"),
        (lambda: m.move_blocks(bs, [(bad_id, 1)]), ValueError, "moves"),
    ]
    if free_clean is not None:
        cases += [(lambda: m.pool.incref(bs, [free_clean]), ValueError, "neither in use nor cached"),
                  (lambda: m.pool.register(bs, free_clean, (None, (1,), None)), ValueError, "in use"),
                  (lambda: m.pool.decref(bs, [used, free_clean]), ValueError, "not in use")]
    return cases


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1,
                                        max_size=5), sizes=st.sampled_from([[4], [2, 4], [1, 2, 4]]))
def test_allocator_refuses_bad_arguments_and_changes_nothing(data, prompts, sizes):
    m = BlockManager(BlockPool(40, 4, sizes))
    live = []
    for i, p in enumerate(prompts):
        m.add(i, [3, 1, 2, 0] + p)
        live.append(i)
    if data.draw(st.booleans()):
        m.free(live.pop(0)) if len(live) > 1 else None
    nb = m.pool.num_blocks(m.pool.block_sizes[0])
    cases = _manager_cases(m, live, nb, data)
    fn, exc, match = data.draw(st.sampled_from(cases))
    before = snapshot(m)
    with pytest.raises(exc, match=match):
        fn()
    assert snapshot(m) == before, "a refused call changed the allocator"
    m.check_invariants()


BAD_KV = st.sampled_from(["float64", "int", "fp8", "strided", "short", "list", "layers"])


def _bad_kv(kind, k):
    return {"float64": k.double(), "int": k.to(torch.int32), "fp8": k.to(torch.float8_e5m2),
            "strided": k.transpose(2, 3).contiguous().transpose(2, 3), "short": k[:, :-1], "list": k.tolist(),
            "layers": k[:1]}[kind]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), layout=st.sampled_from(["nhd", "hnd", "vllm"]),
       prompts=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=9), min_size=1, max_size=3))
def test_cache_refuses_bad_arguments_and_changes_nothing(data, layout, prompts):
    c = PagedKVCache(2, 2, 16, num_pages=10, page_tokens=4, layout=layout)
    live = []
    for i, p in enumerate(prompts):
        toks = [3, 1, 2, 0] + p
        c.add(i, toks, *kv_for(toks))
        live.append(i)
    sid = data.draw(st.sampled_from(live))
    new = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
    k_new, v_new = kv_for(new)
    bad = data.draw(BAD_KV)
    which = data.draw(st.sampled_from(["k", "v"]))
    bk, bv = (_bad_kv(bad, k_new), v_new) if which == "k" else (k_new, _bad_kv(bad, v_new))
    nb = c.manager.pool.num_blocks(4)
    cases = [
        (lambda: c.add("new", new, bk, bv), ValueError, which),
        (lambda: c.add("new", [3, 1, 2, 0] + prompts[0][:1], *kv_for([1])), ValueError, "k must"),
        (lambda: c.append(sid, new, bk, bv), ValueError, which),
        (lambda: c.append(sid, data.draw(BAD_TOKENS), k_new, v_new), ValueError, "tokens"),
        (lambda: c.append("nobody", new, k_new, v_new), UnknownSequence, "nobody"),
        (lambda: c.add(sid, new, k_new, v_new), SequenceExists, "exists"),
        (lambda: c.copy_blocks(4, [(data.draw(st.sampled_from([nb, -1, 10**6])), 0)]), ValueError, "src|dst"),
        (lambda: c.copy_blocks(data.draw(BAD_SIZES), [(0, 1)]), ValueError, "block_size"),
        (lambda: c.vllm_metadata([]), ValueError, "seq_ids"),
        (lambda: c.vllm_metadata("ab"), ValueError, "seq_ids"),
        (lambda: c.vllm_metadata([sid, "nobody"]), UnknownSequence, "nobody"),
        (lambda: c.vllm_metadata([sid], pad_blocks=data.draw(st.sampled_from([-1, 1.5, True]))), ValueError,
         "pad_blocks"),
        (lambda: c.flashinfer_metadata([]), ValueError, "seq_ids"),
        (lambda: c.slot_mapping(sid, -1, 1), ValueError, "start"),
        (lambda: c.k_cache(data.draw(st.sampled_from([-1, 2, 10]))), ValueError, "layer"),
        (lambda: c.gather("nobody"), UnknownSequence, "nobody"),
        (lambda: compaction.plan(c, pack="sideways"), ValueError, "pack"),
        (lambda: compaction.apply(c, "plan"), ValueError, "Plan"),
    ]
    fn, exc, match = data.draw(st.sampled_from(cases))
    before = cache_state(c)
    with pytest.raises(exc, match=match):
        fn()
    assert_unchanged(c, before)
    c.manager.check_invariants()


def test_stale_compaction_plan_is_refused():
    c = PagedKVCache(1, 1, 16, num_pages=6, page_tokens=4)
    one = torch.randn(1, 3, 1, 16, device=DEV)
    c.add("a", [1, 2, 3], one, one)
    p = compaction.plan(c)
    c.add("b", [1, 2, 4], one, one)
    before = cache_state(c)
    with pytest.raises(compaction.StalePlan):
        compaction.apply(c, p)
    assert_unchanged(c, before)
    assert issubclass(compaction.StalePlan, AllocatorError)
