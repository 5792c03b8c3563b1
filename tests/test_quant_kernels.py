"""Quantized K/V through the kernels: write_kv's codes and scales equal workbench.quant's, code by code, for every
scheme with scales computed on write; paged_decode reads every scheme inside its loop within 1e-3 of the
dequantized reference; poisoned pools, every layout, a few block sizes, random data."""

import dataclasses

import pytest
import torch
from conftest import rel_err
from workbench.kernels import paged_decode, write_kv
from workbench.kernels.decode.reference import paged_decode_ref
from workbench.kernels.write.reference import dequantize_cache_ref, quant_code_distance, write_cache_ref, write_kv_ref

from workbench import quant
from workbench.core.layout import to_nhd
from workbench.quant import blocks as qblocks

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

DYNAMIC = ["fp8_e4m3/token", "fp8_e5m2/token", "int8/token", "int8_asym/token", "int4/token", "int4/kivi",
           "int2/kivi"]
LAYOUTS = ["nhd", "hnd", "vllm"]
POISON = 0xFF  # NaN in fp8 and fp16 scales, 255 in uint8 codes


def scheme_for(name: str, block_size: int) -> quant.Scheme:
    s = quant.get(name)
    return s.with_params(group=min(16, block_size), residual=0) if s.packed else s


def group_slots(n_groups: int, group: int, block_size: int, num_blocks: int, g) -> torch.Tensor:
    """Slots of ``n_groups`` whole key groups, scattered over random blocks (a group never spans two)."""
    per_block = block_size // group
    picks = torch.randperm(num_blocks * per_block, generator=g)[:n_groups]
    return (picks[:, None] * group + torch.arange(group)).reshape(-1)


# every scheme in NHD and the vLLM split (16-token pages); 32-token pages and HND with one scheme of each write
# mode (symmetric and asymmetric per token, packed per token, KIVI key groups)
WRITE_CASES = [(n, layout, 16) for n in DYNAMIC for layout in ("nhd", "vllm")] + [
    (n, layout, 32) for layout in ("nhd", "hnd") for n in ("fp8_e4m3/token", "int8_asym/token", "int4/token",
                                                             "int4/kivi")]


@pytest.mark.parametrize("name, layout, block_size", WRITE_CASES)
def test_write_kv_codes_and_scales_match_scheme(name, layout, block_size, device):
    scheme = scheme_for(name, block_size)
    g = torch.Generator().manual_seed(block_size + len(name))
    H, D, nb = 2, 64, 5
    slots = group_slots(5, 16 if scheme.packed and scheme.key_mode == "channel" else 8, block_size, nb, g)
    T = slots.numel()
    k = (torch.randn(T, H, D, generator=g) * 3).half().to(device)
    v = torch.randn(T, H, D, generator=g).to(device)  # an fp32 source too
    caches = [qblocks.empty_cache(scheme, layout, kind, nb, block_size, H, D, device, fill=POISON) for kind in "kv"]
    write_kv(k, v, caches[0], caches[1], layout, slots.to(device), quant=scheme)
    assert_matches_reference(scheme, layout, block_size, H, D, nb, slots, caches, k, v)


@pytest.mark.parametrize("name", ["fp8_e4m3/token", "int8/token", "int8_asym/token", "int4/token", "int4/kivi"])
def test_write_kv_matches_the_reference_run_on_the_same_device(name, device):
    """As above with ``scheme.quantize`` on the kernels' device, as the tier transcodes check it: a GPU's torch must
    divide as the kernels do (``workbench.quant.families.common.div``)."""
    scheme = scheme_for(name, 16)
    g = torch.Generator().manual_seed(len(name))
    H, D, nb = 2, 64, 4
    slots = torch.randperm(nb * 16, generator=g)[:32] if not scheme.packed else torch.arange(32)
    k = (torch.randn(32, H, D, generator=g) * 3).half().to(device)
    v = torch.randn(32, H, D, generator=g).to(device)  # an fp32 source: the division by qmax is div_rn's
    caches = [qblocks.empty_cache(scheme, "nhd", kind, nb, 16, H, D, device, fill=POISON) for kind in "kv"]
    write_kv(k, v, caches[0], caches[1], "nhd", slots.to(device), quant=scheme)
    assert_matches_reference(scheme, "nhd", 16, H, D, nb, slots, caches, k, v, ref_on_device=True)


