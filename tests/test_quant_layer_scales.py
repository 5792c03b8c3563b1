"""Static scales per layer (issue 31): ``quant.Calibrator(num_layers=L)`` gives each layer's ``amax / qmax``, a
``PagedKVCache`` takes them as ``[L]`` / ``[L, H]`` beside the per-cache ``[]`` / ``[H]`` and each layer's writes and
reads use its own (the PyTorch ops here; tests/test_quant_layer_scales_kernels.py: the kernels and the decode plan);
bad scales and bad calibration input are refused by name with nothing changed."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workbench.kernels.decode.reference import paged_decode_ref

from workbench import quant
from workbench.cache import PagedKVCache

STATIC = [n for n, s in quant.SCHEMES.items() if s.needs_static_scales]
L, H, D = 3, 2, 32
MAG = torch.tensor([0.5, 3.0, 12.0])  # each layer's range, 24x apart (the real model's V spans 22x)


def layered_kv(seed: int, n: int = 40, layers: int = L, heads: int = H):
    """K/V ``[layers, n, heads, D]`` whose layers' ranges differ (V's in the opposite order from K's)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.linspace(0.5, 12.0, layers)
    k = torch.randn(layers, n, heads, D, generator=g) * mag[:, None, None, None]
    v = torch.randn(layers, n, heads, D, generator=g) * mag.flip(0)[:, None, None, None]
    return k, v


def calibrated(name, k, v, **kw):
    cal = quant.Calibrator(quant.get(name), num_layers=k.shape[0], **kw)
    cal.observe(k, v)
    return cal


# ---- the calibrator ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", STATIC)
def test_per_layer_calibration_is_each_layers_amax_over_qmax(name):
    s = quant.get(name)
    k, v = layered_kv(1)
    cal = calibrated(name, k, v)
    ks, vs = cal.scales()
    per_head = s.static_scale_count(H) == H
    assert ks.shape == vs.shape == ((L, H) if per_head else (L,)) and ks.dtype == torch.float32
    for layer in range(L):  # Scheme.calibrate of that layer alone: amax / qmax, over the tensor or per head
        assert torch.equal(ks[layer].reshape(-1), s.calibrate(k[layer]).reshape(-1)), layer
        assert torch.equal(vs[layer].reshape(-1), s.calibrate(v[layer]).reshape(-1)), layer
        amax = k[layer].abs().amax(dim=(0, 2)) if per_head else k[layer].abs().amax()
        assert torch.equal(ks[layer], (amax / s.qmax).reshape(ks[layer].shape))
    # the per-cache pair from the same calibrator is the plain calibrator's: the widest layer's
    plain = quant.Calibrator(s)
    plain.observe(k, v)
    for a, b in zip(cal.scales(per_layer=False), plain.scales(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(plain.scales()[0].reshape(-1), s.calibrate(k.reshape(-1, H, D)).reshape(-1))


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(STATIC), layers=st.integers(1, 4), heads=st.integers(1, 3),
       batches=st.lists(st.integers(1, 9), min_size=1, max_size=3), margin=st.floats(1.0, 2.0),
       by_layer=st.booleans(), seed=st.integers(0, 2**16))
def test_batches_layer_by_layer_or_stacked_give_the_running_maximum(name, layers, heads, batches, margin, by_layer,
                                                                     seed):
    """Batches of any sizes, observed stacked or one layer at a time: each layer's scale is amax * margin / qmax of
    everything that layer saw."""
    s = quant.get(name)
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(layers, n, heads, D, generator=g) * torch.rand(layers, 1, heads, 1, generator=g) * 9,
             torch.randn(layers, n, heads, D, generator=g)) for n in batches]
    cal = quant.Calibrator(s, margin, num_layers=layers)
    for k, v in data:
        if by_layer:
            for layer in range(layers):
                cal.observe(k[layer], v[layer], layer=layer)
        else:
            cal.observe(k, v)
    ks, vs = cal.scales()
    for i, (got, t) in enumerate(((ks, 0), (vs, 1))):
        x = torch.cat([d[t] for d in data], 1)  # [layers, tokens, heads, D]
        amax = x.abs().amax(dim=(1, 3))  # [layers, heads]
        want = s.layer_scales_from_amax(amax, margin)
        assert torch.equal(got, want), "kv"[i]
        per_head = s.static_scale_count(heads) == heads
        expect = (amax if per_head else amax.amax(1)) * margin / s.qmax
        assert torch.allclose(got.reshape(-1), expect.reshape(-1), rtol=1e-6)


def _snapshot(cal):
    return cal.batches, {n: a.clone() for n, a in cal._amax.items()}, None if cal._seen is None else cal._seen.clone()


def _same(a, b):
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][n], b[1][n]) for n in a[1]) and (
        (a[2] is None and b[2] is None) or torch.equal(a[2], b[2]))


