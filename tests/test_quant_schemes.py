"""The K/V quantization schemes (``workbench.quant``): round trips within derived bounds, codes, packing, scales,
accounting and bad input.

Error bounds, per element, for a value ``x`` of a row or group whose scale is ``s`` (what :func:`bound` computes):

- fp16 cast: ``2**-11 |x|`` (half an ulp: 10 mantissa bits) ``+ 2**-25`` (half the subnormal spacing);
  bf16: ``2**-8 |x|`` (7 mantissa bits; fp32's range, so no subnormal term for these data).
- fp8 ``code = fp8(x / s)``: e4m3 ``2**-4 |x| + 2**-10 s`` (3 mantissa bits; subnormal spacing ``2**-9``),
  e5m2 ``2**-3 |x| + 2**-17 s`` (2 mantissa bits; spacing ``2**-16``).
- int8 symmetric ``s = amax / 127``, asymmetric uint8 ``s = (max - min) / 255``: ``s / 2`` (rounding to the
  nearest code; the range covers the row, so nothing clamps).
- int4 / int2 groups (KIVI, ``s = (max - min) / qmax`` with ``qmax`` 15 / 3): scale and minimum are rounded to
  fp16 first (``s16``, ``z16``), so the codes' range can miss the group's ends by the rounding:
  ``s16 / 2 + 2**-11 (|z16| + qmax s16)``; about ``(max - min) / 30`` for int4 and ``/ 6`` for int2. The fp16
  residual tokens: the fp16 bound.

Every bound gets a relative slack of ``1e-5`` for the fp32 arithmetic of quantize/dequantize.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import quant
from workbench.quant import SCHEMES, NonFiniteError, pack, unpack

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small tensors run faster on one thread


def data(shape, seed=0, scale=1.0, offset=0.0):
    """Random normal data (no exact zeros: the bounds must hold for real values, not a trivial input)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale + offset


def _expand_groups(t, scheme, kind, shape):
    """A group scheme's per-group ``t`` (scale or zero) spread over the quantized elements ``[Tq, H, D]``."""
    t = t.float()
    if kind == "k" and scheme.key_mode == "channel":
        return t.repeat_interleave(scheme.group, dim=0)
    return t.repeat_interleave(scheme.value_group, dim=-1)


def bound(scheme, x, kind="k"):
    """The elementwise error bound of the module docstring for ``scheme`` on ``x`` ``[T, H, D]``."""
    ax = x.abs()
    fmt = scheme.format_name
    if not scheme.quantized:
        return {"fp32": 0 * ax, "fp16": 2**-11 * ax + 2**-25, "bf16": 2**-8 * ax}[fmt]
    qz = scheme.quantize(x, kind)
    if scheme.packed:
        tq = scheme.quantized_tokens(x.shape[0])
        s = _expand_groups(qz.scale, scheme, kind, x[:tq].shape)
        z = _expand_groups(qz.zero, scheme, kind, x[:tq].shape)
        body = s * (0.5 + scheme.qmax * 2**-11) + 2**-11 * z.abs()
        return torch.cat([body, 2**-11 * ax[tq:] + 2**-25])
    if scheme.static:
        s = qz.scale.reshape(()) if qz.scale.numel() == 1 else qz.scale.reshape(1, -1, 1)
    else:
        s = qz.scale[..., None]
    if fmt == "fp8_e4m3":
        return 2**-4 * ax + 2**-10 * s
    if fmt == "fp8_e5m2":
        return 2**-3 * ax + 2**-17 * s
    return 0.5 * s.expand_as(ax)  # int8, uint8


