"""workbench.coding.delta (lossless delta + zstd coding of K/V, and its lossy variant after quantization) and the
break-even arithmetic of workbench.compress.delta_study. Small tensors, one torch thread: a few seconds."""

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import quant
from workbench.bench import compression_delta
from workbench.coding import delta as dz
from workbench.coding import delta_options as opts
from workbench.compress import delta_quant as dq
from workbench.compress import delta_study as study

pytestmark = pytest.mark.usefixtures("one_thread")

INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
            torch.int8: torch.int8, torch.uint8: torch.uint8, torch.float8_e4m3fn: torch.uint8}
# bit patterns a float codec must keep: NaNs with payloads (quiet, signalling, negative), +-inf, -0.0, subnormals
SPECIAL = {
    torch.float16: [0x7E00, 0x7C01, 0x7D55, 0xFE01, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x03FF, 0x8001, 0x83FF],
    torch.bfloat16: [0x7FC0, 0x7F81, 0x7FD5, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x007F, 0x8001, 0x807F],
    torch.float32: [0x7FC00000, 0x7F800001, 0x7FA5A5A5, -0x00400001, 0x7F800000, -0x00800000, -0x80000000, 0, 1,
                    0x007FFFFF, -0x7FFFFFFF, -0x7F800001],
    torch.int8: [-128, 127, 0, -1, 1],
    torch.uint8: [0, 255, 128, 127],
    torch.float8_e4m3fn: [0x7F, 0xFF, 0x80, 0x00, 0x01, 0x07],
}
SHAPES = [(1, 3, 5), (7, 1, 1), (33, 3, 64), (5, 17), (2, 1), (9, 300)]  # odd sizes, T=1, >= 256 channels
OPTIONS = [dict(delta=d, shuffle=s, rle=r, order=o)
           for d, s, r, o in itertools.product(("sub", "xor", False), (True, False), (False, True),
                                               ("token", "channel"))]


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(INT_VIEW[x.dtype])


def special_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """Random bits over the dtype's whole range, with every special pattern planted (repeated across tokens too,
    so deltas of 0 and runs appear)."""
    g = torch.Generator().manual_seed(seed)
    iv = INT_VIEW[dtype]
    info = torch.iinfo(iv)
    raw = torch.randint(info.min, info.max + 1, shape, generator=g, dtype=torch.int64).to(iv)
    flat = raw.view(-1)
    pats = torch.tensor(SPECIAL[dtype], dtype=torch.int64).to(iv)
    n = min(flat.numel(), 3 * pats.numel())
    flat[:n] = pats.repeat(3)[:n]
    if shape[0] > 2:
        raw[2] = raw[1]  # a repeated token
    return raw.view(dtype)


def assert_bit_exact(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape} vs {want.dtype} " \
                                                                  f"{want.shape}"
    bad = (bits(got) != bits(want)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} values differ, first at {bad[0].tolist()}: " \
                             f"{bits(got)[tuple(bad[0])]:#x} vs {bits(want)[tuple(bad[0])]:#x}"


# ---- lossless round trip -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(SPECIAL), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_bit_exact_default(dtype, shape):
    x = special_tensor(dtype, shape)
    enc = dz.encode(x)
    assert enc.stages == ("delta:sub", "shuffle:token", "zstd:3")
    assert_bit_exact(dz.decode(enc), x, f"{dtype} {shape}")
    blob = enc.to_bytes()
    assert len(blob) == enc.nbytes and enc.ratio == enc.raw_nbytes / enc.nbytes
    assert_bit_exact(dz.decode(dz.Encoded.from_bytes(blob)), x, f"{dtype} {shape} via bytes")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8], ids=str)
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_round_trip_every_stage_combination(dtype, opts):
    for shape in [(1, 2, 3), (13, 3, 7), (6, 260)]:
        x = special_tensor(dtype, shape, seed=1)
        enc = dz.encode(x, **opts)
        assert_bit_exact(dz.decode(enc), x, f"{dtype} {shape} {opts}")
        back = dz.Encoded.from_bytes(enc.to_bytes())
        assert (back.delta, back.shuffle, back.rle, back.order) == (enc.delta, enc.shuffle, enc.rle, enc.order)