BAD_OBSERVE = ["layers", "layer_range", "layer_type", "nan", "inf", "heads", "head_dim", "empty", "rank", "type",
               "layer_per_cache"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(STATIC), bad=st.sampled_from(BAD_OBSERVE), which=st.sampled_from("kv"),
       seed=st.integers(0, 2**16))
def test_bad_calibration_input_is_refused_by_name_and_changes_nothing(name, bad, which, seed):
    k, v = layered_kv(seed, n=6)
    per_cache = bad == "layer_per_cache"
    cal = quant.Calibrator(quant.get(name)) if per_cache else calibrated(name, k, v)
    if per_cache:
        cal.observe(k, v)
    before = _snapshot(cal)
    t = {"k": k, "v": v}[which].clone()
    layer = None
    match = which
    if bad == "layers":
        t = t[:-1]
    elif bad in ("nan", "inf"):
        t.view(-1)[seed % t.numel()] = float(bad)
    elif bad == "heads":
        t = t[:, :, :1]
    elif bad == "head_dim":
        t = t[..., :-1]
    elif bad == "empty":
        t = t[:, :0]
    elif bad == "rank":
        t = t[0]
    elif bad == "type":
        t = t.tolist()
    elif bad in ("layer_range", "layer_per_cache"):
        t, layer, match = t[0], (L if bad == "layer_range" else 0), "layer"
    elif bad == "layer_type":
        t, layer, match = t[0], 1.0, "layer"
    args = (t, v) if which == "k" else (k, t)
    if bad in ("heads", "head_dim"):
        match = "k and v|heads"
    with pytest.raises(ValueError, match=match):
        cal.observe(*args, layer=layer)
    assert _same(_snapshot(cal), before), "a refused observe changed the calibrator"


def test_scales_need_every_layer_and_a_per_layer_calibrator():
    k, v = layered_kv(2)
    cal = quant.Calibrator(quant.get("int8/head"), num_layers=L)
    cal.observe(k[0], v[0], layer=0)
    cal.observe(k[2], v[2], layer=2)
    with pytest.raises(ValueError, match=r"layers \[1\] were never observed"):
        cal.scales()
    with pytest.raises(ValueError, match=r"layers \[1\] were never observed"):
        cal.scales(per_layer=False)
    cal.observe(k[1], v[1], layer=1)
    assert cal.scales()[0].shape == (L, H)
    with pytest.raises(ValueError, match="per_layer scales need a calibrator built with num_layers"):
        quant.Calibrator(quant.get("int8/head")).scales(per_layer=True)
    with pytest.raises(ValueError, match="per_layer must be"):
        cal.scales(per_layer="yes")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_layers"):
            quant.Calibrator(quant.get("int8/head"), num_layers=bad)
    with pytest.raises(ValueError, match="takes no static scales"):
        quant.get("int8/token").layer_scales_from_amax(torch.ones(L, H))


# ---- the cache (PyTorch ops) ---------------------------------------------------------------------------------
def cache_of(name, k_scale, v_scale, ops="torch", layers=L, heads=H, **kw):
    return PagedKVCache(layers, heads, D, 8, page_tokens=16, kv_dtype=name, k_scale=k_scale, v_scale=v_scale,
                        ops=ops, device="cpu" if ops == "torch" else None, **kw)


@pytest.mark.parametrize("name", STATIC)
def test_each_layer_reads_back_with_its_own_scale(name):
    """Every layer stores exactly the scheme's round trip with that layer's scale; the narrow layers' error shrinks
    with their range (per cache they are quantized on the widest layer's grid)."""
    s = quant.get(name)
    k, v = layered_kv(3)
    cal = calibrated(name, k, v)
    errs = {}
    for by, (ks, vs) in (("layer", cal.scales()), ("cache", cal.scales(per_layer=False))):
        cache = cache_of(name, ks, vs)
        assert cache.per_layer_scales == (by == "layer")
        cache.add("a", list(range(40)), k, v)
        kr, vr = cache.read("a")
        for layer in range(L):
            lk, lv = cache.layer_scales(layer)
            assert torch.equal(kr[layer], s.roundtrip(k[layer], "k", lk)), (by, layer)
            assert torch.equal(vr[layer], s.roundtrip(v[layer], "v", lv)), (by, layer)
            if by == "layer":
                assert torch.equal(lk.reshape(-1), ks[layer].reshape(-1))
                if s.format.codes == "int":  # within range: half a step of the layer's own scale
                    assert bool(((kr[layer] - k[layer]).abs() <= lk.reshape(1, -1, 1) / 2 * (1 + 1e-6)).all())
        errs[by] = [float((vr[layer] - v[layer]).abs().max() / v[layer].abs().max()) for layer in range(L)]
    # V's widest layer is layer 0 (the ranges are flipped): its scale is the per-cache one; int8's error in layer 2
    # (24x narrower) shrinks with its own scale (fp8's relative error depends little on the scale)
    assert errs["layer"][0] == errs["cache"][0]
    if s.format.codes == "int":
        assert errs["layer"][2] * 8 < errs["cache"][2]