def assert_within_bound(scheme, x, kind):
    got = scheme.roundtrip(x, kind)
    assert got.shape == x.shape and got.dtype == torch.float32
    b = bound(scheme, x, kind)
    err = (got - x).abs()
    excess = err - b * (1 + 1e-5) - 1e-30
    worst = int(excess.argmax())
    assert bool((excess <= 0).all()), (f"{scheme.name} {kind}: error {float(err.max()):.3g} over the bound at flat "
                                       f"index {worst} (bound there {float(b.flatten()[worst]):.3g})")
    return err, b


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("kind", ["k", "v"])
def test_every_scheme_round_trips_within_its_bound(name, kind):
    scheme = SCHEMES[name]
    x = data((200, 3, 64), seed=1, scale=2.0, offset=0.3)
    x[:, 1, 5] *= 8  # an outlier channel
    err, b = assert_within_bound(scheme, x, kind)
    if scheme.format_name != "fp32":  # and the bound is tight: some element comes close to it
        assert float((err / b).max()) > 0.8, f"{name}: the bound is loose ({float((err / b).max()):.2f} of it used)"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(SCHEMES)), kind=st.sampled_from(["k", "v"]), tokens=st.integers(1, 80),
       heads=st.integers(1, 3), head_dim=st.sampled_from([8, 16, 64]), log_scale=st.floats(-2, 2),
       offset=st.floats(-3, 3), seed=st.integers(0, 2**16))
