"""Quantized schemes inside PagedKVCache: scales live in the blocks, so copy-on-write, compaction and prefix hits
stay bit-exact, scales included; KIVI keeps its newest tokens in fp16 and decode merges them; bad input changes
nothing."""

import pytest
import torch
from conftest import bits, rel_err
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_allocator import snapshot
from workbench.kernels.decode.reference import paged_decode_ref

import workbench
from workbench import quant
from workbench.allocator import ByExpectedLength
from workbench.cache import PagedKVCache, compaction

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

SCHEMES = ["fp8_e4m3/token", "int8_asym/token", "int4/token", "int4/kivi"]
L, H, D = 1, 2, 64


def make(name, **kw):
    s = quant.get(name)
    if s.packed and s.key_mode == "channel":
        s = s.with_params(group=8, residual=8)
    return PagedKVCache(L, H, D, 24, page_tokens=16, kv_dtype=s, **kw)


def kv(n, g):
    dev = workbench.device()
    return (torch.randn(L, n, H, D, generator=g) * 2).to(dev), torch.randn(L, n, H, D, generator=g).to(dev)


def started(name, seq, n, seed):
    """A cache of scheme ``name`` holding one sequence of ``n`` random tokens; and its generator."""
    g = torch.Generator().manual_seed(seed)
    cache = make(name)
    k, v = kv(n, g)
    cache.add(seq, list(range(n)), k, v)
    return cache, g, k


def raw_blocks(cache, seq) -> torch.Tensor:
    """The sequence's blocks, every layer, K and V, codes and scales, as bytes."""
    bs = cache.manager.block_size(seq)
    ids = torch.tensor(cache.manager.block_table(seq), dtype=torch.long)
    return cache.blocks(bs)[:, :, ids].contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("name", SCHEMES)
def test_read_is_the_schemes_roundtrip_and_decode_matches(name):
    cache, g, k = started(name, "a", 37, seed=1)
    k2, v2 = kv(3, g)
    for i in range(3):
        cache.append("a", [100 + i], k2[:, i:i + 1], v2[:, i:i + 1])
    K = torch.cat([k, k2], 1)
    kr, vr = cache.read("a")
    s = cache.scheme
    n = cache.quantized_tokens("a")
    assert n == s.quantized_tokens(40) if s.packed else n == 40
    for layer in range(L):  # the cache stores exactly what the scheme says (its residual in fp16)
        if s.packed:  # KIVI quantizes (and keeps) the fp16 values
            kq = s.with_params(residual=0).roundtrip(K[layer, :n].half().float().cpu(), "k")
        else:
            kq = s.roundtrip(K[layer].cpu(), "k")
        assert torch.equal(kr[layer, :n].cpu(), kq)
        assert torch.equal(kr[layer, n:].cpu(), K[layer, n:].half().float().cpu())
    q = torch.randn(1, H * 2, D, generator=g).half().to(kr.device)
    for layer in range(L):
        out = cache.decode(q, ["a"], layer)
        one = torch.zeros((1, 1), dtype=torch.int32, device=kr.device)
        ref = paged_decode_ref(q, kr[layer][None], vr[layer][None], "nhd", one,
                               torch.tensor([40], dtype=torch.int32, device=kr.device))
        assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("name", SCHEMES)
def test_copy_on_write_and_prefix_hits_are_bit_exact(name):
    cache, g, _ = started(name, "p", 40, seed=2)
    parent_bytes = raw_blocks(cache, "p")
    parent_read = cache.read("p")
    cache.fork("p", "c")
    kc, vc = kv(20, g)
    cache.append("c", list(range(500, 520)), kc, vc)  # writes into a copy of the shared last block
    assert torch.equal(raw_blocks(cache, "p"), parent_bytes), "the parent's blocks (codes and scales) changed"
    for a, b in zip(cache.read("p"), parent_read, strict=True):
        assert torch.equal(a, b)
    child = cache.read("c")
    shared = cache.quantized_tokens("p")  # KIVI: the child has since quantized some of the parent's fp16 residual
    for a, b in zip(child, parent_read, strict=True):
        assert torch.equal(a[:, :shared], b[:, :shared])
    # a later prompt with the same prefix hits the published blocks and reads the same values, scales included
    full = cache.quantized_tokens("p") // 16 * 16
    k3, v3 = kv(40, g)
    placed = cache.add("q", list(range(40)), k3, v3)
    assert placed.first == full > 0
    for a, b in zip(cache.read("q"), parent_read, strict=True):
        assert torch.equal(a[:, :full], b[:, :full])