def test_non_contiguous_and_levels():
    x = special_tensor(torch.float16, (20, 4, 6)).transpose(1, 2)  # non-contiguous
    for level in (opts.MIN_LEVEL, -1, 1, 3, 19):
        assert_bit_exact(dz.decode(dz.encode(x, level=level)), x.contiguous(), f"level {level}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.uint8]),
       t=st.integers(1, 12), c=st.integers(1, 40), delta=st.sampled_from(["sub", "xor", False]),
       shuffle=st.booleans(), rle=st.booleans())
def test_round_trip_hypothesis(data, dtype, t, c, delta, shuffle, rle):
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = data.draw(st.binary(min_size=t * c * itemsize, max_size=t * c * itemsize))
    x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(t, c)
    assert_bit_exact(dz.decode(dz.encode(x, delta=delta, shuffle=shuffle, rle=rle)), x, "hypothesis")


def test_ratio_above_one_on_smooth_data():
    t = torch.arange(512, dtype=torch.float32)[:, None, None]
    phase = torch.linspace(0, 3, 3 * 64).reshape(1, 3, 64)
    x = (torch.sin(t * 0.01 + phase) * (1 + phase)).to(torch.float16)  # [512, 3, 64], slowly varying per channel
    with_delta, without = dz.encode(x), dz.encode(x, delta=False)
    assert with_delta.ratio > 1.5, with_delta.ratio
    assert with_delta.ratio > without.ratio  # smooth channels: the delta is what pays
    assert 1 < dz.entropy_ratio(x) and dz.entropy_ratio(x) > dz.entropy_ratio(x, delta=False)
    assert len(dz.plane_entropy(x)) == 2 and all(0 <= b <= 8 for b in dz.plane_entropy(x))
    assert dz.entropy_ratio(torch.zeros(4, 3, dtype=torch.float16)) == math.inf


def test_rle_streams():
    for p in [np.array([0, 0, 0, 5, 0, 1, *[0] * 600, 3], np.uint8), np.zeros(1000, np.uint8),
              np.arange(1, 200, dtype=np.uint8), np.zeros(0, np.uint8), np.array([0], np.uint8)]:
        lits, runs = dz.rle_encode(p)
        assert (lits == 0).sum() == runs.size
        np.testing.assert_array_equal(dz.rle_decode(lits, runs, p.size), p)
    lits, runs = dz.rle_encode(np.array([7, *[0] * 600], np.uint8))
    assert lits.tolist() == [7, 0, 0, 0] and runs.tolist() == [255, 255, 87]  # 256 + 256 + 88 zeros
    with pytest.raises(ValueError, match="zero runs decode to"):
        dz.rle_decode(lits, runs, 602)
    with pytest.raises(ValueError, match="markers"):
        dz.rle_decode(lits, runs[:2], 601)


# ---- corrupted payloads ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rle", [False, True])
def test_every_flipped_byte_is_caught(rle):
    x = special_tensor(torch.float16, (6, 2, 3))
    enc = dz.encode(x, rle=rle)
    for i in range(len(enc.payload)):
        bad = bytearray(enc.payload)
        bad[i] ^= 0x10
        with pytest.raises(ValueError, match="enc payload"):
            dz.decode(dz.Encoded(enc.dtype, enc.shape, enc.delta, enc.shuffle, enc.order, enc.rle, enc.level,
                                 bytes(bad), enc.checksum))


