"""The paged KV cache: storage geometry and alignment, writes/copies through the kernels,
exports to vLLM and FlashInfer formats, atomic failures, and a hypothesis state machine
whose every live sequence must gather back bit for bit in all three layouts."""

import pytest
import torch
from conftest import bits
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_allocator import snapshot
from workbench.kernels.gather.reference import paged_gather_ref

import workbench
from workbench.allocator import ByExpectedLength, OutOfBlocks
from workbench.cache import ALIGN, PagedKVCache
from workbench.core.layout import Layout

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

LAYERS, HEADS, DIM = 2, 2, 16
VOCAB, MAX_POS = 4, 96


def kv_table(seed=0, dtype=torch.float16):
    """K/V of token ``t`` at position ``p``: a fixed random function, so a prefix hit must
    find exactly what a fresh write would have stored."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(VOCAB, MAX_POS, LAYERS, HEADS, DIM, generator=g).to(dtype)
    v = torch.randn(VOCAB, MAX_POS, LAYERS, HEADS, DIM, generator=g).to(dtype)
    return k, v


K_TABLE, V_TABLE = kv_table()


def kv_for(tokens, start=0):
    """``[layers, len(tokens), heads, dim]`` K and V for tokens at positions ``start...``."""
    pos = torch.arange(start, start + len(tokens))
    t = torch.tensor(tokens, dtype=torch.long)
    dev = workbench.device()
    return (K_TABLE[t, pos].transpose(0, 1).contiguous().to(dev),
            V_TABLE[t, pos].transpose(0, 1).contiguous().to(dev))


def gather_ref(cache: PagedKVCache, seq_id):
    """An independent reader: the block table through plain torch indexing (no kernel)."""
    bs = cache.manager.block_size(seq_id)
    table = torch.tensor([cache.manager.block_table(seq_id) or [0]], dtype=torch.int32, device=cache.device)
    lens = torch.tensor([cache.manager.num_tokens(seq_id)], dtype=torch.int32, device=cache.device)
    ks = [paged_gather_ref(cache.k_cache(i, bs), cache.layout, "k", table, lens) for i in range(LAYERS)]
    vs = [paged_gather_ref(cache.v_cache(i, bs), cache.layout, "v", table, lens) for i in range(LAYERS)]
    return torch.stack(ks), torch.stack(vs)


@pytest.mark.parametrize("layout", list(Layout))
def test_append_fork_gather_roundtrip(layout):
    cache = PagedKVCache(LAYERS, HEADS, DIM, num_pages=8, page_tokens=4, layout=layout)
    tokens = [1, 2, 3, 0, 1, 2]
    cache.add("a", tokens, *kv_for(tokens))
    cache.fork("a", "b")
    cache.append("b", [3], *kv_for([3], start=6))
    cache.append("a", [0, 0], *kv_for([0, 0], start=6))
    for sid, toks in [("a", tokens + [0, 0]), ("b", tokens + [3])]:
        k, v = cache.gather(sid)
        k_ref, v_ref = kv_for(toks)
        assert torch.equal(bits(k), bits(k_ref)) and torch.equal(bits(v), bits(v_ref)), sid


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("heads,dim,dtype,page,sizes", [
    pytest.param(8, 128, "fp16", 16, None, id="h8-d128-fp16-page16"),
    pytest.param(3, 80, "fp16", 1, None, id="h3-d80-fp16-page1"),  # 480-byte blocks: padded to 512
    pytest.param(3, 80, "bf16", 16, [4, 16], id="h3-d80-bf16-page16-bs4+16"),
    pytest.param(1, 64, "fp8_e4m3", 8, [2, 8], id="h1-d64-fp8e4m3-page8-bs2+8"),
])
def test_every_block_is_128_byte_aligned(layout, heads, dim, dtype, page, sizes):
    scales = {"k_scale": 1.0, "v_scale": 1.0} if dtype == "fp8_e4m3" else {}
    cache = PagedKVCache(2, heads, dim, num_pages=5, page_tokens=page, block_sizes=sizes, layout=layout,
                         kv_dtype=dtype, **scales)
    elem = cache.dtype.itemsize
    for bs in cache.pool_sizes:
        k = cache.k_cache(1, bs)
        for b in range(k.shape[0]):
            assert k[b].data_ptr() % ALIGN == 0 and cache.v_cache(0, bs)[b].data_ptr() % ALIGN == 0
        assert cache.block_stride(bs) * elem >= bs * heads * dim * elem
        assert cache.padding_bytes[bs] == cache.block_stride(bs) * elem - bs * heads * dim * elem
    if (heads, dim, page) == (3, 80, 1):
        assert cache.padding_bytes == {1: 32}


def test_exports_match_the_block_tables():
    cache = PagedKVCache(LAYERS, HEADS, DIM, num_pages=16, page_tokens=4)
    for sid, n in [("a", 9), ("b", 4), ("c", 1)]:
        toks = [i % VOCAB for i in range(n)]
        cache.add(sid, toks, *kv_for(toks))
    md = cache.vllm_metadata(["a", "b", "c"])
    assert md.block_table.dtype == torch.int32 and md.seq_lens.tolist() == [9, 4, 1]
    assert md.block_table[0, :3].tolist() == cache.manager.block_table("a")
    slots = cache.slot_mapping("a")
    assert slots.dtype == torch.int32
    assert slots.tolist() == [cache.manager.block_table("a")[p // 4] * 4 + p % 4 for p in range(9)]
    fi = cache.flashinfer_metadata(["a", "b", "c"])
    assert fi.kv_indptr.tolist() == [0, 3, 4, 5] and fi.kv_last_page_len.tolist() == [1, 4, 1]
    assert all(t.dtype == torch.int32 for t in (fi.kv_indptr, fi.kv_indices, fi.kv_last_page_len))


def flashinfer_read(cache_nhd: torch.Tensor, indptr, indices, last_page_len):
    """A FlashInfer-style CSR reader: sequence i is pages indices[indptr[i]:indptr[i+1]], the last one
    holding last_page_len[i] tokens."""
    out = []
    for i in range(len(indptr) - 1):
        pages = indices[indptr[i]:indptr[i + 1]].long()
        if len(pages) == 0:
            out.append(cache_nhd[:0].flatten(0, 1))
            continue
        toks = cache_nhd[pages].flatten(0, 1)  # [pages * page_size, H, D]
        n = (len(pages) - 1) * cache_nhd.shape[1] + int(last_page_len[i])
        out.append(toks[:n])
    return out


@pytest.mark.parametrize("layout", list(Layout))
def test_flashinfer_reader_reconstructs_kv(layout):
    from workbench.core.layout import to_nhd

    cache = PagedKVCache(LAYERS, HEADS, DIM, num_pages=24, page_tokens=4, layout=layout)
    seqs = {"a": [1, 2, 3, 0, 1, 2, 3], "b": [0] * 8, "c": [2]}
    for sid, toks in seqs.items():
        cache.add(sid, toks, *kv_for(toks))
    fi = cache.flashinfer_metadata(list(seqs))
    for layer in range(LAYERS):
        ks = flashinfer_read(to_nhd(cache.k_cache(layer), layout, "k"), fi.kv_indptr, fi.kv_indices,
                             fi.kv_last_page_len)
        for (sid, toks), k in zip(seqs.items(), ks, strict=True):
            assert torch.equal(bits(k), bits(kv_for(toks)[0][layer])), (sid, layer)


def test_bad_input_leaves_cache_unchanged():
    cache = PagedKVCache(LAYERS, HEADS, DIM, num_pages=3, page_tokens=4)
    cache.add("a", [1, 2, 3], *kv_for([1, 2, 3]))
    before, pool_before = snapshot(cache.manager), cache.pool.clone()
    k, v = kv_for([1, 2])
    with pytest.raises(ValueError, match=r"k must be a tensor of shape \(2, 3, 2, 16\)"):
        cache.append("a", [1, 2, 3], k, v)
    with pytest.raises(ValueError, match="v must be on"):
        cache.append("a", [1, 2], k, v.to("meta"))
    with pytest.raises(OutOfBlocks):
        toks = [0] * 12
        cache.add("b", toks, *kv_for(toks))
    with pytest.raises(ValueError, match="share one block size"):
        c2 = PagedKVCache(1, 1, 16, num_pages=4, page_tokens=8, block_sizes=[2, 8],
                          policy=ByExpectedLength(2, 8, threshold=4))
        one = torch.randn(1, 1, 1, 16).half().to(workbench.device())
        c2.add("s", [1], one, one, expected_len=2)
        c2.add("l", [1], one, one, expected_len=50)
        c2.vllm_metadata(["s", "l"])
    assert snapshot(cache.manager) == before and torch.equal(bits(cache.pool), bits(pool_before))
    for kwargs, match in [({"layout": "xyz"}, "layout"), ({"kv_dtype": "fp7"}, "kv_dtype"),
                          ({"num_pages": 0}, "num_pages"), ({"kv_dtype": "int8"}, "k_scale and v_scale")]:
        with pytest.raises(ValueError, match=match):
            PagedKVCache(LAYERS, HEADS, DIM, **{"num_pages": 2, **kwargs})


# ---- state machine ----------------------------------------------------------------------
class CacheMachine(RuleBasedStateMachine):
    """Random add / append / fork / free / evict on a real cache; every live sequence must
    gather back, bit for bit, to K/V computed independently from its tokens."""

    layout = Layout.NHD

    @initialize(adaptive=st.booleans())
    def setup(self, adaptive):
        if adaptive:
            self.cache = PagedKVCache(LAYERS, HEADS, DIM, num_pages=6, page_tokens=8, block_sizes=[2, 8],
                                      policy=ByExpectedLength(2, 8, threshold=10), layout=self.layout)
        else:
            self.cache = PagedKVCache(LAYERS, HEADS, DIM, num_pages=10, page_tokens=4, layout=self.layout)
        self.model = {}
        self.next_id = 0

    def _try(self, fn, *args, **kwargs):
        before, pool_before = snapshot(self.cache.manager), self.cache.pool.clone()
        try:
            fn(*args, **kwargs)
            return True
        except OutOfBlocks:
            assert snapshot(self.cache.manager) == before
            assert torch.equal(bits(self.cache.pool), bits(pool_before)), "a failed op wrote K/V"
            return False

    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), max_size=12), shared=st.booleans(),
          expected=st.none() | st.integers(1, 30))
    def add(self, prompt, shared, expected):
        toks = ([1, 2, 3, 0, 1, 2, 3, 0] if shared else []) + prompt
        sid, self.next_id = self.next_id, self.next_id + 1
        if not toks:
            self._refused(self.cache.add, sid, toks, *kv_for(toks), match="prompt")
        elif self._try(self.cache.add, sid, toks, *kv_for(toks), expected_len=expected):
            self.model[sid] = toks

    def _refused(self, fn, *args, match, **kwargs):
        """A bad argument: ValueError naming it, and the cache exactly as before (tables, prefix map, bytes)."""
        before, pool_before = snapshot(self.cache.manager), self.cache.pool.clone()
        with pytest.raises(ValueError, match=match):
            fn(*args, **kwargs)
        assert snapshot(self.cache.manager) == before, "a refused call changed the allocator"
        assert torch.equal(bits(self.cache.pool), bits(pool_before)), "a refused call wrote K/V"

    @rule(data=st.data(), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
          shared=st.booleans(), bad=st.sampled_from(["float64", "int", "fp8", "strided", "shape", "tokens"]))
    def bad_write(self, data, prompt, shared, bad):
        """K/V the write kernel refuses, for a new prompt (maybe a prefix hit) or an append: refused up front."""
        toks = ([1, 2, 3, 0, 1, 2, 3, 0] if shared else []) + prompt
        target = data.draw(st.sampled_from(["add", *(["append"] if self.model else [])]))
        start = 0
        if target == "append":
            sid = data.draw(st.sampled_from(sorted(self.model)))
            start = len(self.model[sid])
            toks = toks[:max(1, MAX_POS - start)]
        k, v = kv_for(toks, start) if start + len(toks) <= MAX_POS else kv_for([0] * len(toks))
        if bad == "float64":
            k = k.double()
        elif bad == "int":
            v = v.to(torch.int32)
        elif bad == "fp8":
            k = k.to(torch.float8_e4m3fn)
        elif bad == "strided":  # head_dim not contiguous
            v = v.transpose(2, 3).contiguous().transpose(2, 3)
        elif bad == "shape":
            k = k[:, :-1]
        else:
            toks = [float(t) + 0.5 for t in toks]
        match = "tokens" if bad == "tokens" else ("k" if bad in ("float64", "fp8", "shape") else "v")
        if target == "add":
            self._refused(self.cache.add, self.next_id, toks, k, v, match=match)
        else:
            self._refused(self.cache.append, sid, toks, k, v, match=match)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), new=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def append(self, data, new):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        n = len(self.model[sid])
        if n + len(new) <= MAX_POS and self._try(self.cache.append, sid, new, *kv_for(new, start=n)):
            self.model[sid] = self.model[sid] + new

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.fork(sid, self.next_id)
        self.model[self.next_id] = list(self.model[sid])
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free(sid)
        del self.model[sid]

    @rule()
    def evict(self):
        self.cache.manager.pool.evict(1)

    @invariant()
    def allocator_invariants(self):
        self.cache.manager.check_invariants()

    @invariant()
    def sequences_read_back(self):
        for sid, toks in self.model.items():
            k, v = gather_ref(self.cache, sid)
            k_ref, v_ref = kv_for(toks)
            assert torch.equal(bits(k), bits(k_ref)) and torch.equal(bits(v), bits(v_ref)), f"seq {sid}"

    def teardown(self):
        if getattr(self, "model", None):  # the gather kernel agrees with the reference reader
            sid = max(self.model)
            k, v = self.cache.gather(sid)
            k_ref, v_ref = kv_for(self.model[sid])
            assert torch.equal(bits(k), bits(k_ref)) and torch.equal(bits(v), bits(v_ref))


def _machine(layout):
    cls = type(f"Cache{layout.name}", (CacheMachine,), {"layout": layout})
    cls.TestCase.settings = settings(max_examples=15, stateful_step_count=20, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
    return cls.TestCase


TestCacheNHD = _machine(Layout.NHD)
TestCacheHND = _machine(Layout.HND)
TestCacheVLLM = _machine(Layout.VLLM)