@pytest.mark.parametrize("name", ["int8/token", "int8_asym/token", "fp8_e4m3/token", "int8/tensor", "int8/head",
                                  "int4/token"])
def test_computed_scales_are_ieee_quotients_on_the_compute_device(name, device):
    """A scale is ``range / qmax`` rounded once, as the write kernels divide (``div_rn``), on whatever device the
    reference runs: torch's CUDA division by a Python number multiplies by the rounded reciprocal, one bit off
    for some rows (the GPU-only failure of a tier transcode's check against the kernels, 2026-12-05)."""
    s = quant.SCHEMES[name]
    x = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(11))
    q = torch.tensor(s.qmax, dtype=torch.float64)

    def want(r):  # the exact quotient rounded to fp32, on the CPU
        return (r.double() / q).float()

    rng = (x.amax(-1) - x.amin(-1)) if not s.symmetric else x.abs().amax(-1)
    assert (rng * torch.tensor(1 / s.qmax, dtype=torch.float32) != want(rng)).any()  # a reciprocal would differ
    xd = x.to(device)
    if s.family == "static":
        amax = x.abs().amax() if s.granularity == "tensor" else x.abs().amax(dim=(0, 2))
        assert torch.equal(s.calibrate(xd).cpu(), want(amax))
        return
    qz = s.quantize(xd, "k")
    if s.family == "groups":  # groups of 32 channels: one a row here; the quotient is rounded to fp16 after
        assert torch.equal(qz.scale.reshape(rng.shape).cpu(), want(rng).half())
        return
    assert torch.equal(qz.scale.cpu(), want(rng))