@pytest.mark.parametrize("name", ["int8/tensor", "fp8_e4m3/head"])
def test_decode_per_layer_equals_the_reference_on_each_layers_values(name):
    k, v = layered_kv(4)
    ks, vs = calibrated(name, k, v).scales()
    cache = cache_of(name, ks, vs)
    cache.add("a", list(range(40)), k, v)
    cache.add("b", list(range(100, 117)), k[:, :17], v[:, :17])
    kr, vr = cache.read("a")
    q = torch.randn(2, 2 * H, D, generator=torch.Generator().manual_seed(4))
    one, n = torch.zeros((1, 1), dtype=torch.int32), torch.tensor([40], dtype=torch.int32)
    for layer in range(L):
        out = cache.decode(q, ["a", "b"], layer)
        ref = paged_decode_ref(q[:1], kr[layer][None], vr[layer][None], "nhd", one, n)
        assert float((out[:1].double() - ref).abs().max()) < 1e-5, layer


BAD_SCALE = ["layers", "heads", "rank3", "matrix_heads", "nan", "zero", "negative", "inf", "string", "empty"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(STATIC), bad=st.sampled_from(BAD_SCALE), which=st.sampled_from(["k_scale", "v_scale"]),
       layers=st.integers(1, 4), heads=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_bad_scales_are_refused_naming_them_and_the_given_tensors_stay(name, bad, which, layers, heads, seed):
    g = torch.Generator().manual_seed(seed)
    good = torch.rand(layers, heads, generator=g) + 0.1
    # shapes the cache never takes: not 1, H or L values, not [L, 1] / [L, H]
    shape = {"layers": (layers + 1,) if layers + 1 != heads else (layers + 2,), "heads": (layers, heads + 1),
             "rank3": (layers, heads, 1), "matrix_heads": (layers + 1, heads), "empty": (0,)}.get(bad)
    bad_t = torch.rand(shape, generator=g) + 0.1 if shape else good.clone()
    if bad in ("nan", "zero", "negative", "inf"):
        bad_t.view(-1)[seed % bad_t.numel()] = {"nan": float("nan"), "zero": 0.0, "negative": -1.0,
                                                "inf": float("inf")}[bad]
    if bad == "string":
        bad_t = "0.5"
    given_ = {"k_scale": good, "v_scale": good, which: bad_t}
    kept = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in given_.items()}
    with pytest.raises(ValueError, match=which):
        cache_of(name, given_["k_scale"], given_["v_scale"], layers=layers, heads=heads)
    for n, t in given_.items():  # the caller's tensors are untouched (bit for bit: NaN included)
        assert t == kept[n] if isinstance(t, str) else torch.equal(t.view(torch.int32), kept[n].view(torch.int32))


def test_scale_shapes_the_cache_takes():
    ones = torch.ones
    for ks, per_layer, row in [(ones(()), False, (1,)), (ones(1), False, (1,)), (ones(H), False, (H,)),
                               (ones(L), True, (1,)), (ones(L, 1), True, (1,)), (ones(L, H), True, (H,))]:
        c = cache_of("int8/head", ks, ones(1))
        assert c.per_layer_scales == per_layer and c.layer_scales(L - 1)[0].shape == row
        assert c.layer_scales(0)[1].shape == row  # v's broadcast to k's: the kernels read both with one head stride
    # H == L: a 1-D scale is read by the scheme, per head for a head scheme, per layer for a tensor scheme
    assert not cache_of("int8/head", ones(2), ones(2), layers=2).per_layer_scales
    assert cache_of("int8/tensor", ones(2), ones(2), layers=2).per_layer_scales
    c = cache_of("fp8_e4m3/tensor", torch.tensor([1.0, 2.0, 4.0]), ones(1))
    assert [float(c.layer_scales(i)[0]) for i in range(L)] == [1.0, 2.0, 4.0] and c.k_scale.shape == (L, 1)
    own = torch.tensor([1.0, 2.0, 4.0])
    c = cache_of("int8/tensor", own, own)
    own.mul_(3)  # the cache keeps its own copy
    assert float(c.layer_scales(2)[0]) == 4.0
    with pytest.raises(ValueError, match="k_scale and v_scale are needed exactly"):
        cache_of("int8/token", ones(L), ones(L))
    with pytest.raises(ValueError, match="layer must be in"):
        c.layer_scales(L)
    assert cache_of("fp16", None, None).layer_scales(0) == (None, None)
