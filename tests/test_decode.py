"""Paged decode attention against its float64 reference: layouts, page sizes, GQA, splits, padding, fp8."""

import pytest
import torch
from conftest import dtype_id, poison_like
from workbench.kernels import decode_config, paged_decode
from workbench.kernels.decode.reference import paged_decode_ref

from workbench.conformance.pairwise import pairwise
from workbench.core.layout import from_nhd

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def padded(cache: torch.Tensor, pad: int) -> torch.Tensor:
    """The same values in a view whose block stride is ``pad`` elements larger than a block; padding is NaN."""
    if pad == 0:
        return cache
    nb, per = cache.shape[0], cache[0].numel()
    store = torch.full((nb * (per + pad),), float("nan"), dtype=torch.float32).to(cache.dtype).to(cache.device)
    view = store.as_strided(cache.shape, (per + pad, *cache.stride()[1:]))
    view.copy_(cache)
    return view


def make_case(layout, block_size, heads_kv, group, head_dim, dtype, seq_lens, device, seed, pad=0, kv_dtype=None):
    """Random q, random fragmented K/V caches in ``layout`` and a block table for ``seq_lens``."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(seq_lens), max(per_seq) + 2), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    caches = []
    for kind in ("k", "v"):
        nhd = torch.randn(num_blocks, block_size, heads_kv, head_dim, generator=g).to(kv_dtype)
        caches.append(padded(from_nhd(nhd, layout, kind).to(device), pad))
    q = torch.randn(len(seq_lens), heads_kv * group, head_dim, generator=g).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, caches[0], caches[1], table.to(device), lens


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm())


LENS = [37, 0, 1, 150]  # ragged, one empty, one token, none a multiple of the page sizes below (except 1)

CASES = [
    # layout, block_size, heads_kv, group, head_dim, dtype, num_splits, use_dot, pad, BLOCK_N (None: heuristic)
    ("nhd", 16, 2, 4, 64, torch.float16, None, True, 0, None),
    ("hnd", 8, 3, 1, 128, torch.float32, 1, False, 0, None),
    ("vllm", 32, 1, 8, 80, torch.bfloat16, 3, True, 0, 64),  # a tile spans two pages
    ("nhd", 1, 1, 4, 80, torch.float32, 2, True, 64, None),
    ("vllm", 64, 2, 1, 128, torch.float16, 1, False, 64, None),
    ("hnd", 128, 1, 8, 64, torch.bfloat16, 16, True, 0, 128),  # more splits than tiles
    ("nhd", 24, 2, 4, 64, torch.float16, 2, True, 3, None),  # page neither divides nor is divided by BLOCK_N
    ("vllm", 8, 2, 4, 64, torch.float32, 5, False, 3, None),  # misaligned block stride
    ("hnd", 16, 2, 1, 80, torch.bfloat16, 2, True, 0, None),  # MHA through tensor cores
    ("nhd", 64, 1, 4, 128, torch.bfloat16, 1, False, 0, None),
    ("vllm", 16, 1, 4, 128, torch.float16, 4, True, 64, None),
]


@pytest.mark.parametrize("layout,block_size,hkv,group,head_dim,dtype,num_splits,use_dot,pad,block_n", CASES)
def test_decode_matches_reference(layout, block_size, hkv, group, head_dim, dtype, num_splits, use_dot, pad, block_n,
                                  device):
    q, k, v, table, lens = make_case(layout, block_size, hkv, group, head_dim, dtype, LENS, device, seed=block_size,
                                     pad=pad)
    ref = paged_decode_ref(q, k, v, layout, table, lens)
    out = poison_like(q)
    launch = {"BLOCK_N": block_n} if block_n else {}
    got = paged_decode(q, k, v, layout, table, lens, num_splits=num_splits, out=out, use_dot=use_dot, **launch)
    assert got is out
    err = rel_err(got, ref)
    print(f"{layout} bs={block_size} G={group} D={head_dim} {dtype} splits={num_splits} dot={use_dot} "
          f"pad={pad} BLOCK_N={block_n}: rel_err {err:.2e}")
    assert err < TOL[dtype], f"rel_err {err:.3e}"
    assert torch.equal(got[1].float(), torch.zeros_like(got[1].float())), "an empty sequence must give zeros"


VLLM_LENS = [64, 37, 0, 129]  # whole 32-token tiles (no tail) and odd tails; one empty

VLLM_CASES = [
    # block_size, head_dim, dtype, num_splits, pad, BLOCK_N, k3d
    (1, 64, torch.float16, 2, 0, None, True),  # one token per page: every row from another block
    (8, 80, torch.bfloat16, 1, 8, None, True),  # 16-byte aligned block stride; head_dim not a power of two
    (16, 128, torch.float16, 3, 64, None, True),
    (64, 64, torch.float32, 2, 3, 16, True),  # misaligned block stride; tiles inside a page; x = 4
    (16, 80, torch.float16, 1, 0, 64, False),  # 2-D key tiles
    (8, 128, torch.bfloat16, 2, 1, None, False),
    (64, 128, torch.bfloat16, 1, 0, None, True),
    (16, 128, torch.float16, 2, 8, 64, True),  # four pages per tile
    (24, 64, torch.float16, 2, 0, None, True),  # page neither divides nor is divided by BLOCK_N: 2-D key tiles
]


@pytest.mark.parametrize("block_size,head_dim,dtype,num_splits,pad,block_n,k3d", VLLM_CASES)
def test_decode_vllm_split_key(block_size, head_dim, dtype, num_splits, pad, block_n, k3d, device):
    """The vLLM split layout: key tiles read as [D // x, pages, run * x] (k3d) or [BLOCK_N, D]; whole tiles
    unmasked, the partial last tile masked."""
    q, k, v, table, lens = make_case("vllm", block_size, 2, 4, head_dim, dtype, VLLM_LENS, device,
                                     seed=block_size + head_dim, pad=pad)
    ref = paged_decode_ref(q, k, v, "vllm", table, lens)
    launch = {"BLOCK_N": block_n} if block_n else {}
    got = paged_decode(q, k, v, "vllm", table, lens, num_splits=num_splits, out=poison_like(q), k3d=k3d, **launch)
    err = rel_err(got, ref)
    print(f"vllm bs={block_size} D={head_dim} {dtype} splits={num_splits} pad={pad} BLOCK_N={block_n} k3d={k3d}: "
          f"rel_err {err:.2e}")
    assert err < TOL[dtype], f"rel_err {err:.3e}"
    assert torch.equal(got[2].float(), torch.zeros_like(got[2].float())), "an empty sequence must give zeros"


# layout x query dtype x scales as floats or one-element tensors: each pair once (tests/pairwise.py), 4 cases not 8
FP8_CASES = pairwise({"layout": ["nhd", "vllm"], "dtype": [torch.float16, torch.float32],
                      "scale_as": ["float", "tensor"]})


@pytest.mark.parametrize("layout,dtype,scale_as", [pytest.param(*c.values(), id=f"{c['layout']}-{dtype_id(c['dtype'])}-"
                                                                 f"{c['scale_as']}") for c in FP8_CASES])
def test_decode_fp8(layout, dtype, scale_as, device):
    """fp8 caches with per-tensor scales, as floats or as one-element tensors."""
    q, k, v, table, lens = make_case(layout, 16, 2, 4, 64, dtype, [33, 70, 5], device, seed=7,
                                     kv_dtype=torch.float8_e4m3fn)
    ks, vs = 0.37, 2.5
    ref = paged_decode_ref(q, k, v, layout, table, lens, k_scale=ks, v_scale=vs)
    k_scale, v_scale = (ks, vs) if scale_as == "float" else (torch.tensor([ks], device=device),
                                                              torch.tensor([vs], device=device))
    got = paged_decode(q, k, v, layout, table, lens, k_scale=k_scale, v_scale=v_scale, num_splits=2, out=poison_like(q))
    err = rel_err(got, ref)
    print(f"fp8 {layout} q={dtype} scale as {type(k_scale).__name__}: rel_err {err:.2e}")
    assert err < 1e-2


def test_decode_no_sync_path_and_sm_scale(device):
    """max_seq_len given (no host read of seq_lens) and an explicit sm_scale."""
    q, k, v, table, lens = make_case("nhd", 16, 2, 4, 64, torch.float32, [40, 9], device, seed=3)
    ref = paged_decode_ref(q, k, v, "nhd", table, lens, sm_scale=0.3)
    got = paged_decode(q, k, v, "nhd", table, lens, sm_scale=0.3, max_seq_len=40, num_splits=2)
    assert rel_err(got, ref) < 1e-4


def test_decode_config_shapes():
    """The GPU heuristic splits long contexts and small batches, not big batches of short ones."""
    for cfg in (decode_config(8, 8, 4, 128, 16, 32768, num_sms=132), decode_config(1, 1, 1, 64, 1, 1)):
        assert set(cfg) == {"BLOCK_N", "num_splits", "num_warps", "num_stages", "use_dot"}
    assert decode_config(8, 8, 4, 128, 16, 32768, num_sms=132)["num_splits"] > 1
    assert decode_config(256, 8, 4, 128, 16, 512, num_sms=132)["num_splits"] == 1
    assert decode_config(8, 8, 4, 128, 16, 8192, mean_seq_len=3000, num_sms=132)["num_splits"] > \
        decode_config(8, 8, 4, 128, 16, 8192, num_sms=132)["num_splits"]  # ragged: smaller chunks
    # the vLLM layout's large pages take 128-byte value pieces (64-token tiles at fp16); others keep 32
    w1 = (64, 8, 4, 128)
    assert decode_config(*w1, 128, 4096, num_sms=132, layout="vllm")["BLOCK_N"] == 64
    assert decode_config(*w1, 32, 4096, num_sms=132, layout="vllm")["BLOCK_N"] == 32
    assert decode_config(*w1, 128, 4096, num_sms=132, layout="nhd")["BLOCK_N"] == 32


def test_decode_rejects_bad_input(device):
    q, k, v, table, lens = make_case("nhd", 4, 2, 2, 16, torch.float16, [5, 3], device, seed=0)
    cases = [
        ("q", dict(q=q.to(torch.int32))),
        ("q heads", dict(q=q[:, :3])),
        ("head_dim", dict(q=q[:, :, :8])),
        ("block_table", dict(table=table.long())),
        ("seq_lens", dict(lens=torch.tensor([99, 1], dtype=torch.int32, device=device))),
        ("seq_lens", dict(lens=lens[:1])),
        ("layout", dict(layout="nope")),
        ("k_cache", dict(v=v.float())),
        ("v_cache", dict(v=v[:, :, :1])),
        ("out", dict(out=torch.empty(1, device=device))),
        ("num_splits", dict(num_splits=0)),
        ("k_scale", dict(k_scale=torch.ones(2, device=device))),
        ("launch", dict(BLOCK=16)),
        ("BLOCK_N", dict(BLOCK_N=24)),
    ]
    for what, change in cases:
        args = dict(q=q, k=k, v=v, layout="nhd", table=table, lens=lens)
        kwargs = {key: change.pop(key) for key in list(change) if key not in args}
        args.update(change)
        with pytest.raises(ValueError, match=what):
            paged_decode(args["q"], args["k"], args["v"], args["layout"], args["table"], args["lens"], **kwargs)