def assert_matches_reference(scheme, layout, block_size, H, D, nb, slots, caches, k, v, ref_on_device=False):
    """The written slots' codes (byte for byte: fp8's -0.0 and +0.0 differ), scales and zero points equal
    ``scheme.quantize``'s (on the CPU, or with ``ref_on_device`` where the kernels ran)."""
    for kind, x, cache in (("k", k, caches[0]), ("v", v, caches[1])):
        want = scheme.quantize(x if ref_on_device else x.cpu(), kind)
        want = dataclasses.replace(want, **{f.name: getattr(want, f.name).cpu() for f in dataclasses.fields(want)
                                            if getattr(want, f.name) is not None})
        got = to_nhd(cache, layout, kind).reshape(nb * block_size, H, -1)[slots].cpu()
        if got.dtype.is_floating_point:  # fp8: the bytes
            bad = (got.view(torch.uint8) != want.codes.view(torch.uint8)).nonzero()[:3].tolist()
            assert torch.equal(got.view(torch.uint8), want.codes.view(torch.uint8)), f"{kind} codes differ at {bad}"
        else:
            assert torch.equal(got, want.codes), f"{kind} codes differ at {(got != want.codes).nonzero()[:3].tolist()}"
        sc = qblocks.block_scales(scheme, kind, block_size, H, D)
        scale, zero = qblocks.scale_views(qblocks.plane_of(cache), sc)
        if sc.tokens_per_group == 1:
            got_s = scale.reshape(nb * block_size, H, -1)[slots].cpu()
            got_z = zero.reshape(nb * block_size, H, -1)[slots].cpu() if zero is not None else None
        else:  # per key group: one row per group, in slot order
            rows = slots[::scheme.group]
            got_s = scale[rows // block_size, (rows % block_size) // scheme.group].cpu()
            got_z = zero[rows // block_size, (rows % block_size) // scheme.group].cpu()
        assert torch.equal(got_s.reshape(want.scale.shape), want.scale), f"{kind} scales differ"
        if want.zero is not None:
            assert torch.equal(got_z.reshape(want.zero.shape), want.zero), f"{kind} zero points differ"

def written_pair(scheme, layout, block_size, H, D, nb, g, device, scale=1.0, kernel=False):
    """K/V caches with every slot written (static scales calibrated); returns them and scales. The writes go through
    the references (``kernel=True``: write_kv, for schemes with scales computed on write): the write kernels are
    checked against them above (codes and scales) and in test_write_copy, and under the interpreter they took half
    of each decode case's time."""
    T = nb * block_size
    k = (torch.randn(T, H, D, generator=g) * scale).to(device)
    v = torch.randn(T, H, D, generator=g).to(device)
    caches = [qblocks.empty_cache(scheme, layout, kind, nb, block_size, H, D, device, fill=POISON) for kind in "kv"]
    slots = torch.arange(T, device=device)
    if scheme.static:
        kw = dict(k_scale=scheme.calibrate(k).reshape(-1), v_scale=scheme.calibrate(v).reshape(-1))
        write_kv_ref(k.half(), v.half(), caches[0], caches[1], layout, slots, **kw)
        return caches, kw["k_scale"], kw["v_scale"]
    if kernel:
        write_kv(k.half(), v.half(), caches[0], caches[1], layout, slots, quant=scheme)
    else:
        write_cache_ref(scheme, k.half(), v.half(), caches[0], caches[1], layout, slots)
    return caches, None, None


DECODED = ["fp8_e4m3/tensor", "fp8_e4m3/head", "fp8_e5m2/token", "int8/tensor", "int8/head", "int8/token",
           "int8_asym/token", "int4/token", "int4/kivi", "int2/token", "int2/kivi"]


# every scheme in NHD; the other layouts (their address arithmetic is the schemes' common path) with one scheme
# of each decode mode: static, per token, asymmetric per token, packed per token, packed KIVI
DECODE_CASES = [(n, "nhd") for n in DECODED] + [
    (n, layout) for layout in ("hnd", "vllm")
    for n in ("fp8_e4m3/head", "int8/token", "int8_asym/token", "int2/token", "int4/kivi")]


@pytest.mark.parametrize("name, layout", DECODE_CASES)
def test_paged_decode_reads_every_scheme(name, layout, device):
    block_size = 16 if layout != "hnd" else 32
    scheme = scheme_for(name, block_size)
    g = torch.Generator().manual_seed(7)
    H, G, D, nb = 2, 4, 64, 5  # 5 blocks, 4 of them in each sequence's table
    (kc, vc), ks, vs = written_pair(scheme, layout, block_size, H, D, nb, g, device, scale=2.0)
    lens = torch.tensor([1, 40, block_size * 3, 0], dtype=torch.int32)
    table = torch.stack([torch.randperm(nb, generator=g)[:4] for _ in lens]).int()
    q = torch.randn(len(lens), H * G, D, generator=g).half().to(device)
    out = torch.full_like(q, float("nan"))  # poisoned output
    kw = dict(k_scale=ks, v_scale=vs) if scheme.static else dict(quant=scheme)
    paged_decode(q, kc, vc, layout, table.to(device), lens.to(device), out=out, **kw)
    kd = dequantize_cache_ref(scheme, kc, layout, "k", D)
    vd = dequantize_cache_ref(scheme, vc, layout, "v", D)
    if ks is not None:
        kd, vd = kd * ks.reshape(1, 1, -1, 1), vd * vs.reshape(1, 1, -1, 1)
    ref = paged_decode_ref(q, kd, vd, "nhd", table.to(device), lens.to(device))
    assert torch.all(out[3] == 0), "an empty sequence gives zeros"
    err = rel_err(out[:3], ref[:3])
    print(f"{name} {layout}: rel_err {err:.2e}")
    assert err < 1e-3


def test_decode_with_splits_and_bf16_queries(device):
    scheme = quant.get("int8_asym/token")
    g = torch.Generator().manual_seed(3)
    (kc, vc), _, _ = written_pair(scheme, "nhd", 16, 2, 64, 8, g, device, kernel=True)  # write kernel -> decode
    lens = torch.tensor([100, 37], dtype=torch.int32, device=device)
    table = torch.stack([torch.randperm(8, generator=g)[:7] for _ in range(2)]).int().to(device)
    kd, vd = (dequantize_cache_ref(scheme, c, "nhd", kind, 64) for c, kind in ((kc, "k"), (vc, "v")))
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(2, 4, 64, generator=g).to(dtype).to(device)
        ref = paged_decode_ref(q, kd, vd, "nhd", table, lens)
        for splits in (1, 3):
            out = paged_decode(q, kc, vc, "nhd", table, lens, quant=scheme, num_splits=splits)
            assert rel_err(out, ref) < (1e-3 if dtype == torch.float16 else 1e-2)


def test_quantized_arguments_are_checked(device):
    s = quant.get("int4/token")
    kc = qblocks.empty_cache(s, "nhd", "k", 4, 16, 2, 64, device, fill=0)
    vc = qblocks.empty_cache(s, "nhd", "v", 4, 16, 2, 64, device, fill=0)
    q = torch.randn(1, 2, 64, dtype=torch.float16, device=device)
    table = torch.zeros((1, 1), dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="uint8 codes.*name the scheme"):
        paged_decode(q, kc, vc, "nhd", table, lens)
    with pytest.raises(ValueError, match="must be None for int4/token"):
        paged_decode(q, kc, vc, "nhd", table, lens, quant=s, k_scale=1.0)
    with pytest.raises(ValueError, match="quantization scheme must be one of"):
        paged_decode(q, kc, vc, "nhd", table, lens, quant="int3")
    with pytest.raises(ValueError, match="stores torch.float8_e4m3fn"):
        paged_decode(q, kc, vc, "nhd", table, lens, quant="fp8_e4m3/token")
    small = torch.empty((4, 16, 2, 32), dtype=torch.uint8, device=device)  # no room for the scales
    with pytest.raises(ValueError, match="cannot hold int4/token"):
        paged_decode(q, small, small, "nhd", table, lens, quant=s)
    kivi = quant.get("int4/kivi", group=16)
    kc, vc = (qblocks.empty_cache(kivi, "nhd", kind, 4, 16, 2, 64, device, fill=0) for kind in "kv")
    key = torch.randn(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="whole groups"):
        write_kv(key, key, kc, vc, "nhd", torch.arange(3, device=device), quant=kivi)
    with pytest.raises(ValueError, match="consecutive slots"):
        write_kv(torch.randn(16, 2, 64, device=device), torch.randn(16, 2, 64, device=device), kc, vc, "nhd",
                 torch.arange(16, device=device).flip(0), quant=kivi)
    with pytest.raises(ValueError, match="needs a power-of-two head_dim|at least 16"):
        qblocks.empty_cache(quant.get("int2/token"), "nhd", "k", 2, 16, 2, 32, device)  # fine to allocate ...
        write_kv(torch.randn(1, 2, 32, device=device), torch.randn(1, 2, 32, device=device),
                 qblocks.empty_cache(quant.get("int2/token"), "nhd", "k", 2, 16, 2, 32, device),
                 qblocks.empty_cache(quant.get("int2/token"), "nhd", "v", 2, 16, 2, 32, device), "nhd",
                 torch.zeros(1, dtype=torch.long, device=device), quant="int2/token")  # ... not to write 8-byte rows


def test_write_counts_nonfinite_on_the_kernel_path(device):
    s = quant.get("fp8_e4m3/token")
    kc = qblocks.empty_cache(s, "nhd", "k", 2, 16, 2, 64, device, fill=0)
    vc = qblocks.empty_cache(s, "nhd", "v", 2, 16, 2, 64, device, fill=0)
    k = torch.randn(4, 2, 64, device=device)
    k[1, 0, 3] = float("nan")
    k[2, 1, 5] = float("inf")
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    write_kv(k, k.clone().nan_to_num(0.0), kc, vc, "nhd", torch.arange(4, device=device), quant=s, nonfinite=counter)
    assert int(counter) == 2
    with pytest.warns(UserWarning, match="2 NaN/Inf values"):
        write_kv(k, k.clone().nan_to_num(0.0), kc, vc, "nhd", torch.arange(4, device=device), quant=s)


def test_quant_bench_smoke_rows(device, tmp_path):
    """The benchmark's decode and write sections on tiny shapes (the interpreter): tidy rows, checked numbers."""
    from workbench.bench import quant_decode
    from workbench.core.workloads import Workload

    w = Workload("T", "tiny", 2, 40, 4, 2, head_dim=64)
    rows = quant_decode.run_decode(w, 0.0, ["fp16", "int8/token", "int4/kivi"], 10, False, str(device))
    # 1-byte codes: four warps on 128-token tiles beside the default; packed groups: the generic kernel (the
    # heuristic) and the planes kernel beside it, in the same run
    assert [(r["scheme"], r["variant"], r["launch_kernel"]) for r in rows] == [
        ("fp16", "heuristic", "generic"), ("int8/token", "heuristic", "generic"),
        ("int8/token", "w4-BLOCK_N128", "generic"),
        ("int4/kivi", "heuristic", "generic"), ("int4/kivi", "planes-BLOCK_N128", "planes")]
    for r in rows:
        assert r["section"] == "decode" and not r.get("error")
        assert r["rel_err"] < 1e-3 and r["bytes_per_token"] > 0
    assert rows[3]["quant_err"] > rows[1]["quant_err"] > rows[0]["quant_err"]  # int4 loses more than int8
    write = quant_decode.run_write(0.0, ["fp8_e4m3/token", "int2/kivi"], 10, str(device), tokens=32, heads=2,
                                   head_dim=64)
    assert [r["section"] for r in write] == ["write", "write"] and all(r["bytes"] > 0 for r in write)
    assert {n for n, _ in quant_decode.tune_variants(quant.get("fp16"), {"num_splits": 2, "BLOCK_N": 32})} >= {
        "heuristic", "w2-BLOCK_N64-stages3"}


def test_quant_bench_times_the_streams_kernel_where_keys_are_per_token():
    """Keys per token: the streams kernel at two tiles beside the planes kernel (a plan says which kernel it chose:
    tests/test_decode_streams.py); KIVI's keys per channel: the planes kernel only; one group a head by name."""
    from workbench.bench import quant_decode

    names = [n for n, _ in quant_decode.decode_variants(quant_decode.bench_scheme("int4/token@head", 64), {})]
    assert names == ["heuristic", "streams-BLOCK_N128", "streams-BLOCK_N256", "planes-BLOCK_N128", "generic-BLOCK_N32"]
    assert [n for n, _ in quant_decode.decode_variants(quant_decode.bench_scheme("int2/kivi"), {})] == [
        "heuristic", "planes-BLOCK_N128"]
    assert quant_decode.decode_variants(quant.get("int8/token"), {}) == [
        ("heuristic", {}), ("w4-BLOCK_N128", {"num_warps": 4, "BLOCK_N": 128})]
    assert quant_decode.decode_variants(quant.get("fp16"), {}) == [("heuristic", {})]
    # groups of 32 channels and int2 spill in the streams kernel: not timed there
    assert [n for n, _ in quant_decode.decode_variants(quant_decode.bench_scheme("int2/token@head", 64), {})] == [
        "heuristic", "planes-BLOCK_N128", "generic-BLOCK_N32"]
    assert [n for n, _ in quant_decode.decode_variants(quant_decode.bench_scheme("int4/token"), {}, head_dim=128)] == [
        "heuristic", "planes-BLOCK_N128"]
    assert quant_decode.bench_scheme("int4/token@head", 64).value_group == 64
    for bad, head_dim in (("int4/token@head", None), ("int8/token@head", 64), ("int4/token@g32", 64)):
        with pytest.raises(ValueError, match="@head"):
            quant_decode.bench_scheme(bad, head_dim)


def test_quant_bench_rows_survive_unmeasurable_timings(monkeypatch, device):
    """Issue 30 item 2: on the H200 the smoke rows divided by a copy bandwidth of 0 (a smoke run measures none) and
    by timings that round to 0: ZeroDivisionError. A ratio with such a denominator is now None, with a note."""
    from workbench.bench import quant_decode
    from workbench.core.workloads import Workload

    assert quant_decode.rates(1000, 0.0, 100.0, 5.0, speedup=True) == {
        "bw_fraction": None, "speedup_vs_fp16": None, "note": "time 0.0 us not measurable: no rates"}
    got = quant_decode.rates(1000, 2.0, 0.0, 0.0, speedup=True)
    assert got["bw_fraction"] is None and got["speedup_vs_fp16"] is None and "copy bandwidth" in got["note"]
    assert quant_decode.rates(1000, 2.0, 1.0, 4.0, speedup=True) == {"bw_fraction": 0.5, "speedup_vs_fp16": 2.0}
    assert quant_decode.rates(1000, float("nan"), 1.0)["bw_fraction"] is None
    for fake in (0.0, 1.0):  # every timing 0 (then 1 us) on the CPU, no copy bandwidth: rows, never a crash
        monkeypatch.setattr(quant_decode.harness, "time_us", lambda fn, fake=fake, **kw: fake)
        monkeypatch.setattr(quant_decode.harness, "time_us_graph", lambda fn, fake=fake, **kw: fake)
        w = Workload("T", "tiny", 2, 40, 4, 2, head_dim=64)
        rows = quant_decode.run_decode(w, 0.0, ["fp16", "int4/kivi"], 10, False, str(device), timed=True)
        rows += quant_decode.run_write(0.0, ["int2/kivi"], 10, str(device), tokens=32, heads=2, head_dim=64,
                                       timed=True)
        assert [r.get("error") for r in rows] == [None] * 4  # int4/kivi: the generic and the planes variant
        assert all(r["bw_fraction"] is None and "not measur" in r["note"] for r in rows)
        assert [r.get("speedup_vs_fp16", "-") for r in rows] == ([None] * 3 if fake == 0 else [1.0] * 3) + ["-"]


@pytest.mark.parametrize("name", ["fp8_e4m3/tensor", "fp8_e5m2/head", "int8/tensor"])
def test_static_scales_saturate_on_the_kernel_path(name, device):
    """Values beyond ``qmax * scale`` (a calibration that missed them) store the largest code, never NaN or a wrap."""
    scheme = quant.get(name)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 2, 64, generator=g) * 4
    x[3, 1, 7], x[9, 0, 0] = 1e4, -1e4  # far outside the scale's range
    scale = scheme.calibrate(x[:2]).reshape(-1)  # calibrated on two tokens: the rest saturates
    kc = qblocks.empty_cache(scheme, "nhd", "k", 2, 16, 2, 64, device, fill=POISON)
    vc = qblocks.empty_cache(scheme, "nhd", "v", 2, 16, 2, 64, device, fill=POISON)
    write_kv(x.to(device), x.to(device), kc, vc, "nhd", torch.arange(16, device=device), k_scale=scale.to(device),
             v_scale=scale.to(device))
    got = kc.reshape(32, 2, 64)[:16].cpu()
    want = scheme.quantize(x, "k", scale).codes
    if got.dtype.is_floating_point:
        assert int(quant_code_distance(got, want).max()) == 0 and not torch.isnan(got.float()).any()
        assert float(got[3, 1, 7].float()) == scheme.qmax and float(got[9, 0, 0].float()) == -scheme.qmax
    else:
        assert torch.equal(got, want) and int(got[3, 1, 7]) == 127 and int(got[9, 0, 0]) == -128


@pytest.mark.parametrize("v_scale_kind", ["tensor1", "float"])
def test_per_head_and_per_tensor_static_scales_mix(v_scale_kind, device):
    """K per kv head with V per tensor (a one-element tensor, broadcast on the device, or a float)."""
    g = torch.Generator().manual_seed(8)
    kc, vc = (torch.randn(6, 16, 2, 64, generator=g).to(torch.float8_e4m3fn).to(device) for _ in range(2))
    ks = torch.tensor([0.02, 0.05], device=device)
    vs = torch.tensor([0.03], device=device) if v_scale_kind == "tensor1" else 0.03
    lens = torch.tensor([40, 7], dtype=torch.int32, device=device)
    table = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(2)]).int().to(device)
    q = torch.randn(2, 4, 64, generator=g).half().to(device)
    out = torch.full_like(q, float("nan"))
    paged_decode(q, kc, vc, "nhd", table, lens, k_scale=ks, v_scale=vs, out=out)
    ref = paged_decode_ref(q, kc.float() * ks.reshape(1, 1, -1, 1), vc.float() * 0.03, "nhd", table, lens)
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e4m3/head", "int8/tensor", "fp8_e5m2/token", "int8/token",
                                  "int8_asym/token", "int4/token", "int4/kivi", "int2/token", "int2/kivi"])
