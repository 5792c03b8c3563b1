"""Eviction that frees real blocks (workbench.compress.evict) and the evicting K/V store (evicting_kv): kept K/V
bit-identical in every layout and exact scheme, decode over exactly the kept tokens, shared blocks released only
by the evicting sequence, nothing of an evicted sequence ever found through the prefix cache, bad arguments and a
full pool refused with the cache exactly as it was; the runner with logical positions against a contiguous
reference that drops the same tokens."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workbench
from workbench import quant
from workbench.allocator import OutOfBlocks, UnknownSequence
from workbench.analysis import fragmentation
from workbench.cache import PagedKVCache, compaction
from workbench.compress import policies
from workbench.compress.block_keep import block_keep
from workbench.compress.evict import PARTIAL, evict
from workbench.compress.evicting_kv import EvictingKV
from workbench.core.layout import Layout
from workbench.model import SMOLLM2_135M, ContiguousKV, Llama, PagedKV, Runner, random_weights

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

L, H, HQ, D = 2, 2, 4, 32
TOKEN_AXIS = {Layout.NHD: 1, Layout.HND: 2, Layout.VLLM: 3}


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


def make(scheme="fp16", layout="nhd", ops="torch", num_pages=16, page_tokens=4, device="cpu", **kw):
    """A small cache; ``device``: the CPU by default (``ops="torch"`` there is fast), ``workbench.device()`` where a
    test runs kernels (compiled on a GPU, interpreted on a CPU)."""
    s = quant.resolve(scheme)
    scales = dict(k_scale=torch.tensor([0.02]), v_scale=torch.tensor([0.02])) if s.static else {}
    return PagedKVCache(L, H, D, num_pages, page_tokens=page_tokens, layout=layout, kv_dtype=scheme, device=device,
                        ops=ops, **scales, **kw)


def kv(n, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, H, D, generator=g).to(device), torch.randn(L, n, H, D, generator=g).to(device)


def raw(cache, seq):
    """The stored bytes of each token of ``seq`` in every layer, K and V (codes plus in-block scales), [n, bytes]."""
    m = cache.manager
    bs, table, n = m.block_size(seq), m.block_table(seq), m.num_tokens(seq)
    pos = torch.arange(n)
    b, o = torch.tensor(table)[pos // bs], pos % bs
    parts = []
    for layer in range(L):
        for kind, view in (("k", cache.k_cache), ("v", cache.v_cache)):
            t = view(layer, bs).movedim(TOKEN_AXIS[cache.layout], 1)[b, o]
            parts.append(t.contiguous().view(torch.uint8).reshape(n, -1))
            for sc in cache.scales(layer, kind, bs):
                if sc is not None:
                    parts.append(sc[b, o].contiguous().view(torch.uint8).reshape(n, -1))
    return torch.cat(parts, 1)


def state(cache, seqs):
    m = cache.manager
    return (m.fingerprint(), m.pool.free_blocks(m.pool.block_sizes[0]), m.pool.cached_blocks(),
            {s: (raw(cache, s), m.block_table(s), m.tokens(s), m.published(s), m.publishes(s)) for s in seqs})


def same_state(a, b) -> bool:
    return a[:3] == b[:3] and a[3].keys() == b[3].keys() and all(
        torch.equal(a[3][s][0], b[3][s][0]) and a[3][s][1:] == b[3][s][1:] for s in a[3])


def ref_attention(q, k, v, sm_scale):
    """q [Hq, D] over k, v [n, H, D] in float64 -> [Hq, D]."""
    kk = k.double().repeat_interleave(HQ // H, 1)  # [n, Hq, D]
    vv = v.double().repeat_interleave(HQ // H, 1)
    p = (torch.einsum("hd,nhd->hn", q.double(), kk) * sm_scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", p, vv)


# ---- evict: bytes, blocks, decode ------------------------------------------------------------------------------
EXACT_CASES = [("fp32", "nhd"), ("fp16", "hnd"), ("bf16", "vllm"), ("fp16", "vllm"), ("fp8_e4m3/tensor", "nhd"),
               ("int8/token", "hnd"), ("int8_asym/token", "nhd"), ("int4/token", "nhd")]


@pytest.mark.parametrize("partial", PARTIAL)
@pytest.mark.parametrize("scheme,layout", EXACT_CASES)
def test_kept_tokens_are_bit_identical_and_blocks_go_back(scheme, layout, partial):
    cache = make(scheme, layout, num_pages=16)
    n, bs = 23, 4
    k, v = kv(n)
    cache.add("a", list(range(n)), k, v)
    before_raw, (k0, v0) = raw(cache, "a"), cache.read("a")
    free0 = cache.manager.pool.free_blocks(bs)
    used0 = fragmentation.breakdown(cache).token
    keep = torch.zeros(n, dtype=torch.bool)
    keep[[0, 1, 2, 5, 9, 10, 11, 12, 13, 14, 15, 22]] = True  # block 1 partly, blocks 4 wholly dropped; block 3 whole
    rep = evict(cache, "a", keep, partial=partial)
    m = cache.manager
    m.check_invariants()
    idx = torch.tensor(rep.retained)
    want = block_keep(keep, bs, partial)
    assert torch.equal(torch.zeros(n, dtype=torch.bool).index_fill_(0, idx, True), want.mask)
    assert (rep.blocks_before, rep.blocks_after) == (6, want.blocks)
    # packed chunks [0 1 2 5] [9 10 11 12] [13 14 15 22] match no old block: all copied (published blocks are
    # never written in place, so block 0 cannot take token 5)
    assert (rep.tokens_moved, rep.blocks_allocated) == ((12, 3) if partial == "compact" else (0, 0))
    assert m.num_tokens("a") == rep.tokens_kept == len(rep.retained)
    assert torch.equal(raw(cache, "a"), before_raw[idx])  # codes and in-block scales, byte for byte
    k1, v1 = cache.read("a")
    assert torch.equal(k1, k0[:, idx]) and torch.equal(v1, v0[:, idx])
    assert m.pool.free_blocks(bs) - free0 == rep.pool_blocks_returned == rep.blocks_freed - rep.blocks_allocated
    assert fragmentation.breakdown(cache).token == used0 - rep.tokens_evicted
    assert m.tokens("a") == [int(i) for i in idx]
    assert not m.publishes("a")


def test_keep_mode_copies_nothing_and_compact_reuses_aligned_blocks():
    cache = make("fp16", num_pages=8)
    k, v = kv(16)
    cache.add("a", list(range(16)), k, v)
    t0, e0 = cache.manager.block_table("a"), cache.manager.published("a")
    keep = torch.ones(16, dtype=torch.bool)
    keep[4:8] = False  # exactly block 1: the blocks after it land on boundaries
    rep = evict(cache, "a", keep, partial="compact")
    assert rep.tokens_moved == 0 and rep.blocks_allocated == 0 and rep.blocks_freed == 1
    assert cache.manager.block_table("a") == [t0[0], t0[2], t0[3]]
    assert cache.manager.published("a") == e0[:1]  # blocks 2 and 3 moved up: no longer this chain's entries
    keep = torch.ones(12, dtype=torch.bool)
    keep[5] = False  # partly drops block 1: "keep" leaves the table alone
    rep = evict(cache, "a", keep, partial="keep")
    assert (rep.tokens_kept, rep.tokens_moved, rep.blocks_after) == (12, 0, 3)
    assert cache.manager.block_table("a") == [t0[0], t0[2], t0[3]]


@pytest.mark.parametrize("ops,scheme", [("torch", "fp16"), ("torch", "int8/token"), ("kernels", "fp32")])
def test_decode_after_eviction_is_attention_over_exactly_the_kept_tokens(ops, scheme):
    dev = workbench.device() if ops == "kernels" else torch.device("cpu")
    cache = make(scheme, ops=ops, num_pages=12, device=dev)
    n = 19
    k, v = kv(n, seed=3, device=dev)
    cache.add("a", list(range(n)), k, v)
    k0, v0 = (x.cpu() for x in cache.read("a"))
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(n, generator=g) < 0.4
    keep[0] = True
    rep = evict(cache, "a", keep, partial="compact")
    idx = torch.tensor(rep.retained)
    assert torch.equal(idx, keep.nonzero().flatten())
    q = torch.randn(1, HQ, D, generator=g)
    q = q.half() if scheme != "fp32" else q
    for layer in range(L):
        out = cache.decode(q.to(dev), ["a"], layer, sm_scale=D ** -0.5)[0].cpu()
        ref = ref_attention(q[0], k0[layer, idx], v0[layer, idx], D ** -0.5)
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < (1e-5 if scheme == "fp32" else 2e-3), (layer, err)


def test_packed_blocks_get_their_quest_key_bounds():
    cache = make("fp16", num_pages=12, key_bounds=True)
    k, v = kv(14, seed=7)
    cache.add("a", list(range(14)), k, v)
    keep = torch.tensor([1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    rep = evict(cache, "a", keep, partial="compact")
    assert rep.tokens_moved == 10  # block 2 is whole but lands off a boundary
    k1, v1 = cache.read("a")
    fresh = make("fp16", num_pages=12, key_bounds=True)  # the kept tokens written by an ordinary prefill
    fresh.add("b", list(range(10)), k1, v1)
    for layer in range(L):
        ours = cache.key_bounds(layer)[cache.manager.block_table("a")]  # [blocks, Hkv, 2, D]
        want = fresh.key_bounds(layer)[fresh.manager.block_table("b")]
        assert torch.equal(ours, want)
        lo, hi = ours[:, :, 0].float(), ours[:, :, 1].float()  # true bounds of each packed block's keys
        for j in range(3):
            chunk = k1[layer, j * 4:(j + 1) * 4]
            assert bool((lo[j] <= chunk.amin(0)).all()) and bool((hi[j] >= chunk.amax(0)).all())


def test_shared_blocks_are_released_only_by_the_evicting_sequence():
    cache = make("fp16", num_pages=12)
    k, v = kv(14)
    cache.add("a", list(range(14)), k, v)
    m = cache.manager
    m.fork("a", "b")
    table, ka = m.block_table("a"), raw(cache, "a")
    free0 = m.pool.free_blocks(4)
    keep = torch.zeros(14, dtype=torch.bool)
    keep[[0, 1, 13]] = True
    rep = evict(cache, "b", keep, partial="keep")
    assert rep.blocks_released == 2 and rep.blocks_freed == 0 and m.pool.free_blocks(4) == free0
    assert [m.pool.ref_count(4, b) for b in table] == [2, 1, 1, 2]
    assert m.block_table("a") == table and torch.equal(raw(cache, "a"), ka) and m.publishes("a")
    assert m.num_tokens("b") == 6  # blocks 0 and 3 whole
    rep = evict(cache, "b", torch.tensor([True, False, True, True, False, True]), partial="compact")  # 1 block
    assert rep.blocks_allocated == 1 and rep.tokens_moved == 4
    assert [m.pool.ref_count(4, b) for b in table] == [1, 1, 1, 1]
    m.append("b", [99])  # decode into the private compacted block: "a" does not see it
    assert m.block_table("a") == table and torch.equal(raw(cache, "a"), ka)
    m.check_invariants()


def test_an_evicted_sequence_is_never_found_through_the_prefix_cache():
    dev = workbench.device()  # compaction's snapshots gather with the kernel (compiled on a GPU: device memory)
    cache = make("fp16", num_pages=24, device=dev)
    prompt = list(range(100, 118))  # 4 full blocks + 2
    k, v = kv(18, seed=5, device=dev)
    cache.add("a", prompt, k, v)
    m, pool = cache.manager, cache.manager.pool
    entries = m.published("a")
    assert len(entries) == 4
    keep = torch.ones(18, dtype=torch.bool)
    keep[[6, 9]] = False  # inside block 1 and block 2: block 0 keeps its place
    evict(cache, "a", keep, partial="compact")
    kept_tokens = m.tokens("a")
    assert m.published("a") == entries[:1]
    cached = pool.cached_blocks()
    for t in range(40):  # decode fills several more blocks
        cache.append("a", [200 + t], *kv(1, seed=10 + t, device=dev))
    snap = compaction.kv_snapshot(cache)
    compaction.compact(cache)  # re-homing and packing publish nothing of it either
    assert compaction.kv_identical(snap, cache)
    assert pool.cached_blocks() == cached and m.published("a") == entries[:1]
    # a prompt of its kept tokens (its new "prefix") finds only block 0, which was and is a true prefix
    _, hits = m.cached_prefix(kept_tokens + [1])
    assert len(hits) == 1
    # the original prompt finds its original blocks, with exactly the K/V its prefill computed
    kp, _ = cache.read_prefix(prompt + [1])
    assert kp.shape[1] == 16 and torch.equal(kp, k.half().float()[:, :16])
    m.free("a")
    _, hits = m.cached_prefix(kept_tokens + [1])
    assert len(hits) == 1
    m.check_invariants()


# ---- refusals: nothing changes ------------------------------------------------------------------------------------
def _bad_keep(n):
    return st.one_of(
        st.integers(0, 2 * n).filter(lambda x: x != n).map(lambda x: torch.ones(x, dtype=torch.bool)),
        st.sampled_from([torch.float32, torch.int64, torch.uint8]).map(lambda d: torch.ones(n, dtype=d)),
        st.integers(1, 3).map(lambda r: torch.ones(r, n, dtype=torch.bool)),
        st.just(torch.zeros(n, dtype=torch.bool)),
        st.lists(st.booleans(), min_size=n, max_size=n),
        st.none(),
    )


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bad_arguments_raise_value_error_naming_them_and_change_nothing(data):
    cache = make("fp16", num_pages=8)
    n = data.draw(st.integers(1, 20))
    cache.add("a", list(range(n)), *kv(n))
    before = state(cache, ["a"])
    if data.draw(st.booleans()):
        bad, name = data.draw(_bad_keep(n)), "keep"
        args = dict(keep=bad, partial=data.draw(st.sampled_from(PARTIAL)))
    else:
        name = "partial"
        args = dict(keep=torch.ones(n, dtype=torch.bool),
                    partial=data.draw(st.one_of(st.text(max_size=8), st.integers(), st.none()).filter(
                        lambda p: p not in PARTIAL)))
    with pytest.raises(ValueError, match=name):
        evict(cache, "a", args["keep"], partial=args["partial"])
    with pytest.raises(UnknownSequence):
        evict(cache, "nope", torch.ones(n, dtype=torch.bool))
    assert same_state(state(cache, ["a"]), before)
    cache.manager.check_invariants()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), partial=st.sampled_from(PARTIAL), fork=st.booleans())
def test_a_full_pool_refuses_compaction_and_leaves_the_cache_exactly_as_it_was(seed, partial, fork):
    """Random masks on a pool with no free block: an eviction either succeeds exactly or raises OutOfBlocks
    (compacting into fresh blocks while the old ones stay with a fork) and changes nothing."""
    cache = make("fp16", num_pages=8)
    g = torch.Generator().manual_seed(seed)
    cache.add("a", list(range(15)), *kv(15, seed))  # 4 blocks
    if fork:
        cache.fork("a", "b")
    cache.add("c", list(range(50, 50 + 16)), *kv(16, seed + 1))  # the other 4: the pool is full
    assert cache.manager.pool.free_blocks(4) == 0
    seqs = ["a", "b", "c"] if fork else ["a", "c"]
    keep = torch.rand(15, generator=g) < 0.6
    keep[int(torch.randint(15, (1,), generator=g))] = True
    before = state(cache, seqs)
    target = "b" if fork else "a"
    try:
        rep = evict(cache, target, keep, partial=partial)
    except OutOfBlocks as e:
        assert partial == "compact" and fork and "partial='keep' needs none" in str(e)
        assert same_state(state(cache, seqs), before)
    else:
        idx = torch.tensor(rep.retained)
        assert torch.equal(raw(cache, target), before[3][target][0][idx])
        for s in seqs:
            if s != target:
                assert torch.equal(raw(cache, s), before[3][s][0])
    cache.manager.check_invariants()


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(["partial", "every", "obs_window", "sm_scale"]),
       bad=st.one_of(st.integers(-3, 0), st.floats(allow_nan=True), st.booleans(), st.text(max_size=4)))
def test_evicting_kv_refuses_bad_settings_naming_them(name, bad):
    if name == "sm_scale" and not isinstance(bad, bool) and isinstance(bad, float) and 0 < bad < float("inf"):
        bad = -bad  # a positive finite float is a valid scale
    if name == "partial" and bad in PARTIAL:
        bad += "!"
    with pytest.raises(ValueError, match=name):
        EvictingKV(make("fp16"), policies.get("full"), **{name: bad})


def test_kivi_and_residual_schemes_are_refused_clearly():
    cache = PagedKVCache(L, H, D, 8, page_tokens=32, kv_dtype="int4/kivi", device="cpu", ops="torch")
    cache.add("a", list(range(40)), *kv(40))
    before = cache.manager.fingerprint()
    with pytest.raises(ValueError, match="residual"):
        evict(cache, "a", torch.ones(40, dtype=torch.bool))
    with pytest.raises(ValueError, match="residual"):
        EvictingKV(cache, policies.get("streaming"))
    assert cache.manager.fingerprint() == before
    with pytest.raises(ValueError, match="cache"):
        evict(cache.manager, "a", torch.ones(40, dtype=torch.bool))


# ---- EvictingKV through the runner --------------------------------------------------------------------------------
CFG = SMOLLM2_135M.with_layers(2)
SYSTEM = list(range(300, 320))
PROMPTS = [SYSTEM + list(range(5, 15)), SYSTEM + list(range(40, 52))]


class SinksAndRecent:
    """A hand-made policy: the first ``sinks`` and the last ``recent`` stored tokens."""

    def __init__(self, sinks, recent):
        self.sinks, self.recent = sinks, recent

    def keep(self, obs):
        T = obs.num_tokens
        m = torch.zeros(T, dtype=torch.bool)
        m[:self.sinks] = True
        m[max(0, T - self.recent):] = True
        return m


class ReplayKV(ContiguousKV):
    """The reference: contiguous K/V, the same token sets dropped at the same moments, logical positions."""

    def __init__(self, schedule):
        super().__init__(CFG.num_hidden_layers)
        self.schedule = list(schedule)  # (seq_id, event, logical length, retained) in order
        self.evicted = {}

    def _apply(self, seq, event):
        if self.schedule and self.schedule[0][:3] == (seq, event, self.num_tokens(seq)):
            idx = torch.tensor(self.schedule.pop(0)[3])
            self.evicted[seq] = self.evicted.get(seq, 0) + self._k[seq].shape[1] - len(idx)
            self._k[seq], self._v[seq] = self._k[seq][:, idx], self._v[seq][:, idx]

    def add(self, seq_id, tokens, k, v):
        super().add(seq_id, tokens, k, v)
        self._apply(seq_id, "prefill")

    def begin(self, seq_ids, tokens):
        self._ids = list(seq_ids)
        return super().begin(seq_ids, tokens)

    def commit(self, step):
        super().commit(step)
        for s in self._ids:
            self._apply(s, "step")

    def num_tokens(self, seq_id):
        return super().num_tokens(seq_id) + self.evicted.get(seq_id, 0)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, random_weights(CFG, seed=1))


@pytest.fixture(scope="module")
def unevicted(model):
    return Runner(model, ContiguousKV(CFG.num_hidden_layers)).generate(PROMPTS, 8, keep_logits=True)


def paged(num_pages=24, scheme="fp32"):
    return PagedKVCache(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, num_pages, page_tokens=8,
                        kv_dtype=scheme, device="cpu", ops="torch")


def max_diff(a, b):
    return max(float((torch.stack(a.logits[s]) - torch.stack(b.logits[s])).abs().max()) for s in b.logits)


def test_evicting_kv_keeping_everything_is_the_paged_store(model):
    base = Runner(model, PagedKV(paged())).generate(PROMPTS, 4, keep_logits=True)
    kv_ = EvictingKV(paged(), policies.get("full"))
    got = Runner(model, kv_, capture=kv_.capture).generate(PROMPTS, 4, keep_logits=True)
    assert got.tokens == base.tokens and max_diff(got, base) == 0.0
    assert all(r.tokens_evicted == 0 for r in kv_.reports) and got.prefix_hit_tokens == base.prefix_hit_tokens


@pytest.mark.parametrize("partial,every", [("compact", None), ("keep", None), ("compact", 3)])
def test_evicting_kv_equals_attention_over_the_kept_tokens_at_true_positions(model, unevicted, partial, every):
    kv_ = EvictingKV(paged(), SinksAndRecent(3, 9), partial=partial, every=every, obs_window=4)
    runner = Runner(model, kv_, capture=kv_.capture)
    got = runner.generate(PROMPTS, 8, keep_logits=True, free=False)
    # the first prompt's published blocks stay cached once its eviction released them (their bytes untouched):
    # the second prompt reuses the shared system prompt's two full blocks
    assert got.prefix_hit_tokens[1] == 16
    for i, p in enumerate(PROMPTS):
        s = (i, 0)
        assert kv_.num_tokens(s) == len(p) + 7 > kv_.stored_tokens(s) == kv_.cache.manager.num_tokens(s)
    schedule = [(*e, r.retained) for e, r in zip(kv_.events, kv_.reports, strict=True) if r.tokens_evicted]
    assert any(e[1] == "step" for e in schedule) == (every is not None)
    # the reference prefills without prefix reuse: the hit block's K/V must be what a prefill computes
    ref = Runner(model, ReplayKV(schedule)).generate(PROMPTS, 8, keep_logits=True)
    assert got.tokens == ref.tokens
    assert max_diff(got, ref) < 1e-4
    kv_.cache.manager.check_invariants()
    assert max_diff(got, unevicted) > 1e-3  # the eviction did change the attention


def test_evicting_kv_with_a_real_policy_frees_blocks_and_needs_the_capture_hook(model):
    cache = paged(num_pages=24, scheme="fp16")
    kv_ = EvictingKV(cache, policies.get("h2o", budget=0.5, sinks=2, window=4), obs_window=8)
    with pytest.raises(ValueError, match="capture"):
        Runner(model, kv_).prefill("x", PROMPTS[0])
    assert "x" not in cache.manager
    g = Runner(model, kv_, capture=kv_.capture).generate(PROMPTS[:1], 3, free=False)
    r = kv_.reports[0]
    assert r.tokens_selected == 15 and r.blocks_after == 2 < r.blocks_before == 4
    assert kv_.num_tokens((0, 0)) == 30 + 2 and cache.manager.num_tokens((0, 0)) == 15 + 2
    assert len(g.tokens[(0, 0)]) == 3
    with pytest.raises(ValueError, match="every"):
        EvictingKV(cache, policies.get("full"), every=0)
    with pytest.raises(ValueError, match="policy"):
        EvictingKV(cache, object())
