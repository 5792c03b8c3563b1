"""Every finite input either quantizes to finite codes, scales and read-back, or is refused before anything changes
(issue 30, item 5): huge values (up to 3e38), tiny ones (subnormal scales), constant rows, for every scheme, through
the cache (kernels and torch ops), ``Scheme.roundtrip`` and the write kernels, which agree with the reference code by
code. Values beyond fp16 saturate where a scheme stores fp16 (group scales, zero points, the KIVI residual, the
values the cache quantizes for int4/int2)."""

import pytest
import torch
from conftest import bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_allocator import snapshot
from workbench.kernels import write_kv
from workbench.kernels.write.reference import quant_code_distance

import workbench
from workbench import quant
from workbench.cache import PagedKVCache
from workbench.core.layout import to_nhd
from workbench.quant import blocks as qblocks

pytestmark = pytest.mark.kernels

DEV = workbench.device()
HUGE = [1e5, -1e5, 7e4, 3e38, -3e38, 1e30, 2.0**126, -(2.0**127)]
TINY = [1e-30, -1e-38, 1e-40, 1e-44, 0.0]


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


def make(name, ops="kernels", **kw):
    s = quant.get(name)
    scales = dict(k_scale=torch.tensor([0.05]), v_scale=torch.tensor([0.05])) if s.static else {}
    return PagedKVCache(1, 2, 64, 8, page_tokens=32, kv_dtype=s, device=DEV if ops == "kernels" else "cpu", ops=ops,
                        **scales, **kw)


def state(cache):
    """Allocator, bytes, KIVI residuals and the non-finite counter, for 'a refused call changed nothing'."""
    recorded = {s: cache.residual_state(s) for s in cache.manager.seq_ids}
    res = {s: tuple(bits(t).clone() for t in r) for s, (_, r) in recorded.items() if r is not None}
    quantized = {s: q for s, (q, _) in recorded.items() if q is not None}
    return snapshot(cache.manager), bits(cache.pool).clone(), res, quantized, cache.nonfinite_count()


def assert_same(a, b):
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and a[3] == b[3] and a[4] == b[4]
    assert a[2].keys() == b[2].keys()
    assert all(torch.equal(x, y) for s in a[2] for x, y in zip(a[2][s], b[2][s], strict=True))


# ---- the reproduction ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ops", ["kernels", "torch"])
def test_one_huge_key_in_int4_token_reads_back_finite(ops):
    """One K element of 1e5 (beyond fp16) used to turn its group of 32 into NaN, silently."""
    cache = PagedKVCache(1, 2, 64, 8, page_tokens=32, kv_dtype="int4/token", ops=ops,
                         device=DEV if ops == "kernels" else "cpu")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 40, 2, 64, generator=g), torch.randn(1, 40, 2, 64, generator=g)
    k[0, 3, 1, 5] = 1e5
    cache.add("a", list(range(40)), k.to(cache.device), v.to(cache.device))
    kr, vr = cache.read("a")
    assert int((~torch.isfinite(kr)).sum()) == 0 and bool(torch.isfinite(vr).all())
    assert 65000 < float(kr[0, 3, 1, 5]) < 65600  # the cache quantizes the fp16 values, saturated at 65504
    assert float((kr[0, 3, 1, :32] - k[0, 3, 1, :32].clamp(max=65504).to(kr.device)).abs().max()) < 65504 / 15
    out = cache.decode(torch.randn(1, 2, 64, generator=g).to(cache.device), ["a"], 0)
    assert bool(torch.isfinite(out).all()) and cache.nonfinite_count() == 0