@pytest.mark.parametrize("name", ["fp8_e4m3/token", "int8_asym/token", "int4/token"])
def test_compaction_rehome_carries_scales(name):
    cache = PagedKVCache(1, 2, 32, 6, page_tokens=8, block_sizes=[2, 8], kv_dtype=name,
                         policy=ByExpectedLength(2, 8, threshold=10), prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    dev = workbench.device()
    for sid, n, exp in [("long", 3, 100)] + [(f"s{i}", 2, 4) for i in range(12)]:
        k, v = (torch.randn(1, n, 2, 32, generator=g).to(dev) for _ in range(2))
        cache.add(sid, list(range(n)), k, v, expected_len=exp)
    for i in (1, 2, 3, 6, 7, 9, 10, 11):
        cache.free(f"s{i}")
    before = {sid: cache.read(sid) for sid in cache.manager.seq_ids}
    plan = compaction.plan(cache)
    assert plan.rehomes and plan.moves
    compaction.apply(cache, plan)
    assert cache.manager.block_size("long") == 2
    for sid, (k, v) in before.items():
        k2, v2 = cache.read(sid)
        assert torch.equal(k2, k) and torch.equal(v2, v), sid


def test_bad_input_changes_nothing():
    g = torch.Generator().manual_seed(3)
    cache = make("int4/kivi")
    k, v = kv(20, g)
    cache.add("a", list(range(20)), k, v)
    free = cache.manager.pool.free_blocks(16) if hasattr(cache.manager.pool, "free_blocks") else None
    state = (cache.manager.num_tokens("a"), cache.quantized_tokens("a"), cache.residual("a")[0].clone(),
             raw_blocks(cache, "a"), free)
    bad_k, bad_v = kv(5, g)
    bad_k[0, 2, 0, 3] = float("nan")
    with pytest.raises(quant.NonFiniteError, match=r"k holds 1 NaN/Inf"):
        cache.append("a", list(range(5)), bad_k, bad_v)
    with pytest.raises(quant.NonFiniteError):
        cache.add("b", list(range(5)), bad_k, bad_v)
    with pytest.raises(ValueError, match="shape"):
        cache.append("a", [1], k[:, :2], v[:, :2])
    assert "b" not in cache.manager.seq_ids
    after = (cache.manager.num_tokens("a"), cache.quantized_tokens("a"), cache.residual("a")[0],
             raw_blocks(cache, "a"), cache.manager.pool.free_blocks(16) if free is not None else None)
    assert after[:2] == state[:2] and torch.equal(after[2], state[2]) and torch.equal(after[3], state[3])
    assert after[4] == state[4]
    cache.manager.check_invariants()


def test_schemes_a_cache_cannot_hold_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"kv_dtype must be a quantization scheme .*int4/kivi"):
        PagedKVCache(1, 2, 64, 4, kv_dtype="int3/kivi")
    with pytest.raises(ValueError, match=r"int2/kivi cannot be stored in the nhd layout .*head_dim >= 64"):
        PagedKVCache(1, 2, 32, 4, kv_dtype="int2")
    with pytest.raises(ValueError, match=r"int4/kivi cannot be stored in the vllm layout .*block size 16.*multiple"):
        PagedKVCache(1, 2, 64, 4, layout="vllm", kv_dtype="int4")  # KIVI key groups of 32 > 16-token blocks
    with pytest.raises(ValueError, match="uint8 codes"):
        PagedKVCache(1, 2, 64, 4, kv_dtype=torch.uint8)
    with pytest.raises(ValueError, match="k_scale and v_scale are needed exactly"):
        PagedKVCache(1, 2, 64, 4, kv_dtype="fp8_e4m3/token", k_scale=torch.ones(1), v_scale=torch.ones(1))
    cache = PagedKVCache(1, 2, 64, 4, kv_dtype="fp8_e4m3/head", k_scale=torch.ones(2), v_scale=torch.ones(2))
    assert cache.scheme.name == "fp8_e4m3/head" and cache.scales(0, "k") == (None, None)
    assert PagedKVCache(1, 2, 64, 4, page_tokens=32, kv_dtype="int4").scheme.name == "int4/kivi"