def test_round_trip_bounds_hold_for_random_shapes_and_scales(name, kind, tokens, heads, head_dim, log_scale, offset,
                                                             seed):
    scheme = SCHEMES[name]
    if scheme.packed:
        scheme = quant.get(name, value_group=min(scheme.value_group, head_dim), residual=seed % 3 * 16)
    scale = 10.0**log_scale
    x = data((tokens, heads, head_dim), seed=seed, scale=scale, offset=offset * scale)
    assert_within_bound(scheme, x, kind)


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_and_unpack_are_inverse(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (5, 3, 64), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (5, 3, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed, bits), codes)
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    assert torch.equal(pack(unpack(every_byte, bits), bits), every_byte)
    # the documented order: byte j holds channel j + k * D * bits / 8 in bits [k * bits, (k + 1) * bits)
    d = 64 * bits // 8
    for k in range(8 // bits):
        assert torch.equal((packed >> (k * bits)) & (2**bits - 1), codes[..., k * d:(k + 1) * d])


@pytest.mark.parametrize("name", [n for n, s in SCHEMES.items() if s.format.codes == "int"])
def test_int_codes_stay_in_range_and_reach_it(name):
    scheme = quant.get(name, residual=0) if SCHEMES[name].packed else SCHEMES[name]
    x = data((96, 2, 32), seed=3, scale=5.0)
    qz = scheme.quantize(x, "k")
    codes = unpack(qz.codes, scheme.bits).int() if scheme.packed else qz.codes.int()
    fmt = scheme.format
    assert qz.codes.dtype == fmt.storage
    assert int(codes.min()) >= fmt.qmin and int(codes.max()) <= fmt.qmax
    assert int(codes.abs().max()) == fmt.qmax  # the range is used (symmetric: by the largest magnitude)


@pytest.mark.parametrize("fmt, qmax", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
def test_fp8_static_scales_saturate_instead_of_overflowing(fmt, qmax):
    scheme = quant.get(f"{fmt}/tensor")
    x = torch.tensor([1e6, -1e6, 3.0, 0.5]).reshape(4, 1, 1)
    qz = scheme.quantize(x, scale=torch.tensor(1.0))  # values beyond qmax * scale
    back = scheme.dequantize(qz)
    assert bool(torch.isfinite(back).all())
    assert back.flatten().tolist()[:2] == [qmax, -qmax]
    per_head = quant.get(f"{fmt}/head").roundtrip(x.expand(4, 2, 1).contiguous(), scale=torch.tensor([1.0, 2.0]))
    assert per_head[0].flatten().tolist() == [qmax, 2 * qmax]


@pytest.mark.parametrize("name", [n for n, s in SCHEMES.items() if s.quantized])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused_naming_the_tensor(name, bad):
    x = data((40, 2, 32), seed=4)
    x[3, 1, 7] = bad
    with pytest.raises(NonFiniteError, match=r"x holds 1 NaN/Inf values \(first at \[token, head, dim\] = \[3, 1, 7\]"):
        SCHEMES[name].quantize(x, "v")
    assert issubclass(NonFiniteError, ValueError)


def test_a_bad_name_lists_the_schemes():
    with pytest.raises(ValueError, match="must be one of") as e:
        quant.get("int3")
    for name in ("fp16", "fp8_e4m3/tensor", "int8/token", "int4/kivi", "int2/token"):
        assert name in str(e.value)
    assert quant.get("int4") is SCHEMES["int4/kivi"] and quant.get("fp8") is SCHEMES["fp8_e4m3/tensor"]


@pytest.mark.parametrize("name, params, match", [
    ("int4", {"group": 3}, "group of int4/kivi must be a power of two"),
    ("int4", {"value_group": 0}, "value_group of int4/kivi must be a power of two"),
    ("int2", {"residual": -1}, "residual of int2/kivi must be an int >= 0"),
    ("int4/token", {"key_mode": "row"}, "key_mode of int4/token must be 'channel' or 'token'"),
    ("int4", {"groups": 32}, "unknown parameters"),
    ("fp16", {"group": 32}, "takes no parameters"),
    ("fp8_e4m3/token", {"residual": 0}, "takes no parameters"),
])
def test_bad_parameters_are_refused(name, params, match):
    with pytest.raises(ValueError, match=match):
        quant.get(name, **params)


def test_bad_arguments_to_quantize_are_refused():
    x = data((8, 2, 64))
    with pytest.raises(ValueError, match="kind must be 'k' or 'v'"):
        SCHEMES["int8/token"].quantize(x, "q")
    with pytest.raises(ValueError, match=r"\[tokens, heads, head_dim\]"):
        SCHEMES["int8/token"].quantize(x[0])
    with pytest.raises(ValueError, match="must hold 1 or 2 values"):
        SCHEMES["int8/head"].quantize(x, scale=torch.ones(3))
    with pytest.raises(ValueError, match="value_group 32 of int4/kivi must divide head_dim 16"):
        SCHEMES["int4/kivi"].quantize(data((8, 2, 16)))
    with pytest.raises(ValueError, match="packs 4 channels a byte"):
        quant.get("int2", value_group=1).quantize(data((8, 2, 6)))


def test_bytes_per_token_counts_scales_and_zero_points():
    heads, d = 3, 64  # SmolLM2-135M's kv heads: 192 values per token for K, as many for V
    # int4, keys per token: 96 bytes of codes + 6 groups of 32 channels x (fp16 scale + fp16 zero) = 120, V alike
    assert SCHEMES["int4/token"].bytes_per_token(heads, d) == 2 * (192 / 2 + 192 / 32 * 4) == 240
    # int4 KIVI: keys per channel in groups of 32 tokens (one scale and zero per channel per 32 tokens)
    assert SCHEMES["int4/kivi"].bytes_per_token(heads, d) == (96 + 4 * 192 / 32) + (96 + 4 * 192 / 32) == 240
    # ... with 128 residual tokens of a 512-token context in fp16: 384 quantized, 128 at 768 bytes
    assert SCHEMES["int4/kivi"].bytes_per_token(heads, d, context=512) == (240 * 384 + 768 * 128) / 512 == 372
    assert SCHEMES["int2/token"].bytes_per_token(heads, d) == 2 * (48 + 24) == 144
    assert SCHEMES["int8/token"].bytes_per_token(heads, d) == 2 * (192 + 3 * 4) == 408  # fp32 scale per head
    assert SCHEMES["int8_asym/token"].bytes_per_token(heads, d) == 2 * (192 + 3 * 8) == 432  # + fp32 zero
    assert SCHEMES["fp8_e4m3/tensor"].bytes_per_token(heads, d) == 384  # static scales: not per token
    assert SCHEMES["fp16"].bytes_per_token(heads, d) == 768 and SCHEMES["fp32"].bytes_per_token(heads, d) == 1536


def test_quantized_tokens_and_the_fp16_residual():
    kivi = SCHEMES["int4/kivi"]  # 32-token key groups, 128 residual tokens
    assert [kivi.quantized_tokens(t) for t in (0, 100, 128, 159, 160, 161, 1000)] == [0, 0, 0, 0, 32, 32, 864]
    tok = quant.get("int4/token", residual=128)  # per-token keys: no unfinished group
    assert [tok.quantized_tokens(t) for t in (100, 161)] == [0, 33]
    assert SCHEMES["int8/token"].quantized_tokens(77) == 77
    x = data((161, 2, 64), seed=5)
    for kind in ("k", "v"):
        qz = kivi.quantize(x, kind)
        assert qz.codes.shape == (32, 2, 32) and qz.residual.shape == (129, 2, 64)
        back = kivi.dequantize(qz, kind)
        assert torch.equal(back[32:], x[32:].half().float())  # the newest tokens: fp16, exactly
        assert not torch.equal(back[:32], x[:32].half().float())
    assert kivi.quantize(x, "k").scale.shape == (1, 2, 64)  # per channel, one 32-token group
    assert kivi.quantize(x, "v").scale.shape == (32, 2, 2)  # per token, 2 groups of 32 channels
    short = kivi.roundtrip(x[:50])  # shorter than the residual: nothing quantized
    assert torch.equal(short, x[:50].half().float())


@pytest.mark.parametrize("name", ["int8_asym/token", "int4/kivi", "int4/token", "int2/kivi", "int2/token"])
def test_asymmetric_codes_are_exact_at_each_group_min_and_max(name):
    scheme = quant.get(name, residual=0) if SCHEMES[name].packed else SCHEMES[name]
    x = data((64, 2, 64), seed=6, scale=3.0, offset=1.0)
    for kind in ("k", "v"):
        qz = scheme.quantize(x, kind)
        codes = (unpack(qz.codes, scheme.bits) if scheme.packed else qz.codes).long()
        if scheme.packed and kind == "k" and scheme.key_mode == "channel":
            gx = x.reshape(-1, scheme.group, 2, 64).transpose(1, -1)  # [groups, D, H, G]: a group on the last axis
            gc = codes.reshape(-1, scheme.group, 2, 64).transpose(1, -1)
        elif scheme.packed:
            gx = x.reshape(64, 2, -1, scheme.value_group)
            gc = codes.reshape(64, 2, -1, scheme.value_group)
        else:
            gx, gc = x, codes
        lo, hi = gx.argmin(dim=-1, keepdim=True), gx.argmax(dim=-1, keepdim=True)
        assert bool((gc.gather(-1, lo) == 0).all()), f"{name} {kind}: a group's minimum is not code 0"
        assert bool((gc.gather(-1, hi) == scheme.qmax).all()), f"{name} {kind}: a group's maximum is not qmax"
    if not scheme.packed:  # fp32 scale and zero: the minimum reads back exactly, the maximum to fp32 rounding
        back = scheme.roundtrip(x)
        assert torch.equal(back.amin(dim=-1), x.amin(dim=-1))
        torch.testing.assert_close(back.amax(dim=-1), x.amax(dim=-1), atol=0, rtol=1e-6)


def test_static_scales_are_calibrated_on_the_data_by_default():
    x = data((50, 3, 16), seed=7)
    for name, shape in [("int8/tensor", ()), ("int8/head", (3,)), ("fp8_e4m3/head", (3,))]:
        s = SCHEMES[name]
        assert s.calibrate(x).shape == shape
        assert torch.equal(s.roundtrip(x), s.roundtrip(x, scale=s.calibrate(x)))
    assert SCHEMES["int8/token"].calibrate(x) is None