def test_truncated_extended_and_mismatched_payloads():
    x = special_tensor(torch.bfloat16, (10, 3, 4))
    enc = dz.encode(x)
    fields = (enc.dtype, enc.shape, enc.delta, enc.shuffle, enc.order, enc.rle, enc.level)

    def with_payload(p, checksum=None):
        e = dz.Encoded(*fields, p, 0)
        return dz.Encoded(*fields, p, e.digest() if checksum is None else checksum)

    for cut in (1, len(enc.payload) // 2, len(enc.payload) - 1):  # checksum recomputed: the frames must catch it
        with pytest.raises(ValueError, match="enc payload"):
            dz.decode(with_payload(enc.payload[:cut]))
    with pytest.raises(ValueError, match="after its 2 zstd frames"):
        dz.decode(with_payload(enc.payload + b"\0\0"))
    with pytest.raises(ValueError, match="enc payload is corrupted: frame 1"):
        dz.decode(with_payload(b""))
    other = dz.encode(special_tensor(torch.bfloat16, (11, 3, 4)))  # a valid payload of another shape
    with pytest.raises(ValueError, match="holds 132 bytes, the tensor needs 120"):
        dz.decode(with_payload(other.payload))
    with pytest.raises(ValueError, match="xxh3_64"):
        dz.decode(with_payload(enc.payload, enc.checksum ^ 1))
    blob = enc.to_bytes()
    for bad, match in [(b"junk", "truncated"), (b"XXXX" + blob[4:], "not an encoded tensor"),
                       (blob[:4] + b"\x09" + blob[5:], "version"), (blob[:5] + b"\xee" + blob[6:], "corrupted header"),
                       (blob[:dz._HEAD.size + 3], "truncated"), ("text", "blob must be bytes")]:
        with pytest.raises(ValueError, match=match):
            dz.Encoded.from_bytes(bad)


def decode_blob(blob: bytes) -> torch.Tensor:
    return dz.decode(dz.Encoded.from_bytes(blob))


def flipped_outcome(blob: bytes, bit: int, x: torch.Tensor) -> str:
    """``"refused"`` (a ValueError naming what is wrong), ``"same"`` (decodes to ``x`` bit for bit) or ``"silent"``
    (decodes to something else without an error: the bug)."""
    bad = bytearray(blob)
    bad[bit // 8] ^= 1 << (bit % 8)
    try:
        got = decode_blob(bytes(bad))
    except ValueError as e:
        assert str(e).startswith(("blob ", "enc ")), e
        return "refused"
    same = got.dtype == x.dtype and got.shape == x.shape and torch.equal(bits(got), bits(x))
    return "same" if same else "silent"


@pytest.mark.parametrize("opts", [dict(), dict(delta="xor", order="channel"), dict(delta=False, rle=True),
                                  dict(shuffle=False)], ids=str)
def test_every_flipped_bit_of_a_small_encoding_is_refused(opts):
    """Issue 30 item 6: the header was outside the checksum, so a flipped delta or order bit decoded to other values
    without an error. Now every bit of the blob (header, checksum, shape, payload) is covered: none decodes."""
    x = special_tensor(torch.float16, (5, 2, 3), seed=4)
    blob = dz.encode(x, **opts).to_bytes()
    outcomes = {bit: flipped_outcome(blob, bit, x) for bit in range(8 * len(blob))}
    assert [b for b, o in outcomes.items() if o != "refused"] == []


def test_the_header_flags_are_in_the_checksum():
    """The reproductions: the delta and order flags (and the level, shape) of an in-memory encoding changed."""
    x = special_tensor(torch.bfloat16, (6, 2, 4), seed=5)
    enc = dz.encode(x)
    for changed in (dict(delta="xor"), dict(delta="none"), dict(order="channel"), dict(level=1), dict(shape=(6, 8))):
        with pytest.raises(ValueError, match="enc payload or header is corrupted"):
            dz.decode(dataclasses.replace(enc, **changed))
    old = dz._HEAD.pack(dz._MAGIC, 1, 2, 1, 1, 3, 3, 0) + enc.to_bytes()[dz._HEAD.size:]
    with pytest.raises(ValueError, match="format version 1, this reader knows 2"):
        dz.Encoded.from_bytes(old)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 999), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       rle=st.booleans(), delta=st.sampled_from(["sub", "xor", "none"]))
def test_random_flipped_bits_of_a_large_encoding_are_refused(seed, dtype, rle, delta):
    x = special_tensor(dtype, (64, 4, 64), seed=seed)
    blob = dz.encode(x, rle=rle, delta=delta).to_bytes()
    g = np.random.default_rng(seed)
    header = range(8 * (dz._HEAD.size + 24))  # every header bit, and a sample of the payload's
    sample = [*header, *g.integers(8 * (dz._HEAD.size + 24), 8 * len(blob), 150).tolist()]
    assert [b for b in sample if flipped_outcome(blob, b, x) != "refused"] == []


