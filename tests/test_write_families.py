"""Each family's quantize-on-write kernel (issue 31: kernels/write/token.py, kernels/write/groups.py) against the
scheme's reference, code by code, where the tests of issue 11 do not reach it (128 dims: four int2 planes, two int4
groups a plane, the bench's shape; rows padded to the planes); the rare path (NaN/Inf counted, subnormal fp16
group scales, tiny fp32 rows); -0.0 keeping its fp8 code; which kernel a shape gets; and ``write_launches`` giving
what ``write_kv`` launches. The property beside the generic kernel is tests/test_write_families_property.py
(hypothesis: the GPU image may lack it)."""

import pytest
import torch
from test_quant_kernels import assert_matches_reference
from workbench.kernels import write_kv
from workbench.kernels.write import write_launches
from workbench.kernels.write.reference import quant_code_distance, write_kv_ref

import workbench
from workbench import quant
from workbench.core.layout import to_nhd
from workbench.quant import blocks as qblocks

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled

DEV = workbench.device()
DYNAMIC = ["fp8_e4m3/token", "fp8_e5m2/token", "int8/token", "int8_asym/token", "int4/token", "int2/token",
           "int4/kivi", "int2/kivi"]
POISON = 0xFF


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


def scheme_for(name: str, group: int = 16) -> quant.Scheme:
    s = quant.get(name)
    return s.with_params(group=group, residual=0) if "group" in s.param_names else s


def group_slots(n_groups: int, group: int, block_size: int, num_blocks: int, g) -> torch.Tensor:
    """Slots of ``n_groups`` whole groups of ``group`` consecutive slots, over random blocks."""
    per_block = block_size // group
    picks = torch.randperm(num_blocks * per_block, generator=g)[:n_groups]
    return (picks[:, None] * group + torch.arange(group)).reshape(-1)


def awkward(g, T, H, D, dtype=torch.float16):
    """Random rows with -0.0 entries, a constant row, a row of one value and zeros, a tiny-range row (fp16
    subnormal group scales) and large ones, all inside fp16."""
    x = torch.randn(T, H, D, generator=g) * 3
    x[0, 0, :7] = -0.0
    x[1 % T, H - 1] = 2.5  # constant
    x[2 % T, 0] = 0.0
    x[2 % T, 0, 5] = -7.0
    x[3 % T, 0] = torch.randint(0, 5, (D,), generator=g) * 2.0**-24  # a range of a few fp16 subnormals
    x[4 % T, H - 1] *= 3000.0
    return x.to(dtype)


def written(scheme, layout, block_size, H, D, nb, slots, k, v, **kw):
    caches = [qblocks.empty_cache(scheme, layout, kind, nb, block_size, H, D, DEV, fill=POISON) for kind in "kv"]
    write_kv(k.to(DEV), v.to(DEV), caches[0], caches[1], layout, slots.to(DEV), quant=scheme, **kw)
    return caches


def kernels_of(scheme, layout, block_size, H, D, nb=2, T=16) -> list[str]:
    caches = [qblocks.empty_cache(scheme, layout, kind, nb, block_size, H, D, DEV) for kind in "kv"]
    x = torch.zeros(T, H, D, dtype=torch.float16, device=DEV)
    return [ln.kernel.__name__ for ln in write_launches(x, x, caches[0], caches[1], layout,
                                                        torch.arange(T, device=DEV), quant=scheme)]


# ---- each family's kernel at 128 dims, against the reference -----------------------------------------------------
@pytest.mark.parametrize("name", DYNAMIC)
@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_family_kernel_matches_the_reference_at_128_dims(name, layout):
    scheme = scheme_for(name)
    g = torch.Generator().manual_seed(len(name) + len(layout))
    H, D, bs, nb = 2, 128, 16, 4
    slots = group_slots(3, 16, bs, nb, g)
    T = slots.numel()
    k, v = awkward(g, T, H, D), awkward(g, T, H, D)
    assert not any(n == "_write_dynamic_kernel" for n in kernels_of(scheme, layout, bs, H, D))
    caches = written(scheme, layout, bs, H, D, nb, slots, k, v)
    assert_matches_reference(scheme, layout, bs, H, D, nb, slots, caches, k, v)


