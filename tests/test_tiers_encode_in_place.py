"""A cast device's demotion reads its blocks once (issue 34): ``formats.encode`` under a cast device that writes with
the kernels has the format's write kernels read the staged device blocks where they lie, NaN/Inf zeroed and counted
as they are loaded (``write_kv_blocks``), where the general path copies the values out (``read_values``:
``dequantize_blocks``) and writes from the copy. Compared byte for byte with that composition, spelled out, on
random data with NaN/Inf, tiny and huge rows (the kernels' rare paths), in every layout, for fp16 / bf16 / fp32
devices and each format whose scales are computed on write; outputs poisoned, so a byte no one writes shows.
``write_kv_blocks``'s bad arguments are refused naming them, before anything is written."""

import pytest
import torch
from workbench.kernels.write import write_kv, write_kv_blocks

import workbench
from workbench import quant
from workbench.cache import PagedKVCache
from workbench.core.layout import block_view
from workbench.quant import blocks as qblocks
from workbench.tiers import formats

pytestmark = [pytest.mark.kernels,  # the write kernels (interpreted here, compiled on a GPU)
              # ranges that overflow on purpose (the rare paths): numpy's warnings under the interpreter, both paths
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

DEV = workbench.device()
L, H, D = 2, 2, 64  # int2 rows of 16 bytes: the smallest the kernels take
HOSTS = ["fp8_e4m3/token", "fp8_e5m2/token", "int8/token", "int8_asym/token", "int4/token", "int4/kivi",
         "int2/token", "int2/kivi"]
POISONS = (0xAB, 0x54)  # two: a byte no one writes differs from the reference under one of them at least


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


def _cache(kv_dtype, layout, bs, heads=H, head_dim=D):
    return PagedKVCache(L, heads, head_dim, num_pages=4, page_tokens=bs, layout=layout, kv_dtype=kv_dtype,
                        ops="kernels")


def _random_staged(cache, bs, n, seed):
    """``n`` staged device blocks of random values (never 0) with runs of a magnitude each, from tiny to huge, and
    block 0's layer-0 K all tiny (the write kernels' rare paths: subnormal fp16 group scales, KIVI's key groups
    included, tiny fp32 scales, bf16 / fp32 ranges that overflow); then NaN, +Inf and -Inf scattered (some in that
    tiny plane) and one run of NaN (an unwritten slot's poison)."""
    g = torch.Generator().manual_seed(seed)
    dtype = cache.dtype
    row = formats.row_bytes(cache, formats.DEVICE, bs) // dtype.itemsize  # elements
    x = torch.randn(n, L, 2, row, generator=g, dtype=torch.float64)
    tiny, *mags = {torch.float16: [1e-6, 1e-3, 1.0, 30.0, 2e4], torch.bfloat16: [1e-30, 1e-3, 1.0, 1e4, 1e38],
                   torch.float32: [1e-30, 1e-3, 1.0, 1e4, 1e38]}[dtype]
    runs = x.view(-1)[:x.numel() // 32 * 32].view(-1, 32)  # runs of 32 values (half a row in NHD)
    runs *= torch.tensor(mags, dtype=torch.float64)[torch.randint(len(mags), (runs.shape[0], 1), generator=g)]
    x[0, 0, 0] = torch.randn(row, generator=g, dtype=torch.float64) * tiny
    x = x.to(dtype)
    x[x == 0] = tiny  # what rounded to 0: never a zero, so no row is all zeros by chance
    for bad in (float("nan"), float("inf"), float("-inf")):
        x.view(-1)[torch.randint(x.numel(), (max(1, x.numel() // 300),), generator=g)] = bad
        x[0, 0, 0, torch.randint(row, (3,), generator=g)] = bad
    start = int(torch.randint(x.numel() - 200, (1,), generator=g))
    x.view(-1)[start:start + 200] = float("nan")
    assert not (x == 0).any()
    return x.view(torch.uint8).reshape(n, -1).contiguous().to(DEV)


def _encode_by_copy(cache, fmt, bs, staged):
    """The general path spelled out: the values copied out by ``dequantize_blocks`` (NaN/Inf as 0, counted), then
    ``write_kv`` of the format over that copy into a zeroed batch (every layer's rows one set of blocks)."""
    n, row = staged.shape[0], formats.row_bytes(cache, fmt, bs)
    h, d = cache.num_kv_heads, cache.head_dim
    counted = torch.zeros(1, dtype=torch.int32, device=DEV)
    k, v = formats.read_values(cache, formats.DEVICE, bs, staged, counted)
    out = torch.zeros(n, L * 2 * row, dtype=torch.uint8, device=DEV)
    s = fmt.scheme
    planes = [block_view(out.view(n * L, 2, row)[:, kind].view(s.format.storage), "nhd", "kv"[kind], bs, h,
                         s.code_dim(d)) for kind in (0, 1)]
    seen = torch.zeros(1, dtype=torch.int32, device=DEV)
    write_kv(k.reshape(-1, h, d), v.reshape(-1, h, d), *planes, "nhd", torch.arange(n * L * bs, device=DEV),
             quant=s, nonfinite=seen, validate=False)  # as the cache's ops write it
    assert int(seen) == 0  # the copy holds no NaN/Inf
    return out, int(counted)


def _encode_poisoned(cache, fmt, bs, staged, poison, monkeypatch):
    """``formats.encode`` with every new uint8 buffer poisoned, and no read half allowed."""
    real_empty = torch.empty

    def poisoned_empty(*a, **kw):
        t = real_empty(*a, **kw)
        return t.fill_(poison) if t.dtype == torch.uint8 else t

    counted = torch.zeros(1, dtype=torch.int32, device=DEV)
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", poisoned_empty)
        m.setattr(formats, "read_values", lambda *a, **kw: pytest.fail("read_values on the in-place encode"))
        out = formats.encode(cache, fmt, bs, staged, counted)
    return out, int(counted)


def _check_in_place(cache, host, bs, n, seed, monkeypatch):
    fmt = formats.tier_format(cache, host)
    assert formats.encodes_in_place(cache, fmt)
    staged = _random_staged(cache, bs, n, seed)
    before = staged.clone()
    want, want_bad = _encode_by_copy(cache, fmt, bs, staged)
    assert want_bad > 0
    for poison in POISONS:
        got, bad = _encode_poisoned(cache, fmt, bs, staged, poison, monkeypatch)
        diff = (got != want).nonzero()[:4].tolist()
        assert torch.equal(got, want), f"{host} {cache.layout} {cache.dtype} bs={bs} poison {poison:#x}: {diff}"
        assert bad == want_bad
    assert torch.equal(staged, before)  # the device blocks are only read


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["nhd", "hnd", "vllm"])
def test_the_in_place_encode_is_the_copy_then_the_write_byte_for_byte(layout, kv_dtype, host, monkeypatch):
    cache = _cache(kv_dtype, layout, 32)
    _check_in_place(cache, host, 32, 3, sum(map(ord, layout + kv_dtype + host)), monkeypatch)


@pytest.mark.parametrize("kv_dtype, layout, host, bs", [
    ("fp16", "nhd", "int8/token", 16), ("bf16", "vllm", "int4/token", 16), ("fp16", "hnd", "fp8_e4m3/token", 16),
    ("fp32", "vllm", "int8_asym/token", 32), ("fp32", "nhd", "int4/kivi", 32),  # vLLM's key in groups of 4
    ("fp32", "hnd", "int2/token", 16)])
def test_the_in_place_encode_at_other_block_sizes_and_an_fp32_device(kv_dtype, layout, host, bs, monkeypatch):
    _check_in_place(_cache(kv_dtype, layout, bs), host, bs, 2, bs + len(host), monkeypatch)


@pytest.mark.parametrize("host", ["int8/token", "fp8_e4m3/token", "int8_asym/token"])
def test_the_in_place_encode_zeroes_a_rows_padding(host, monkeypatch):
    """18 dims, 4-token blocks: 72 bytes of codes, scales from 80: the bytes between are padding no kernel writes,
    zeros as in the general path's zeroed buffer (the poison would show otherwise)."""
    cache = _cache("fp16", "nhd", 4, heads=1, head_dim=18)
    fmt = formats.tier_format(cache, host)
    assert formats._unwritten(cache, fmt, 4)  # the shape has padding
    staged = _random_staged(cache, 4, 3, 7)
    want, want_bad = _encode_by_copy(cache, fmt, 4, staged)
    for poison in POISONS:
        got, bad = _encode_poisoned(cache, fmt, 4, staged, poison, monkeypatch)
        assert torch.equal(got, want), (got != want).nonzero()[:4].tolist()
        assert bad == want_bad > 0


# ---- bad arguments ------------------------------------------------------------------------------------------------
def test_write_kv_blocks_refuses_bad_arguments_naming_them_before_writing():
    s = quant.get("int8/token")
    nb, bs = 2, 16
    src = torch.randn(nb, bs, H, D, device=DEV).half()
    src[0, 0, 0, 0] = float("nan")
    caches = [qblocks.empty_cache(s, "nhd", kind, nb, bs, H, D, DEV, fill=0xAB) for kind in "kv"]
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    other = qblocks.empty_cache(s, "nhd", "k", nb + 1, bs, H, D, DEV, fill=0xAB)
    cases = [
        (dict(k_src=src.int()), "^k_src must be float32, float16 or bfloat16"),
        (dict(v_src=src[:, :, :1]), r"^v_src must have k_src's \(blocks, block size, heads, head_dim\)"),
        (dict(v_src=src.bfloat16()), "^v_src must have k_src's dtype"),
        (dict(k_src=src[0]), "^k_src must be a 4-D nhd block view"),
        (dict(src_layout="nchw"), "^src_layout must be one of nhd, hnd, vllm"),
        (dict(layout="nchw"), "^layout must be one of"),
        (dict(quant="fp8_e4m3/tensor"), "^quant fp8_e4m3/tensor stores"),
        (dict(quant="int8/head"), "^quant must be a scheme whose scales are computed on write"),
        (dict(k_cache=other), "^v_cache must have k_cache's blocks"),
        (dict(k_cache=other, v_cache=other), "^k_cache must hold the sources' 2 blocks of 16 tokens, got 3"),
        (dict(k_cache=caches[0][:, :, :, :32]), "^k_src has 2 heads x 64 dims but k_cache holds 2 x 32"),
        (dict(nonfinite=counter.float()), "^nonfinite must be an int32 tensor"),
        (dict(k_cache="k"), "^k_cache must be a tensor"),
    ]
    if DEV.type == "cuda":
        cases.append((dict(k_src=src.cpu(), v_src=src.cpu()), "^k_src must be on the cache's device"))
    base = dict(k_src=src, v_src=src, src_layout="nhd", k_cache=caches[0], v_cache=caches[1], layout="nhd",
                quant=s, nonfinite=counter)
    for kw, match in cases:
        args = {**base, **kw}
        with pytest.raises(ValueError, match=match):
            write_kv_blocks(args.pop("k_src"), args.pop("v_src"), args.pop("src_layout"), args.pop("k_cache"),
                            args.pop("v_cache"), args.pop("layout"), **args)
        assert int(counter) == 0, kw
        assert all(bool((qblocks.plane_of(c).view(torch.uint8) == 0xAB).all()) for c in caches), kw
    write_kv_blocks(src, src, "nhd", caches[0], caches[1], "nhd", quant=s, nonfinite=counter)
    assert int(counter) == 2  # K's and V's NaN


def test_encode_refuses_a_bad_counter_naming_it():
    cache = _cache("fp16", "nhd", 32)
    fmt = formats.tier_format(cache, "int4/token")
    staged = _random_staged(cache, 32, 1, 3)
    for bad in (torch.zeros(1), torch.zeros(2, dtype=torch.int32), 0):
        with pytest.raises(ValueError, match="^nonfinite must be an int32 tensor of one element"):
            formats.encode(cache, fmt, 32, staged, bad)
