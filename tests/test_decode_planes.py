"""The planes kernel of packed group codes (kernels/decode/groups.py, ``planes=True``): its bit-trick fields equal the
codes for every byte, it reads every packed scheme within the bounds of the dequantized reference (fp16, bf16, fp32
queries, GQA groups 1-16, head dims 64-256, splits, per-token and per-channel keys), it never lets an unwritten
(poisoned) slot reach the output, and the plan says which kernel it chose and falls back to the generic one where the
planes do not apply."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import rel_err
from workbench.kernels import DecodePlan, paged_decode
from workbench.kernels.decode.groups import _planes, planes_launch
from workbench.kernels.decode.reference import paged_decode_ref
from workbench.kernels.write.reference import dequantize_cache_ref, write_cache_ref

from workbench import quant
from workbench.core.backend import is_interpreted
from workbench.quant import blocks as qblocks

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

POISON = 0xFF  # NaN in fp16 scales and zero points, 255 in the code bytes


@triton.jit
def _fields_kernel(b_ptr, out_ptr, BITS: tl.constexpr, ASM: tl.constexpr):
    o = tl.arange(0, 256)
    planes = _planes(tl.load(b_ptr + o), BITS, ASM)
    for k in tl.static_range(8 // BITS):
        tl.store(out_ptr + k * 256 + o, planes[k])


@pytest.mark.parametrize("bits", [4, 2])
def test_fields_are_the_centred_codes_times_their_power_of_two(bits, device):
    """Every byte value: field k equals (code - 2**(bits-1)) * 2**(bits k), exactly (the PTX path on a GPU)."""
    b = torch.arange(256, dtype=torch.uint8, device=device)
    out = torch.full((8 // bits, 256), float("nan"), dtype=torch.float16, device=device)
    _fields_kernel[(1,)](b, out, BITS=bits, ASM=not is_interpreted())
    codes = quant.unpack(b.cpu()[:, None], bits).T.float()  # [fields, 256]: field k of byte j
    want = (codes - 2 ** (bits - 1)) * (2.0 ** (bits * torch.arange(8 // bits)))[:, None]
    assert torch.equal(out.cpu().float(), want)


# (scheme, params, layout, block size, kv heads, group, head_dim, q dtype, splits)
CASES = [
    ("int4/token", {}, "nhd", 16, 2, 4, 64, torch.float16, None),
    ("int4/kivi", {"group": 32}, "hnd", 32, 1, 8, 128, torch.float16, 2),
    ("int2/token", {}, "nhd", 16, 2, 1, 128, torch.bfloat16, 3),
    ("int2/kivi", {"group": 16}, "nhd", 64, 2, 2, 64, torch.float32, None),
    ("int4/token", {"value_group": 64}, "hnd", 16, 1, 16, 256, torch.float16, None),
    ("int4/kivi", {"group": 16, "value_group": 16}, "nhd", 16, 2, 4, 64, torch.float16, 1),
    ("int2/token", {"value_group": 128}, "nhd", 16, 2, 4, 128, torch.float16, 2),  # one group a head: one scale
    ("int4/token", {"value_group": 64}, "hnd", 16, 1, 2, 64, torch.bfloat16, None),  # term for every plane
]
BOUND = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def written_sequences(scheme, layout, block_size, H, D, lens, g, device):
    """Caches in which only the slots of each sequence are written (whole key groups for per-channel keys), every
    other byte poisoned; returns ``(k_cache, v_cache, block_table)``."""
    per_seq = -(-max(lens) // block_size)
    nb = per_seq * len(lens) + 1
    table = torch.randperm(nb, generator=g)[: per_seq * len(lens)].reshape(len(lens), per_seq).int()
    caches = [qblocks.empty_cache(scheme, layout, kind, nb, block_size, H, D, device, fill=POISON) for kind in "kv"]
    unit = scheme.group if scheme.key_mode == "channel" else 1
    for b, n in enumerate(lens):
        n = -(-n // unit) * unit
        if n == 0:
            continue
        t = torch.arange(n)
        slots = (table[b, t // block_size].long() * block_size + t % block_size).to(device)
        k = (torch.randn(n, H, D, generator=g) * 2 + torch.randn(1, H, D, generator=g)).to(device)  # channel offsets
        v = torch.randn(n, H, D, generator=g).to(device)
        write_cache_ref(scheme, k.half(), v.half(), caches[0], caches[1], layout, slots)
    return caches[0], caches[1], table.to(device)


@pytest.mark.parametrize("name, params, layout, block_size, H, G, D, dtype, splits", CASES)
def test_planes_read_every_packed_scheme(name, params, layout, block_size, H, G, D, dtype, splits, device):
    scheme = quant.get(name, residual=0, **params)
    g = torch.Generator().manual_seed(block_size * G + D)
    lens = [1, 47, 3 * block_size, 0, 2 * block_size + 5]
    kc, vc, table = written_sequences(scheme, layout, block_size, H, D, lens, g, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), H * G, D, generator=g).to(dtype).to(device)
    plan = DecodePlan(table, seq_lens, layout=layout, k_cache=kc, v_cache=vc, num_q_heads=H * G, q_dtype=dtype,
                      num_splits=splits, quant=scheme, planes=True, streams=0)  # streams=0: this kernel, not streams.py
    assert plan.config["kernel"] == "planes"
    out = plan.run(q, kc, vc, out=torch.full_like(q, float("nan")))  # poisoned output
    kd, vd = (dequantize_cache_ref(scheme, c, layout, kind, D) for c, kind in ((kc, "k"), (vc, "v")))
    ref = paged_decode_ref(q, kd.nan_to_num(), vd.nan_to_num(), "nhd", table, seq_lens)  # poison is never read
    assert torch.isfinite(out).all(), "an unwritten slot reached the output"
    assert torch.all(out[3] == 0), "an empty sequence gives zeros"
    keep = [0, 1, 2, 4]
    assert rel_err(out[keep], ref[keep]) < BOUND[dtype]
    generic = paged_decode(q, kc, vc, layout, table, seq_lens, quant=scheme, num_splits=splits, planes=False)
    assert rel_err(out[keep], generic[keep]) < 2 * BOUND[dtype]


def test_plan_names_its_kernel_and_falls_back_where_planes_do_not_apply(device):
    g = torch.Generator().manual_seed(5)
    H, D, lens = 1, 64, [20]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for scheme, layout, want in [(quant.get("int4/token"), "vllm", "generic"),  # the split layout
                                 (quant.get("int4/token", value_group=8), "nhd", "generic"),  # 8-byte planes
                                 (quant.get("int2/kivi", group=8, residual=0), "nhd", "generic"),  # 8-token key groups
                                 (quant.get("int2/kivi", group=16, residual=0), "nhd", "planes"),
                                 (quant.get("int4/token", residual=0), "nhd", "streams"),  # per-token keys
                                 (quant.get("fp8_e4m3/token"), "nhd", "generic")]:
        kc, vc, table = written_sequences(scheme, layout, 16, H, D, lens, g, device)
        plan = DecodePlan(table, seq_lens, layout=layout, k_cache=kc, v_cache=vc, num_q_heads=4,
                          q_dtype=torch.float16, quant=scheme, planes=True)
        assert plan.config["kernel"] == want, (scheme.name, layout)
        default = DecodePlan(table, seq_lens, layout=layout, k_cache=kc, v_cache=vc, num_q_heads=4,
                             q_dtype=torch.float16, quant=scheme)
        assert default.config["kernel"] == "generic"  # until the H200 has timed both


def test_planes_launch_keeps_a_tile_inside_one_key_group():
    consts = dict(QMODE=4, DC=32, K_TG=16, K_DG=1, V_DG=32)
    assert planes_launch(consts, "nhd", 64) == {"CW": 32, "BLOCK_N": 16}
    assert planes_launch(dict(consts, K_TG=1, K_DG=32), "hnd", 64) == {"CW": 32, "BLOCK_N": 64}
    assert planes_launch({**consts, "V_DG": 16}, "nhd", 32) == {"CW": 16, "BLOCK_N": 16}
    assert planes_launch({**consts, "QMODE": 2}, "nhd", 32) is None