@pytest.mark.parametrize("name", ["int4/kivi", "int2/kivi"])
@pytest.mark.parametrize("tok", [0, 1])
def test_key_groups_kernel_takes_its_tokens_on_either_axis(name, tok, monkeypatch):
    """The KIVI key kernel's token axis follows the Triton version (groups.TOKEN_AXIS: 1 under the GPU's 3.6, 0 under
    3.9 here): both tiles write the reference's codes."""
    from workbench.kernels.write import groups

    monkeypatch.setattr(groups, "TOKEN_AXIS", tok)
    scheme = scheme_for(name)
    g = torch.Generator().manual_seed(tok)
    H, D, bs, nb = 2, 128, 32, 3
    slots = group_slots(4, 16, bs, nb, g)
    k, v = awkward(g, slots.numel(), H, D), awkward(g, slots.numel(), H, D)
    caches = written(scheme, "nhd", bs, H, D, nb, slots, k, v)
    assert_matches_reference(scheme, "nhd", bs, H, D, nb, slots, caches, k, v)


@pytest.mark.parametrize("name", ["fp8_e4m3/token", "int8_asym/token", "int4/token", "int4/kivi"])
def test_family_kernel_matches_the_reference_on_an_fp32_source(name):
    """fp32 rows beyond fp16, tiny rows (scales below 2**-80: the rare path divides) and -0.0."""
    scheme = scheme_for(name)
    g = torch.Generator().manual_seed(11)
    H, D, bs, nb = 2, 128, 16, 3
    slots = group_slots(2, 16, bs, nb, g)
    T = slots.numel()
    k, v = awkward(g, T, H, D, torch.float32), awkward(g, T, H, D, torch.float32)
    k[5, 1] *= 1e-30  # a tiny row
    v[6, 0, :32] *= 1e-33
    v[7, 1, 3] = 2e4
    caches = written(scheme, "nhd", bs, H, D, nb, slots, k, v)
    assert_matches_reference(scheme, "nhd", bs, H, D, nb, slots, caches, k, v)


@pytest.mark.parametrize("name", ["fp8_e5m2/token", "int8_asym/token"])
@pytest.mark.parametrize("d", [24, 96])
def test_token_kernel_pads_a_row_to_its_planes(name, d):
    """96 dims: four planes of 32, the last channels masked (out of the asymmetric row's min/max); 24: three of 8."""
    scheme = scheme_for(name)
    g = torch.Generator().manual_seed(d)
    H, bs, nb = 2, 16, 2
    slots = group_slots(2, 8, bs, nb, g)
    k, v = awkward(g, slots.numel(), H, d) + 4, awkward(g, slots.numel(), H, d)  # rows above 0: padding must not count
    caches = written(scheme, "nhd", bs, H, d, nb, slots, k, v)
    assert_matches_reference(scheme, "nhd", bs, H, d, nb, slots, caches, k, v)


# ---- the rare path -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["fp8_e4m3/token", "int8_asym/token", "int4/token", "int2/kivi"])
def test_nonfinite_inputs_are_counted_by_the_family_kernels(name):
    scheme = scheme_for(name)
    H, D, bs, nb = 2, 128, 16, 3
    k = torch.randn(32, H, D, dtype=torch.float16)
    v = k.clone()
    k[1, 0, 3], k[17, 1, 100] = float("nan"), float("inf")
    v[30, 1, 64] = float("-inf")
    slots = torch.arange(32)
    slots[16:32] = -1  # padding: token 17's Inf is not written, not counted
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    written(scheme, "nhd", bs, H, D, nb, slots, k, v, nonfinite=counter)
    assert int(counter) == 1, int(counter)
    counter.zero_()
    written(scheme, "nhd", bs, H, D, nb, torch.arange(32), k, v, nonfinite=counter)
    assert int(counter) == 3, int(counter)


