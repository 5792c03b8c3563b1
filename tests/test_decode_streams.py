"""The streams kernel of packed per-token codes (kernels/decode/streams.py, ``planes=True``): a tile's padding rows
carry other streams of tokens. It reads every per-token packed scheme within the bounds of the dequantized reference
(fp16, bf16, fp32 queries; GQA groups 1-16 and so 16-1 streams; head dims 64-256; one scale group a head or several;
splits; lengths that leave streams empty), never lets an unwritten (poisoned) slot reach the output, agrees with the
planes kernel, and its LSE is the reference's."""

import pytest
import torch
import triton
import triton.language as tl
from conftest import rel_err
from test_decode_planes import BOUND, written_sequences
from workbench.kernels import DecodePlan
from workbench.kernels.decode.reference import cascade_decode_ref
from workbench.kernels.decode.streams import _word_planes, streams_launch, streams_tile
from workbench.kernels.write.reference import dequantize_cache_ref

from workbench import quant
from workbench.core.backend import is_interpreted

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

@triton.jit
def _word_fields_kernel(w_ptr, out_ptr, BITS: tl.constexpr, ASM: tl.constexpr):
    o = tl.program_id(0) * 256 + tl.arange(0, 256)
    fields = _word_planes(tl.load(w_ptr + o), BITS, ASM)
    for f in tl.static_range(2 * (8 // BITS)):
        tl.store(out_ptr + f * 65536 + o, fields[f])


@pytest.mark.parametrize("bits", [4, 2])
def test_word_fields_are_the_centred_codes_times_their_power_of_two(bits, device):
    """Every int16 word: field (b, k) equals (code - 2**(bits-1)) * 2**(bits k) of bits [k bits, (k+1) bits) of its
    byte b, exactly (the PTX path on a GPU, two words a register)."""
    w = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    per = 8 // bits
    out = torch.full((2 * per, 65536), float("nan"), dtype=torch.float16, device=device)
    _word_fields_kernel[(256,)](w.to(device), out, BITS=bits, ASM=not is_interpreted())
    x = w.int() & 0xFFFF
    codes = [((x >> (8 * b + bits * k)) & ((1 << bits) - 1), k) for b in range(2) for k in range(per)]
    want = torch.stack([(c - 2 ** (bits - 1)).float() * 2.0 ** (bits * k) for c, k in codes])
    assert torch.equal(out.cpu().float(), want)


# (scheme, params, layout, block size, kv heads, group, head_dim, q dtype, splits, streams)
CASES = [
    ("int4/token", {}, "nhd", 16, 2, 4, 64, torch.float16, None, None),
    ("int4/token", {"value_group": 128}, "hnd", 16, 1, 4, 128, torch.float16, 2, None),  # one group a head
    ("int2/token", {}, "nhd", 16, 2, 1, 128, torch.bfloat16, 3, 4),
    ("int2/token", {"value_group": 64}, "nhd", 32, 1, 2, 128, torch.float32, None, 8),
    ("int4/token", {"value_group": 64}, "hnd", 16, 1, 16, 256, torch.float16, None, None),  # 16 heads: one stream
    ("int4/token", {"value_group": 32}, "nhd", 16, 2, 8, 64, torch.float16, 1, 2),
]


@pytest.mark.parametrize("name, params, layout, block_size, H, G, D, dtype, splits, streams", CASES)
def test_streams_read_every_per_token_packed_scheme(name, params, layout, block_size, H, G, D, dtype, splits,
                                                     streams, device):
    scheme = quant.get(name, residual=0, **params)
    g = torch.Generator().manual_seed(block_size * G + D + 7)
    lens = [1, 47, 3 * block_size, 0, 2 * block_size + 5, 70]
    kc, vc, table = written_sequences(scheme, layout, block_size, H, D, lens, g, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), H * G, D, generator=g).to(dtype).to(device)
    plan = DecodePlan(table, seq_lens, layout=layout, k_cache=kc, v_cache=vc, num_q_heads=H * G, q_dtype=dtype,
                      num_splits=splits, quant=scheme, planes=True, streams=streams, return_lse=True)
    assert plan.config["kernel"] == "streams"
    assert G * plan.config["streams"] <= 16
    out, lse = plan.run(q, kc, vc, out=torch.full_like(q, float("nan")))  # poisoned output
    kd, vd = (dequantize_cache_ref(scheme, c, layout, kind, D) for c, kind in ((kc, "k"), (vc, "v")))
    # no shared segment: the reference decode with its LSE (base 2)
    ref, ref_lse = cascade_decode_ref(q, kd.nan_to_num(), vd.nan_to_num(), "nhd", table, seq_lens, [], [0] * len(lens),
                                      block_size)
    assert torch.isfinite(out).all(), "an unwritten slot reached the output"
    assert torch.all(out[3] == 0), "an empty sequence gives zeros"
    keep = [0, 1, 2, 4, 5]
    assert rel_err(out[keep], ref[keep].to(out.device)) < BOUND[dtype]
    assert torch.allclose(lse[keep].cpu().double(), ref_lse[keep], atol=2e-3, rtol=1e-4)
    planes = DecodePlan(table, seq_lens, layout=layout, k_cache=kc, v_cache=vc, num_q_heads=H * G, q_dtype=dtype,
                        num_splits=splits, quant=scheme, planes=True, streams=0)
    assert planes.config["kernel"] == "planes"
    assert rel_err(out[keep], planes.run(q, kc, vc)[keep]) < 2 * BOUND[dtype]


def test_streams_launch_fills_sixteen_rows():
    consts = dict(QMODE=4, DC=64, K_TG=1, K_DG=32, V_DG=32)
    assert streams_launch(consts, "nhd", 64, 4) == {"CW": 32, "R": 4, "BLOCK_N": 64}
    assert streams_launch(consts, "nhd", 32, 4) == {"CW": 32, "R": 4, "BLOCK_N": 64}  # 16 tokens a stream at least
    assert streams_launch(consts, "hnd", 128, 1, streams=16) == {"CW": 32, "R": 16, "BLOCK_N": 256}
    assert streams_launch(consts, "nhd", 128, 16)["R"] == 1
    assert streams_launch(dict(consts, K_DG=128, V_DG=128), "nhd", 128, 2, streams=2) == {"CW": 64, "R": 2,
                                                                                          "BLOCK_N": 128}
    assert streams_launch(dict(consts, V_DG=16), "nhd", 64, 4) is None  # 8-word planes: under a dot's K of 16
    assert streams_launch(consts, "vllm", 64, 4) is None  # the split layout
    assert streams_launch(dict(consts, K_TG=16), "nhd", 64, 4) is None  # keys per channel: groups.py
    assert streams_launch(consts, "nhd", 64, 32) is None  # a group over 16 rows


def test_streams_tile_grows_with_even_contexts():
    """Where the caller names no tile: 256 tokens for even contexts from 1k tokens (W1, W2, W4 on the H200), 128
    below (W3) and for ragged batches (W5: mean 4k, longest 8k)."""
    assert [streams_tile(c, c) for c in (0, 512, 1023, 1024, 4096, 32768)] == [128, 128, 128, 256, 256, 256]
    assert streams_tile(3978, 7965) == 128 and streams_tile(4000, 5000) == 256


@pytest.mark.parametrize("name, kernel, lens", [
    ("int4/token", "streams", [1, 1500, 37, 2700]),  # ragged: 128-token tiles on a GPU
    ("int4/token", "streams", [1500, 1500, 1400, 1300]),  # even, over 1k: 256-token tiles on a GPU
    ("int2/token", "planes", [1, 1500, 37, 2700])])
def test_one_scale_a_head_takes_its_kernel_without_launch_options(name, kernel, lens, device):
    """A plan given no launch options: on a GPU, one scale a token-head runs the kernel measured fastest for it
    (kernels/decode/quant.py ``_packed_defaults``); under the interpreter the generic one. Either reads the cache
    within the reference's bounds, the output poisoned first."""
    from workbench.core.backend import is_interpreted

    D, H, G, block_size = 128, 2, 4, 16
    scheme = quant.get(name, residual=0, value_group=D)
    g = torch.Generator().manual_seed(31 + len(name))
    kc, vc, table = written_sequences(scheme, "nhd", block_size, H, D, lens, g, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), H * G, D, generator=g).half().to(device)
    plan = DecodePlan(table, seq_lens, layout="nhd", k_cache=kc, v_cache=vc, num_q_heads=H * G, q_dtype=q.dtype,
                      quant=scheme)
    assert plan.config["kernel"] == ("generic" if is_interpreted() else kernel)
    out = plan.run(q, kc, vc, out=torch.full_like(q, float("nan")))
    kd, vd = (dequantize_cache_ref(scheme, c, "nhd", kind, D) for c, kind in ((kc, "k"), (vc, "v")))
    ref, _ = cascade_decode_ref(q, kd.nan_to_num(), vd.nan_to_num(), "nhd", table, seq_lens, [], [0] * len(lens),
                                block_size)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.to(out.device)) < BOUND[torch.float16]