# ---- argument checks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda: dz.encode("x"), "x must be a torch.Tensor"),
    (lambda: dz.encode(torch.zeros(3, 4, dtype=torch.complex64)), "x has dtype complex64"),
    (lambda: dz.encode(torch.zeros(3, 4, dtype=torch.bool)), "x has dtype bool"),
    (lambda: dz.encode(torch.zeros(3)), r"x shape must be \[tokens, heads, head_dim\]"),
    (lambda: dz.encode(torch.zeros(2, 3, 4, 5)), "x shape must be"),
    (lambda: dz.encode(torch.zeros(0, 3, 4)), "x shape must not be empty"),
    (lambda: dz.encode(torch.zeros(3, 0)), "x shape must not be empty"),
    (lambda: dz.encode(torch.zeros(3, 4), level=23), "level must be an int in"),
    (lambda: dz.encode(torch.zeros(3, 4), level=-8), "level must be an int in"),
    (lambda: dz.encode(torch.zeros(3, 4), level=2.0), "level must be an int in"),
    (lambda: dz.encode(torch.zeros(3, 4), level=True), "level must be an int in"),
    (lambda: dz.encode(torch.zeros(3, 4), delta="add"), "delta must be True, False or one of"),
    (lambda: dz.encode(torch.zeros(3, 4), delta=1), "delta must be"),
    (lambda: dz.encode(torch.zeros(3, 4), shuffle="yes"), "shuffle must be True or False"),
    (lambda: dz.encode(torch.zeros(3, 4), rle=1), "rle must be True or False"),
    (lambda: dz.encode(torch.zeros(3, 4), order="rows"), "order must be one of"),
    (lambda: dz.decode(b"abc"), "enc must be an Encoded"),
    (lambda: dz.Encoded(torch.float16, (0, 3), "sub", True, "token", False, 3, b"", 0), "shape must not be empty"),
    (lambda: dz.Encoded(torch.float16, (2, 3), "sub", True, "token", False, 3, b"", -1), "checksum must be"),
    (lambda: dz.Encoded(torch.complex64, (2, 3), "sub", True, "token", False, 3, b"", 0), "dtype must be one of"),
    (lambda: dq.encode_quantized(torch.zeros(4, 2, 8), "int3/token"), "scheme must be"),
    (lambda: dq.encode_quantized(torch.zeros(4, 2, 8), kind="q"), "kind must be"),
    (lambda: dq.encode_quantized(torch.zeros(4, 16), "int8/token"), "x must be a floating"),
    (lambda: dq.encode_quantized(torch.zeros(4, 2, 8, dtype=torch.int8)), "x must be a floating"),
    (lambda: dq.decode_quantized(dz.encode(torch.zeros(3, 4))), "qe must be a QuantEncoded"),
])
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- lossy -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["int8/token", "int8_asym/token", "fp8_e4m3/token", "int8/tensor", "int4/token",
                                    "int2/token", "int4/kivi", "fp16"])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_lossy_is_the_scheme_round_trip(scheme, kind):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(160, 3, 64, generator=g).cumsum(0) * 0.1  # smooth over tokens, like keys
    qe = dq.encode_quantized(x, scheme, kind=kind)
    got = dq.decode_quantized(qe)
    s = quant.get(scheme)
    ref = s.roundtrip(x, kind)
    assert torch.equal(got, ref), f"{scheme} {kind}: max diff {(got - ref).abs().max():.3g}"  # codes kept exactly
    plain = s.quantize(x, kind)
    plain_bytes = sum(t.numel() * t.element_size() for t in (plain.codes, plain.scale, plain.zero, plain.residual)
                      if t is not None)
    assert qe.ratio == 2 * x.numel() / qe.nbytes and qe.nbytes < plain_bytes * 1.02  # coding does not grow much
    if scheme == "int8/token":  # the scheme's bound: half a step per value
        step = plain.scale[..., None]
        assert bool(((got - x).abs() <= step / 2 * (1 + 1e-5)).all())
        assert qe.ratio > 2.0  # codes of smooth data, delta-coded: beyond int8's own 1.88x