@pytest.mark.parametrize("name", ["int4/kivi", "int2/kivi", "int4/token", "int2/token"])
def test_roundtrip_of_values_beyond_fp16_is_finite(name):
    """Scheme.roundtrip rounded the zero point (a group's minimum) to fp16: -1e5 made it -Inf and the group NaN."""
    s = quant.get(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(160, 2, 64, generator=g)
    x[0, 0, :] = -1e5  # a whole group below fp16's range: its zero point saturates at -65504
    x[40, 1, 3] = 2e5
    x[130:, 0, 0] = 9e4  # in KIVI's fp16 residual: saturated at 65504
    for kind in "kv":
        y = s.roundtrip(x, kind)
        assert bool(torch.isfinite(y).all()), kind
        qz = s.quantize(x, kind)
        assert bool(torch.isfinite(qz.scale.float()).all() and torch.isfinite(qz.zero.float()).all())
    assert float(s.roundtrip(x, "v")[0, 0].max()) == -65504.0  # saturated, not Inf


def test_values_a_scheme_cannot_store_are_refused_by_name():
    x = torch.zeros(4, 2, 64)
    x[2, 1, 7] = 1e5
    with pytest.raises(ValueError, match=r"x holds 1 values fp16 cannot store .*\[token, head, dim\] = \[2, 1, 7\]"):
        quant.get("fp16").quantize(x)
    x[2, 1, 7] = 3e38
    with pytest.raises(ValueError, match=r"int8_asym/token cannot store .*2\*\*126"):
        quant.get("int8_asym/token").roundtrip(x)
    assert bool(torch.isfinite(quant.get("int8/token").roundtrip(x)).all())  # symmetric: fp32 scales hold it
    x[2, 1, 7] = float("nan")
    with pytest.raises(quant.NonFiniteError, match="NaN/Inf"):
        quant.get("int4/token").quantize(x)
    for bad in (0.0, -1.0, float("inf"), 1e37):  # 1e37 * 127 overflows: a saturated code would read back Inf
        with pytest.raises(ValueError, match="k_scale of int8/tensor must hold finite values > 0"):
            PagedKVCache(1, 2, 64, 8, kv_dtype="int8/tensor", k_scale=torch.tensor([bad]), v_scale=torch.tensor([1.]))


def test_tiny_values_never_divide_by_a_zero_scale():
    """amax / qmax underflowing to 0 (amax a small subnormal) was a division by zero: NaN codes."""
    x = torch.zeros(3, 2, 64)
    x[0, 0, 0], x[1, 1, 1], x[2, 0, :] = 1e-44, -1e-45, 1e-44
    for name in ("fp8_e4m3/token", "int8/token", "int8_asym/token", "int4/token", "fp8_e5m2/tensor"):
        y = quant.get(name).roundtrip(x, "v")
        assert bool(torch.isfinite(y).all()) and float(y.abs().max()) < 1e-30, name


# ---- the write kernels agree with the reference on the edges -----------------------------------------------------
EDGE_SCHEMES = ["fp8_e4m3/token", "fp8_e5m2/token", "int8/token", "int8_asym/token", "int4/token", "int2/token",
                "int4/kivi", "int2/kivi"]


def edge_values(g, T, H, D, limit):
    """Random rows with huge entries, rows beyond fp16, constant rows and tiny (normal) rows, all below ``limit``."""
    x = torch.randn(T, H, D, generator=g)
    big = [v for v in HUGE if abs(v) <= limit]
    for t in range(T):
        kind = t % 5
        if kind == 1:
            x[t, t % H, (7 * t) % D] = big[t % len(big)]
        elif kind == 2:
            x[t, :, : D // 2] *= 1e5  # a group entirely beyond fp16
        elif kind == 3:
            x[t] = big[(t // 5) % len(big)] if t % 2 else 0.0  # constant rows
        elif kind == 4:
            x[t] *= 1e-30  # tiny but normal scales (a GPU may flush subnormal ones: checked for finiteness below)
    return x


@pytest.mark.parametrize("name", EDGE_SCHEMES)
def test_write_kernel_matches_the_reference_on_huge_and_tiny_values(name):
    s = quant.get(name)
    s = s.with_params(group=16, residual=0) if s.packed else s
    g = torch.Generator().manual_seed(len(name))
    H, D, nb, bs = 2, 64, 3, 16
    T = nb * bs
    k, v = (edge_values(g, T, H, D, s.input_limit) for _ in range(2))
    caches = [qblocks.empty_cache(s, "nhd", kind, nb, bs, H, D, DEV, fill=0xFF) for kind in "kv"]
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    write_kv(k.to(DEV), v.to(DEV), caches[0], caches[1], "nhd", torch.arange(T, device=DEV), quant=s,
             nonfinite=counter)
    assert int(counter) == 0
    for kind, x, cache in (("k", k, caches[0]), ("v", v, caches[1])):
        want = s.quantize(x, kind)
        got = to_nhd(cache, "nhd", kind).reshape(T, H, -1).cpu()
        if got.dtype.is_floating_point:
            assert int(quant_code_distance(got, want.codes).max()) == 0, f"{kind} codes differ"
        else:
            bad = (got != want.codes).nonzero()[:3].tolist()
            assert torch.equal(got, want.codes), f"{kind} codes differ at {bad}"
        sc = qblocks.block_scales(s, kind, bs, H, D)
        scale, zero = qblocks.scale_views(qblocks.plane_of(cache), sc)
        got_s = scale.cpu().reshape(want.scale.shape)
        assert torch.equal(got_s, want.scale), f"{kind} scales differ"
        assert bool(torch.isfinite(got_s.float()).all())
        if want.zero is not None:
            assert torch.equal(zero.cpu().reshape(want.zero.shape), want.zero), f"{kind} zero points differ"


def test_write_kernel_refuses_what_the_scheme_cannot_store():
    s = quant.get("int8_asym/token")
    kc, vc = (qblocks.empty_cache(s, "nhd", kind, 2, 16, 2, 64, DEV, fill=0) for kind in "kv")
    k = torch.zeros(4, 2, 64, device=DEV)
    k[1, 0, 0] = 3e38
    with pytest.raises(ValueError, match="key holds 1 values int8_asym/token cannot store"):
        write_kv(k, k.clone().zero_(), kc, vc, "nhd", torch.arange(4, device=DEV), quant=s)
    assert not bits(kc).any()


# ---- the property: finite in, finite out (or refused, nothing changed) -------------------------------------------
MAGNITUDE = st.sampled_from([1.0, 1e3, 7e4, 1e5, 1e20, 2.0**126, 3e38, 1e-30, 1e-40, 1e-44])


@st.composite
def finite_kv(draw, n):
    """``[1, n, 2, 64]`` K and V: random normals, some elements, rows or groups scaled to huge or tiny magnitudes."""
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        x = torch.randn(1, n, 2, 64, generator=g)
        for _ in range(draw(st.integers(0, 4))):
            t, h, c = draw(st.integers(0, n - 1)), draw(st.integers(0, 1)), draw(st.integers(0, 63))
            m = draw(MAGNITUDE) * draw(st.sampled_from([1.0, -1.0]))
            what = draw(st.sampled_from(["element", "row", "group", "scale_row"]))
            if what == "element":
                x[0, t, h, c] = m
            elif what == "row":
                x[0, t, h] = m
            elif what == "group":
                x[0, t, h, (c // 32) * 32:(c // 32) * 32 + 32] = m
            else:
                x[0, t, h] *= m
        out.append(torch.nan_to_num(x, posinf=3e38, neginf=-3e38).clamp(-3e38, 3e38))  # finite: the property's input
    return out


@pytest.mark.parametrize("ops", ["torch", "kernels"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(name=st.sampled_from(sorted(quant.SCHEMES)), n=st.one_of(st.integers(1, 40), st.integers(160, 200)),
       data=st.data())
def test_finite_input_reads_back_finite_or_is_refused_unchanged(ops, name, n, data):
    cache = make(name, ops)
    k0, v0 = data.draw(finite_kv(3), label="prefix")
    k0, v0 = k0.clamp(-60000, 60000), v0.clamp(-60000, 60000)  # a stored prefix every scheme takes
    cache.add("p", [1, 2, 3], k0.to(cache.device), v0.to(cache.device))
    k, v = data.draw(finite_kv(n), label="kv")
    op = data.draw(st.sampled_from(["add", "append"]), label="op")
    before = state(cache)
    try:
        if op == "add":
            cache.add("a", list(range(10, 10 + n)), k.to(cache.device), v.to(cache.device))
        else:
            cache.append("p", list(range(10, 10 + n)), k.to(cache.device), v.to(cache.device))
    except ValueError as e:
        assert "cannot store" in str(e), e  # refused only for what the scheme cannot hold, and saying so
        assert_same(state(cache), before)
        assert cache.scheme.input_limit < 3e38 and float(torch.cat([k, v]).abs().max()) > cache.scheme.input_limit
        return
    seq = "a" if op == "add" else "p"
    kr, vr = cache.read(seq)
    assert bool(torch.isfinite(kr).all() and torch.isfinite(vr).all()), f"{name}: non-finite read-back"
    assert cache.nonfinite_count() == 0