def test_dequantize_blocks_is_the_reference_bit_for_bit(name, layout, device):
    """Every slot of poisoned, partly written blocks: the reference's values (static scales per layer and head
    applied), NaN where it has NaN; with ``nonfinite``, NaN/Inf as 0 and counted."""
    from workbench.kernels.write.dequantize import dequantize_blocks

    s = scheme_for(name, 16)
    if layout == "vllm" and s.packed and s.key_mode == "channel":
        pytest.skip("the vllm layout cannot hold packed KIVI keys")
    g = torch.Generator().manual_seed(len(name) + len(layout))
    H, D, nb, bs = 2, 64, 3, 16
    T = 2 * bs if s.packed else nb * bs - 5  # the last block partly (packed: not at all) written: poison
    k, v = ((torch.randn(T, H, D, generator=g) * 2).half().to(device) for _ in range(2))
    caches = [qblocks.empty_cache(s, layout, kind, nb, bs, H, D, device, fill=POISON) for kind in "kv"]
    slots = torch.arange(T, device=device)
    if s.static:
        write_kv_ref(k, v, caches[0], caches[1], layout, slots, k_scale=torch.tensor([0.03], device=device),
                     v_scale=torch.tensor([0.04], device=device))
    else:
        write_cache_ref(s, k, v, caches[0], caches[1], layout, slots)
    static = torch.tensor([[0.5, 0.25], [2.0, 0.75], [1.0, 3.0]], device=device) if s.static else None  # 3 layers
    for kind, cache in zip("kv", caches, strict=True):
        ref = dequantize_cache_ref(s, cache, layout, kind, D)
        if static is not None:
            ref = ref * static[torch.arange(nb, device=device) % 3][:, None, :, None]
        got = dequantize_blocks(s, cache, layout, kind, D, static_scale=static,
                                out=torch.full(ref.shape, 12345.0, device=device))  # poisoned: every slot written
        assert torch.equal(torch.isnan(got), torch.isnan(ref))
        assert torch.isnan(ref).any() or name == "int8/tensor"  # the poison: NaN but in static int8 codes (-1)
        assert torch.equal(got.nan_to_num(), ref.nan_to_num())
        bad = torch.zeros(1, dtype=torch.int32, device=device)
        clean = dequantize_blocks(s, cache, layout, kind, D, static_scale=static, nonfinite=bad,
                                  out=torch.full(ref.shape, float("nan"), device=device))
        assert torch.equal(clean, ref.nan_to_num(0.0, 0.0, 0.0)) and int(bad) == int((~torch.isfinite(ref)).sum())