def test_lossy_all_tokens_in_the_residual():
    x = torch.randn(100, 3, 64)  # int4/kivi keeps the newest 128 tokens in fp16: no codes at all
    qe = dq.encode_quantized(x, "int4/kivi", kind="k")
    assert qe.codes is None and qe.residual is not None
    assert torch.equal(dq.decode_quantized(qe), quant.get("int4/kivi").roundtrip(x, "k"))


PACKED = ["int4/kivi", "int4/token", "int2/kivi", "int2/token"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(PACKED), group=st.sampled_from([1, 2, 4, 8, 16, 64]),
       value_group=st.sampled_from([4, 8, 16, 32, 64]), residual=st.integers(0, 70),
       key_mode=st.sampled_from(["channel", "token"]), kind=st.sampled_from(["k", "v"]), t=st.integers(1, 90),
       seed=st.integers(0, 999))
def test_lossy_round_trip_with_any_scheme_parameters(name, group, value_group, residual, key_mode, kind, t, seed):
    """Issue 30 item 6: decode_quantized rebuilt the scheme from its name, so non-default parameters failed (or
    decoded wrong); the encoding now carries them."""
    s = quant.get(name, group=group, value_group=value_group, residual=residual, key_mode=key_mode)
    x = torch.randn(t, 2, 64, generator=torch.Generator().manual_seed(seed)).cumsum(0) * 0.1
    qe = dq.encode_quantized(x, s, kind=kind)
    assert qe.spec == s and dict(qe.params)["residual"] == residual
    assert torch.equal(dq.decode_quantized(qe), s.roundtrip(x, kind))


def test_lossy_round_trip_with_a_scheme_outside_the_registry():
    s = quant.Scheme("my_int8", "int8", "token", label="mine")
    x = torch.randn(20, 2, 16)
    qe = dq.encode_quantized(x, s, kind="v")
    assert torch.equal(dq.decode_quantized(qe), s.roundtrip(x, "v"))
    for params, match in [((("name", "int4/kivi"),), "not a quantization scheme"),
                          (qe.params[:1] + (("format_name", "int3"),) + qe.params[2:], "not a quantization scheme"),
                          (tuple((k, "int4/kivi" if k == "name" else v) for k, v in qe.params), "the encoding says")]:
        with pytest.raises(ValueError, match=match):
            dq.decode_quantized(dataclasses.replace(qe, params=params))


# ---- the study: break-even arithmetic and rows -------------------------------------------------------------------
def test_break_even_hand_cases():
    gb = 10**9  # 1 GB over a 1 GB/s link: 1 s raw
    be = study.break_even(gb, 2.0, 10.0, 10.0, 1.0)  # 0.1 + 0.5 + 0.1 s
    assert be["time_raw_us"] == pytest.approx(1e6) and be["time_compressed_us"] == pytest.approx(0.7e6)
    assert be["wins"] and be["speedup"] == pytest.approx(1 / 0.7) and be["saved_us"] == pytest.approx(0.3e6)
    assert be["needed_gbps"] == pytest.approx(4.0)  # 2 stages in the 0.5 s the halved transfer saves
    ov = study.break_even(gb, 2.0, 10.0, 10.0, 1.0, overlap=True)  # max(0.1, 0.5, 0.1)
    assert ov["time_compressed_us"] == pytest.approx(0.5e6) and ov["speedup"] == pytest.approx(2.0)
    assert ov["needed_gbps"] == pytest.approx(1.0)
    one = study.break_even(gb, 2.0, None, 10.0, 1.0)  # a swap in: decode only
    assert one["time_compressed_us"] == pytest.approx(0.6e6) and one["needed_gbps"] == pytest.approx(2.0)
    slow = study.break_even(gb, 2.0, 1.0, 1.0, 1.0)  # 1 + 0.5 + 1 s
    assert not slow["wins"] and slow["speedup"] == pytest.approx(1 / 2.5)
    assert study.break_even(gb, 1.0, 100.0, 100.0, 1.0)["needed_gbps"] == math.inf  # nothing saved
    small = study.break_even(gb, 2.0, 10.0, 10.0, 1.0, compressed_link_gbps=0.4)  # half the bytes, 0.4x the speed
    assert small["needed_gbps"] == math.inf and not small["wins"]
    assert study.break_even(gb, 0.5, 1e9, 1e9, 1.0, overlap=True)["needed_gbps"] == math.inf
    for kwargs, match in [(dict(raw_bytes=0), "raw_bytes"), (dict(ratio=-1.0), "ratio"), (dict(link_gbps=0), "link"),
                          (dict(encode_gbps="fast"), "encode_gbps"), (dict(decode_gbps=0.0), "decode_gbps"),
                          (dict(ratio=math.inf), "ratio")]:
        args = dict(raw_bytes=gb, ratio=2.0, encode_gbps=1.0, decode_gbps=1.0, link_gbps=1.0) | kwargs
        with pytest.raises(ValueError, match=match):
            study.break_even(**args)