def test_kivi_decode_of_sequences_still_all_in_the_fp16_residual():
    cache, g, _ = started("int4/kivi", "short", 5, seed=4)  # 5 tokens < residual + group: nothing quantized yet
    k, v = kv(30, g)
    cache.add("long", list(range(100, 130)), k, v)
    assert cache.quantized_tokens("short") == 0 and cache.quantized_tokens("long") > 0
    q = torch.randn(2, H * 2, D, generator=g).half().to(k.device)
    out = cache.decode(q, ["short", "long"], 0)
    for i, sid in enumerate(["short", "long"]):
        kr, vr = cache.read(sid)
        one = torch.zeros((1, 1), dtype=torch.int32, device=k.device)
        ref = paged_decode_ref(q[i:i + 1], kr[0][None], vr[0][None], "nhd", one,
                               torch.tensor([kr.shape[1]], dtype=torch.int32, device=k.device))
        assert rel_err(out[i:i + 1], ref) < 1e-3, sid


BAD = st.sampled_from(["nan", "inf", "short", "heads", "float64", "device"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(SCHEMES), bad=BAD, which=st.sampled_from(["k", "v"]), op=st.sampled_from(["add", "append"]),
       n=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_random_bad_kv_changes_nothing(name, bad, which, op, n, seed):
    """A refused add/append of a quantized cache leaves the allocator, the bytes (codes and scales), the fp16
    residual and the prefix cache exactly as they were."""
    cache, g, _ = started(name, "a", 13, seed=seed)
    k, v = kv(n, g)
    t = {"k": k, "v": v}[which]
    if bad in ("nan", "inf"):
        t.view(-1)[int(torch.randint(t.numel(), (1,), generator=g))] = float(bad)
    elif bad == "short":
        t = t[:, :-1]
    elif bad == "heads":
        t = t[:, :, :1]
    elif bad == "float64":
        t = t.double()
    else:
        t = t.to("meta")
    k, v = (t, v) if which == "k" else (k, t)
    res = cache.residual("a")
    before = (snapshot(cache.manager), bits(cache.pool).clone(), cache.quantized_tokens("a"),
              None if res is None else bits(res[0]).clone())
    with pytest.raises(ValueError, match=which):
        if op == "add":
            cache.add("b", list(range(n)), k, v)
        else:
            cache.append("a", list(range(n)), k, v)
    res = cache.residual("a")
    after = (snapshot(cache.manager), bits(cache.pool), cache.quantized_tokens("a"),
             None if res is None else bits(res[0]))
    assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == before[2]
    assert (after[3] is None) == (before[3] is None) and (after[3] is None or torch.equal(after[3], before[3]))
    assert "b" not in cache.manager.seq_ids


def test_calibration_pass_gives_the_caches_static_scales():
    g = torch.Generator().manual_seed(6)
    batches = [kv(n, g) for n in (7, 30, 12)]
    batches[1][0][0, 3, 1, 5] = 40.0  # one large key in the middle batch sets head 1's scale
    cal = quant.Calibrator(quant.get("fp8_e4m3/head"))
    for k, v in batches:
        cal.observe(k, v)
    ks, vs = cal.scales()
    k_all = torch.cat([k for k, _ in batches], 1)[0].cpu()
    assert torch.equal(ks, quant.get("fp8_e4m3/head").calibrate(k_all)) and ks.shape == (H,)
    assert float(ks[1]) == float(torch.tensor(40.0) / 448.0)  # fp32, as the scale is stored
    per_tensor = quant.Calibrator(quant.get("int8/tensor"), margin=1.25)
    per_tensor.observe(*batches[0])
    assert per_tensor.scales()[0].shape == (1,)
    cache = PagedKVCache(L, H, D, 8, page_tokens=16, kv_dtype="fp8_e4m3/head", k_scale=ks, v_scale=vs)
    cache.add("a", list(range(30)), *batches[1])
    kr, _ = cache.read("a")
    assert rel_err(kr, batches[1][0]) < 0.1 and float(kr[0, 3, 1, 5]) == 40.0  # the maximum is a code exactly
    with pytest.raises(ValueError, match="static scales"):
        quant.Calibrator(quant.get("fp8_e4m3/token"))
    with pytest.raises(ValueError, match="at least one batch"):
        quant.Calibrator(quant.get("int8/head")).scales()
    with pytest.raises(ValueError, match="margin"):
        quant.Calibrator(quant.get("int8/head"), margin=0.5)
    with pytest.raises(quant.NonFiniteError):
        cal.observe(torch.full((1, 2, H, D), float("nan")), batches[0][1])