def test_negative_zero_keeps_its_fp8_code():
    """-0.0 / scale is -0.0: the fp8 code 0x80 (the fast division's residual gave +0.0; the software rounding of the
    interpreter and the generic kernel dropped the sign too)."""
    x = torch.randn(16, 2, 64).half()
    x[3, 1, :5] = -0.0
    for name in ("fp8_e4m3/token", "fp8_e5m2/token"):
        s = quant.get(name)
        caches = written(s, "nhd", 16, 2, 64, 1, torch.arange(16), x, x)
        got = to_nhd(caches[0], "nhd", "k").reshape(16, 2, -1).cpu()
        assert got.view(torch.uint8)[3, 1, :5].tolist() == [0x80] * 5, name
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scale = torch.tensor([0.01], device=DEV)
        kc = torch.full((1, 16, 2, 64), 0x11, dtype=torch.uint8, device=DEV).view(dtype)
        kr = kc.clone()
        write_kv(x.to(DEV), x.to(DEV), kc, kc.clone(), "nhd", torch.arange(16, device=DEV), k_scale=scale,
                 v_scale=scale)
        write_kv_ref(x.to(DEV), x.to(DEV), kr, kr.clone(), "nhd", torch.arange(16, device=DEV), k_scale=scale,
                     v_scale=scale)
        assert int(quant_code_distance(kc.cpu(), kr.cpu()).max()) == 0
        assert kc.view(torch.uint8).cpu()[0, 3, 1, :5].tolist() == [0x80] * 5, dtype


# ---- which kernel a shape gets; write_launches -----------------------------------------------------------------
def test_each_family_gets_its_kernel_where_the_shape_allows():
    want = {"fp8_e4m3/token": ["_write_token_kernel"] * 2, "int8_asym/token": ["_write_token_kernel"] * 2,
            "int4/token": ["_write_groups_kernel"] * 2, "int2/kivi": ["_write_key_groups_kernel",
                                                                       "_write_groups_kernel"]}
    for name, kernels in want.items():
        assert kernels_of(scheme_for(name), "nhd", 16, 8, 128) == kernels, name
    # int2 values at 64 dims: 16 bytes a row, its groups of 32 channels span two planes (the generic kernel)
    assert kernels_of(scheme_for("int2/kivi"), "nhd", 16, 2, 64) == ["_write_key_groups_kernel",
                                                                     "_write_dynamic_kernel"]
    assert kernels_of(scheme_for("int8/token"), "nhd", 16, 2, 96) == ["_write_token_kernel"] * 2  # padded planes


def test_write_launches_are_what_write_kv_launches():
    g = torch.Generator().manual_seed(5)
    for name, kw in (("int4/kivi", {}), ("fp8_e4m3/tensor", None), ("fp16", None)):
        scheme = scheme_for(name)
        slots = group_slots(2, 16, 16, 3, g).to(DEV)
        k = torch.randn(32, 2, 64, generator=g).half().to(DEV)
        if kw is None:
            kw = dict(k_scale=scheme.calibrate(k), v_scale=scheme.calibrate(k)) if scheme.quantized else {}
        else:
            kw = dict(quant=scheme)
        out = []
        for how in ("write_kv", "launches"):
            caches = [qblocks.empty_cache(scheme, "nhd", kind, 3, 16, 2, 64, DEV, fill=POISON) for kind in "kv"]
            if how == "write_kv":
                write_kv(k, k, caches[0], caches[1], "nhd", slots, **kw)
            else:
                for ln in write_launches(k, k, caches[0], caches[1], "nhd", slots, **kw):
                    ln()
            out.append([qblocks.plane_of(c).view(torch.uint8).cpu() for c in caches])
        assert all(torch.equal(a, b) for a, b in zip(*out, strict=True)), name


def test_write_launches_checks_as_write_kv_does():
    s = scheme_for("int8/token")
    caches = [qblocks.empty_cache(s, "nhd", kind, 2, 16, 2, 64, DEV) for kind in "kv"]
    k = torch.zeros(4, 2, 64, device=DEV)
    slots = torch.arange(4, device=DEV)
    with pytest.raises(ValueError, match="launch keywords"):
        write_launches(k, k, caches[0], caches[1], "nhd", slots, quant=s, tokens=16)
    with pytest.raises(ValueError, match="k_scale must be None"):
        write_launches(k, k, caches[0], caches[1], "nhd", slots, torch.ones(1, device=DEV), quant=s)
    assert write_launches(k[:0], k[:0], caches[0], caches[1], "nhd", slots[:0], quant=s) == []