def test_break_even_rows_pick_the_stage_each_direction_pays():
    tp = [{"section": "throughput", "chunk": "c", "dtype": "fp16", "config": study.DEFAULT, "level": 3,
           "raw_bytes": 10**9, "ratio": 2.0, "encode_gbps": 10.0, "decode_gbps": 5.0}]
    links = {"out": (1.0, "encode", "gpu", "test"), "in": (lambda b: 1.0, "decode", "cpu", "test")}
    rows = study.break_even_rows(tp, links=links)
    assert len(rows) == 2 * 2 * 2  # links x modes x overlap
    by = {(r["link"], r["mode"], r["overlap"]): r for r in rows}
    assert by[("out", "one-way", False)]["time_compressed_us"] == pytest.approx(0.6e6)  # 0.1 + 0.5
    assert by[("in", "one-way", False)]["time_compressed_us"] == pytest.approx(0.7e6)  # 0.5 + 0.2
    assert by[("in", "both", False)]["time_compressed_us"] == pytest.approx(0.8e6)
    assert by[("in", "one-way", False)]["cpu_gbps"] == 5.0 and by[("out", "one-way", False)]["cpu_gbps"] == 10.0
    folded = study.verdicts(rows)
    assert len(folded) == 2 and all({"needed_serial", "needed_overlap", "speedup_serial"} <= r.keys() for r in folded)


def test_study_rows_on_real_kv(tmp_path):
    from workbench.model import capture

    caps = capture.load()
    rows = study.layer_ratios(caps[:1], configs=[study.DEFAULT, "shuffle"])
    assert len(rows) == len(caps[0].layers) * 3 * 2 * 2
    assert {r["kind"] for r in rows} == {"k_pre", "k", "v"} and all(r["ratio"] > 1 for r in rows)
    summ = study.summarize(rows)
    assert all(1 < r["ratio"] and 1 < r["entropy_ratio"] < 2 for r in summ)
    chunks = study.chunks(caps)
    assert chunks["block16/30layers"][0].shape == (16, 30 * 2 * 3 * 64)
    assert chunks["block16/1layer"][0].shape == (16, 3, 64)
    q = study.quantized_ratios(caps[:1], schemes=["int8/token"], deltas=[True])
    assert all(r["ratio"] > 1.8 and r["plain_ratio"] > 1.8 and r["rel_err"] < 0.02 for r in q)
    assert all(r["ratio"] > r["plain_ratio"] for r in q if r["kind"] != "v")  # keys: the delta pays
    assert compression_delta.main(["--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("compression-delta-cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["meta"]["gpu"].startswith("cpu-") and doc["mode"] == "quick"
    assert {r["section"] for r in doc["rows"]} == {"ratio", "quant", "throughput", "break_even"}
    with pytest.raises(ValueError, match="captures must be"):
        study.layer_ratios([])
    with pytest.raises(ValueError, match="configs must name"):
        study.layer_ratios(caps[:1], configs=["lz4"])
