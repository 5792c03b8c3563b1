"""write_kv and copy_blocks against their PyTorch references, on padded pool views in every layout.

The pool is the cache's one buffer ``[layers, 2, blocks, block_stride]`` filled with random bytes
(poison); a kernel may change only the bytes it is asked to, never the 128-byte padding of a block.
"""

import math

import pytest
import torch
from conftest import assert_close_report, dtype_id, kw_id
from workbench.kernels import copy_blocks, write_kv
from workbench.kernels import write as write_mod
from workbench.kernels.copy.kernel import _word_view
from workbench.kernels.copy.reference import copy_blocks_ref
from workbench.kernels.write import WriteConfig, default_launch, launch_config, quant_mode
from workbench.kernels.write.reference import quant_code_distance, quantize_rcp_ref, quantize_ref, write_kv_ref

from workbench.bench.cache_kernels import block_stride, layer_views, make_pool
from workbench.conformance.pairwise import cover
from workbench.core.layout import Layout, block_shape, to_nhd

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

FP8 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# values that sit exactly between two codes of some storage format (times a power-of-two scale)
MIDPOINTS = [1.0625, 1.9375, -1.9375, 1.125, 1.875, 2.5, -0.5, 0.5, 3.5, -3.5]


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def prefill_slots(lens, block_size, num_blocks, pad, g):
    """Sequences of ``lens`` tokens on randomly permuted pages, ``pad`` padding tokens (-1) after each."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    out = []
    for n in lens:
        pages = [perm.pop() for _ in range(-(-n // block_size))]
        out += [pages[p // block_size] * block_size + p % block_size for p in range(n)] + [-1] * pad
    return torch.tensor(out)


def decode_slots(n, block_size, num_blocks, g):
    """``n`` tokens at random distinct slots, every fourth one a padding token."""
    s = torch.randperm(num_blocks * block_size, generator=g)[:n]
    s[::4] = -1
    return s


def has_run(slots, bt):
    """Does some program see ``bt`` valid consecutive slots starting at a multiple of ``bt``?"""
    for i in range(0, len(slots) - bt + 1, bt):
        chunk = slots[i : i + bt]
        if chunk[0] >= 0 and chunk[0] % bt == 0 and torch.equal(chunk, chunk[0] + torch.arange(bt)):
            return True
    return False


def assert_codes_match(got, ref, q, what):
    """Quantized codes equal, or one code apart where ``q`` (x / scale) is an exact midpoint of the two."""
    d = quant_code_distance(got, ref)
    gf, rf, qd = got.double(), ref.double(), q.double()
    tie = ((qd - gf).abs() - (qd - rf).abs()).abs() <= 1e-6 * qd.abs()
    bad = (d > 1) | ((d == 1) & ~tie)
    if bad.any():
        idx = bad.nonzero()[:8].tolist()
        rows = [f"  at {i}: got {gf[tuple(i)].item()} expected {rf[tuple(i)].item()} (x/scale {qd[tuple(i)].item()})"
                for i in idx]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} codes differ\n" + "\n".join(rows))


# (block_size, heads, head_dim, source dtype, cache dtype, scale: None | "tensor" | "head" | "odd", mode, kwargs)
BASE = [
    (16, 2, 128, torch.float16, torch.float16, None, "prefill", dict(tokens_per_program=8)),
    (1, 3, 80, torch.float32, torch.bfloat16, None, "prefill", {}),  # 480 B blocks padded to 512 B
    (8, 1, 64, torch.bfloat16, torch.float32, None, "decode", {}),
    (32, 2, 64, torch.float16, FP8, "tensor", "prefill", dict(tokens_per_program=16)),
    (16, 3, 80, torch.float32, torch.int8, "head", "decode", dict(tokens_per_program=4)),
    (8, 2, 128, torch.bfloat16, E5M2, "head", "prefill", dict(tokens_per_program=8)),
]
# the "rows" scheme (all heads or head groups, K and V together or split) and the fast quantization math
VARIANTS = [
    (16, 3, 80, torch.float16, torch.float16, None, "prefill", dict(scheme="rows", tokens_per_program=8)),  # 3 of 4
    (16, 2, 64, torch.bfloat16, FP8, "head", "prefill", dict(scheme="rows", kv_split=True, tokens_per_program=16)),
    (8, 3, 64, torch.float32, torch.int8, "odd", "decode",
     dict(scheme="rows", heads_per_program=2, tokens_per_program=2, quant_math="rcp")),  # a partial head group
    (1, 2, 80, torch.float32, torch.bfloat16, None, "prefill", dict(scheme="rows", kv_split=True)),  # default tiles
    (32, 2, 64, torch.float16, E5M2, "odd", "prefill", dict(tokens_per_program=16, quant_math="rcp")),
    (16, 4, 64, torch.float16, FP8, "tensor", "prefill",
     dict(scheme="rows", tokens_per_program=4, heads_per_program=2, quant_math="cast")),
    (8, 2, 128, torch.bfloat16, torch.int8, "head", "decode", dict(tokens_per_program=4, quant_math="cast")),
    # the prefill defaults of PREFILL_DEFAULTS (measured fastest on the H200), forced onto small shapes
    (16, 2, 128, torch.float16, torch.float16, None, "prefill",
     dict(scheme="rows", tokens_per_program=16, heads_per_program=1, num_warps=4)),
    (4, 2, 64, torch.bfloat16, torch.bfloat16, None, "prefill", dict(scheme="rows", heads_per_program=1, num_warps=4)),
]
CONFIGS = BASE + VARIANTS


def _features(layout, block_size, heads, head_dim, src_dtype, kv_dtype, scale_kind, mode, kw) -> dict:
    return {"layout": layout, "block_size": block_size, "heads": heads, "head_dim": head_dim, "src_dtype": src_dtype,
            "kv_dtype": kv_dtype, "scale_kind": scale_kind, "mode": mode, **{f"kw.{k}": v for k, v in kw.items()}}


# Not every configuration in every layout (45 cases): every configuration in at least one layout, and every pair of
# values among all of them (each layout with each block size, head count, head_dim, source and cache dtype, scale kind,
# mode and launch option, as well as the pairs inside the configurations) in some case (tests/pairwise.py): 27 cases.
CASES = [(r["layout"], *CONFIGS[r["config"]]) for r in cover(
    [{**_features(layout, *c), "config": i} for layout in Layout for i, c in enumerate(CONFIGS)], each=["config"])]


def write_case_id(layout, block_size, heads, head_dim, src_dtype, kv_dtype, scale_kind, mode, kw):
    """``nhd-bs16-h2-d128-fp16-fp16-prefill-tpp8`` (``-scale_head`` and the like when there is a scale)."""
    scale = f"-scale_{scale_kind}" if scale_kind else ""
    return (f"{layout}-bs{block_size}-h{heads}-d{head_dim}-{dtype_id(src_dtype)}-{dtype_id(kv_dtype)}{scale}-{mode}"
            f"-{kw_id(kw)}")


@pytest.mark.parametrize("layout,block_size,heads,head_dim,src_dtype,kv_dtype,scale_kind,mode,kw",
                         [pytest.param(*c, id=write_case_id(*c)) for c in CASES])
def test_write_kv_matches_reference(layout, block_size, heads, head_dim, src_dtype, kv_dtype, scale_kind, mode, kw,
                                    device):
    g = torch.Generator().manual_seed(block_size * 31 + head_dim)
    lens = [2 * block_size + 3, 7, block_size]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    if mode == "prefill":
        slots = prefill_slots(lens, block_size, num_blocks, pad=2, g=g)
    else:
        slots = decode_slots(13, block_size, num_blocks, g)
    tokens = slots.shape[0]
    quantized = kv_dtype.itemsize == 1
    bt = launch_config(tokens, heads, head_dim, block_size, layout, quantized, **kw).tokens_per_program
    if layout is Layout.VLLM and bt > 1 and block_size % bt == 0 and mode == "prefill":
        assert has_run(slots, bt), "the workload should exercise the run (token-axis) store"
    kv = (2 * torch.randn(tokens, 3, heads, head_dim, generator=g)).to(src_dtype)
    key, value = kv[:, 0], kv[:, 2]  # non-contiguous in T, unit stride in D
    k_scale = v_scale = None
    if scale_kind == "tensor":
        k_scale, v_scale = torch.tensor(2.0**-4), torch.tensor([2.0**-3])
    elif scale_kind == "head":
        k_scale = 2.0 ** -torch.arange(2, 2 + heads, dtype=torch.float32)
        v_scale = k_scale.flip(0).contiguous()
    elif scale_kind == "odd":  # not powers of two: x * (1 / scale) can differ from x / scale in the last bit
        k_scale = 0.3 * (1 + torch.arange(heads, dtype=torch.float32) / 7)
        v_scale = (0.0173 * (1 + torch.arange(heads, dtype=torch.float32) / 5)).flip(0).contiguous()
    if quantized:  # exact midpoints between codes: the kernel must round them as torch does (or one code off)
        valid = (slots >= 0).nonzero()[:, 0].tolist()
        mids = torch.tensor(MIDPOINTS).repeat(head_dim)[:head_dim]
        for h in range(heads):
            s = k_scale.reshape(-1)[h if k_scale.numel() > 1 else 0]
            key[valid[h + 1], h] = (mids * s).to(src_dtype)
        key[valid[0], 0, :4] = torch.tensor([3e4, -3e4, 1e3, -1e3]).to(src_dtype)  # saturation
        k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    key, value, slots = key.to(device), value.to(device), slots.to(device)

    pool0 = make_pool(2, num_blocks, layout, block_size, heads, head_dim, kv_dtype, device, seed=7)
    got, ref = pool0.clone(), pool0.clone()
    write_kv(key, value, *layer_views(got, 1, layout, block_size, heads, head_dim), layout, slots, k_scale, v_scale,
             **kw)
    write_kv_ref(key, value, *layer_views(ref, 1, layout, block_size, heads, head_dim), layout, slots, k_scale,
                 v_scale)
    numel = math.prod(block_shape(layout, "k", block_size, heads, head_dim, kv_dtype.itemsize))
    assert torch.equal(raw(got[..., numel:]), raw(pool0[..., numel:])), "padding bytes were written"
    assert torch.equal(raw(got[0]), raw(pool0[0])), "another layer was written"
    # nothing outside the written rows changed: patch them with the reference rows, then all bytes agree
    patched = got.clone()
    write_kv_ref(key, value, *layer_views(patched, 1, layout, block_size, heads, head_dim), layout, slots, k_scale,
                 v_scale)
    assert torch.equal(raw(patched), raw(ref)), "bytes outside the written slots changed"
    what = f"{layout} bs={block_size} {src_dtype}->{kv_dtype} {kw}"
    if not quantized:  # a cast is bit-exact
        assert_close_report(raw(got), raw(ref), what=what)
        return
    keep = slots >= 0
    blk, off = slots[keep].long() // block_size, slots[keep].long() % block_size
    for kind, src, scale, g_c, r_c in zip(
        "kv", (key, value), (k_scale, v_scale), layer_views(got, 1, layout, block_size, heads, head_dim),
        layer_views(ref, 1, layout, block_size, heads, head_dim), strict=True,
    ):
        s = scale.reshape(()) if scale.numel() == 1 else scale.reshape(1, -1, 1)
        q = src[keep].float() / s
        rows_got = to_nhd(g_c, layout, kind)[blk, off]
        rows_ref = to_nhd(r_c, layout, kind)[blk, off]
        assert_codes_match(rows_got, rows_ref, q, f"{what} {kind}")
        if kw.get("quant_math") == "rcp":  # and exactly the codes of x * (1 / scale)
            assert_close_report(raw(rows_got), raw(quantize_rcp_ref(src[keep], kv_dtype, scale)), what=f"{what} {kind}")


# fp16 values whose x * (1 / 0.3) and x / 0.3 fall on different sides of a code midpoint (found by search)
RCP_SPECIAL = [(FP8, [0.00439453125, -0.00439453125]), (torch.int8, [2.25, 8.25, 17.25])]


@pytest.mark.parametrize("kv_dtype,special", RCP_SPECIAL, ids=[dtype_id(dt) for dt, _ in RCP_SPECIAL])
def test_write_kv_rcp_differs_by_one_code_near_midpoints(kv_dtype, special, device):
    """With scale 0.3, ``x * (1 / scale)`` and ``x / scale`` round to different codes for these fp16 values:
    "rcp" stores the former (one code off torch's division), "exact" and "cast" the latter."""
    heads, head_dim, bs = 1, 16, 4
    key = torch.randn(4, heads, head_dim, generator=torch.Generator().manual_seed(0)).half()
    key[1, 0, : len(special)] = torch.tensor(special).half()
    key = key.to(device)
    slots = torch.tensor([2, 0, -1, 7], device=device)
    scale = torch.tensor([0.3], device=device)
    pool0 = make_pool(1, 2, "nhd", bs, heads, head_dim, kv_dtype, device)
    codes = {}
    for qm in ("exact", "cast", "rcp"):
        pool = pool0.clone()
        kc, vc = layer_views(pool, 0, "nhd", bs, heads, head_dim)
        write_kv(key, key, kc, vc, "nhd", slots, scale, scale, scheme="rows", quant_math=qm)
        codes[qm] = kc[0, 0, 0].clone()  # slot 0 holds token 1
    ref = quantize_rcp_ref(key[1:2], kv_dtype, scale)[0, 0]
    exact = quantize_ref(key[1:2], kv_dtype, scale)[0, 0]
    assert torch.equal(raw(codes["exact"]), raw(exact)) and torch.equal(raw(codes["cast"]), raw(exact))
    assert torch.equal(raw(codes["rcp"]), raw(ref))
    d = quant_code_distance(codes["rcp"], exact)
    assert d[: len(special)].tolist() == [1] * len(special) and int(d[len(special):].max()) == 0
    assert_codes_match(codes["rcp"], exact, key[1, 0].float() / scale, "rcp near midpoints")


def test_assert_codes_match_allows_one_code_only_at_midpoints():
    q = torch.tensor([1.0625, 1.05, 1.0625])  # e4m3 codes around 1: 1.0, 1.125
    ref = torch.tensor([1.0, 1.0, 1.0]).to(FP8)
    assert_codes_match(torch.tensor([1.125, 1.0, 1.0]).to(FP8), ref, q, "tie")  # a tie rounded up: allowed
    with pytest.raises(AssertionError, match="1 of 3"):
        assert_codes_match(torch.tensor([1.0, 1.125, 1.0]).to(FP8), ref, q, "not a tie")
    with pytest.raises(AssertionError, match="1 of 3"):
        assert_codes_match(torch.tensor([1.0, 1.0, 1.25]).to(FP8), ref, q, "two codes")


def test_write_kv_int64_slots_and_empty(device):
    heads, head_dim, bs = 2, 64, 16
    pool = make_pool(1, 4, "nhd", bs, heads, head_dim, torch.float16, device)
    ref = pool.clone()
    key = torch.randn(5, heads, head_dim, device=device).half()
    slots = torch.tensor([3, -1, 17, 63, 0], device=device)  # int64
    write_kv(key, key, *layer_views(pool, 0, "nhd", bs, heads, head_dim), "nhd", slots)
    write_kv_ref(key, key, *layer_views(ref, 0, "nhd", bs, heads, head_dim), "nhd", slots)
    assert torch.equal(raw(pool), raw(ref))
    empty = key[:0]
    write_kv(empty, empty, *layer_views(pool, 0, "nhd", bs, heads, head_dim), "nhd", slots[:0])
    assert torch.equal(raw(pool), raw(ref))


def test_write_kv_rejects_bad_input(device):
    heads, head_dim, bs = 2, 64, 4
    pool = make_pool(1, 4, "hnd", bs, heads, head_dim, torch.float16, device)
    kc, vc = layer_views(pool, 0, "hnd", bs, heads, head_dim)
    qpool = make_pool(1, 4, "hnd", bs, heads, head_dim, FP8, device)
    qk, qv = layer_views(qpool, 0, "hnd", bs, heads, head_dim)
    key = torch.randn(3, heads, head_dim, device=device)
    slots = torch.tensor([0, 5, -1], dtype=torch.int32, device=device)
    one = torch.tensor(0.5, device=device)
    cases = [
        ("k_scale", dict(k_cache=qk, v_cache=qv)),  # quantized cache without a scale
        ("k_scale", dict(k_scale=one, v_scale=one)),  # a scale with an fp16 cache
        ("k_scale", dict(k_cache=qk, v_cache=qv, k_scale=one.double(), v_scale=one)),
        ("k_scale", dict(k_cache=qk, v_cache=qv, k_scale=torch.ones(3, device=device), v_scale=one)),
        ("v_scale", dict(k_cache=qk, v_cache=qv, k_scale=one)),
        ("slot_mapping", dict(slot_mapping=slots.float())),
        ("slot_mapping", dict(slot_mapping=slots[:2])),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, 16, 1], dtype=torch.int32, device=device))),
        ("slot_mapping", dict(slot_mapping=torch.tensor([0, -2, 1], dtype=torch.int32, device=device))),
        ("key", dict(key=torch.randn(3, heads + 1, head_dim, device=device),
                     value=torch.randn(3, heads + 1, head_dim, device=device))),
        ("key", dict(key=torch.randn(3, head_dim, heads, device=device).transpose(1, 2))),
        ("key", dict(key=key.to(torch.int32))),
        ("value", dict(value=key[:2])),
        ("v_cache", dict(v_cache=vc.float())),
        ("layout", dict(layout="nope")),
        ("tokens_per_program", dict(tokens_per_program=3)),
        ("num_warps", dict(num_warps=3)),
        ("tokens_per_program", dict(scheme="rows", tokens_per_program=0)),
        ("scheme", dict(scheme="tile")),
        ("quant_math", dict(k_cache=qk, v_cache=qv, k_scale=one, v_scale=one, quant_math="fast")),
        ("heads_per_program", dict(scheme="rows", heads_per_program=3)),
        ("kv_split", dict(kv_split=True)),  # the head scheme does K and V in one program
        ("heads_per_program", dict(heads_per_program=2)),
    ]
    base = dict(key=key, value=key, k_cache=kc, v_cache=vc, layout="hnd", slot_mapping=slots)
    for name, change in cases:
        with pytest.raises(ValueError, match=name):
            write_kv(**{**base, **change})


def test_write_kv_plan_cache_keeps_validation(device, monkeypatch):
    """A repeated geometry reuses its launch plan, yet any change of shape, dtype or stride is validated again;
    with validate=False the call does no device work of its own (no aminmax, no sync)."""
    heads, head_dim, bs = 2, 16, 4
    pool = make_pool(1, 4, "nhd", bs, heads, head_dim, torch.float16, device)
    ref = pool.clone()
    kc, vc = layer_views(pool, 0, "nhd", bs, heads, head_dim)
    key = torch.randn(6, heads, head_dim, device=device).half()
    slots = torch.tensor([0, 1, 2, 3, -1, 9], device=device)
    write_kv(key, key, kc, vc, "nhd", slots, scheme="rows")
    n = len(write_mod._PLANS)
    key2 = torch.randn(6, heads, head_dim, device=device).half()
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: pytest.fail("validate=False must not inspect slots"))
    write_kv(key2, key2, kc, vc, "nhd", slots, scheme="rows", validate=False)  # same geometry: the cached plan
    assert len(write_mod._PLANS) == n
    write_kv_ref(key2, key2, *layer_views(ref, 0, "nhd", bs, heads, head_dim), "nhd", slots)
    assert torch.equal(raw(pool), raw(ref))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="key"):
        write_kv(key.float().double(), key, kc, vc, "nhd", slots, scheme="rows")
    with pytest.raises(ValueError, match="v_cache"):
        write_kv(key, key, kc, vc[:3], "nhd", slots, scheme="rows")
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(key, key, kc, vc, "nhd", torch.tensor([0, 1, 2, 3, -1, 16], device=device), scheme="rows")


def test_launch_config_table_and_heuristics(monkeypatch):
    prefill = (32768, 8, 128, 16)
    assert launch_config(*prefill, "nhd") == WriteConfig("rows", 16, 4, 1, False, "exact")  # the H200's pick
    qm = write_mod._QUANT_MATH  # "exact" under the interpreter, "cast" compiled: both match torch's codes
    assert launch_config(*prefill, "vllm", True) == WriteConfig("head", 16, 4, 1, False, qm)
    assert launch_config(*prefill, "nhd", scheme="rows") == WriteConfig("rows", 16, 4, 1, False, "exact")
    assert launch_config(*prefill, "nhd", True, scheme="rows") == WriteConfig("rows", 8, 4, 8, False, qm)
    assert launch_config(*prefill, "hnd", scheme="rows", kv_split=True).kv_split
    assert launch_config(32768, 3, 80, 16, "nhd", True, scheme="rows").heads_per_program == 4  # all 3 heads, masked
    assert launch_config(*prefill, "nhd", True, scheme="rows", heads_per_program=64).heads_per_program == 8
    assert launch_config(32768, 8, 128, 4, "vllm", scheme="rows", heads_per_program=1).tokens_per_program == 4
    assert launch_config(64, 8, 128, 16, "nhd", scheme="rows").tokens_per_program == 1  # decode: many programs
    # one line of the table switches the prefill default; decode-sized batches keep the head scheme
    monkeypatch.setitem(write_mod.PREFILL_DEFAULTS, (Layout.NHD, False), dict(scheme="rows", num_warps=8))
    assert launch_config(*prefill, "nhd") == WriteConfig("rows", 8, 8, 8, False, "exact")
    assert launch_config(*prefill, "nhd", scheme="head").scheme == "head"  # a keyword beats the table
    assert launch_config(64, 8, 128, 16, "nhd").scheme == "head"
    assert launch_config(*prefill, "hnd").scheme == "rows"
    assert launch_config(*prefill, "hnd", True).scheme == "head"  # quantized caches keep the head scheme


def test_default_launch_and_quant_mode():
    assert default_launch(32768, 8, 128, 16, "nhd") == (16, 4)
    assert default_launch(64, 8, 128, 16, "nhd") == (1, 1)
    assert default_launch(32768, 8, 128, 8, "vllm")[0] == 8  # a run must fit a block
    assert default_launch(32768, 8, 128, 1, "vllm")[0] == 16  # bs 1: d is contiguous anyway
    assert quant_mode(FP8) == (1, -448.0, 448.0)
    assert quant_mode(torch.int8) == (2, -128.0, 127.0)
    assert quant_mode(torch.bfloat16)[0] == 0


# (layout, block_size, heads, head_dim, dtype, launch kwargs)
COPY_CASES = [
    ("nhd", 16, 2, 64, torch.float16, {}),
    ("hnd", 1, 3, 80, torch.float16, {}),  # 480 B blocks padded to 512 B
    ("vllm", 8, 1, 64, FP8, {"rows_per_program": 2, "step_bytes": 128, "num_warps": 1}),  # several steps a block
    ("nhd", 1, 1, 80, torch.float32, {"step_bytes": 256}),  # 320 B -> 384 B: a masked tail step
    ("hnd", 4, 2, 64, torch.bfloat16, {"rows_per_program": 4}),  # more rows per program than rows
]


@pytest.mark.parametrize("layout,block_size,heads,head_dim,dtype,kw", [
    pytest.param(*c, id=f"{c[0]}-bs{c[1]}-h{c[2]}-d{c[3]}-{dtype_id(c[4])}-{kw_id(c[5])}") for c in COPY_CASES])
def test_copy_blocks_matches_reference(layout, block_size, heads, head_dim, dtype, kw, device):
    num_blocks = 20
    pool0 = make_pool(3, num_blocks, layout, block_size, heads, head_dim, dtype, device, seed=block_size)
    assert pool0.shape[3] == block_stride(layout, block_size, heads, head_dim, dtype)
    assert _word_view(pool0).dtype == torch.int64  # 128-byte blocks: 8-byte words
    g = torch.Generator().manual_seed(head_dim)
    perm = torch.randperm(num_blocks, generator=g)
    src = torch.cat([perm[:5], perm[:1]])  # block perm[0] forked twice
    dst = perm[5:11]
    for ids_dtype in (torch.int32, torch.int64):
        got, ref = pool0.clone(), pool0.clone()
        s, d = src.to(ids_dtype).to(device), dst.to(ids_dtype).to(device)
        copy_blocks(got, s, d, **kw)
        copy_blocks_ref(ref, s, d)
        assert not torch.equal(raw(ref), raw(pool0))
        assert_close_report(raw(got), raw(ref), what=f"copy {layout} {dtype} {kw}")


def test_copy_blocks_views_and_odd_geometry(device):
    big = make_pool(4, 24, "nhd", 16, 2, 64, torch.float16, device)
    pool0 = big[1:3, :, 2:22]  # a view: storage offset, block subset
    src = torch.tensor([0, 7, 19], device=device)
    dst = torch.tensor([3, 12, 1], device=device)
    got, ref = big.clone(), big.clone()
    copy_blocks(got[1:3, :, 2:22], src, dst)
    copy_blocks_ref(ref[1:3, :, 2:22], src, dst)
    assert torch.equal(raw(got), raw(ref)), "a pool view was copied wrongly or bytes outside it changed"
    assert pool0.shape[2] == 20
    odd = torch.randn(2, 2, 5, 3, device=device).half()  # 6-byte blocks: 2-byte words
    assert _word_view(odd).dtype == torch.int16
    got, ref = odd.clone(), odd.clone()
    copy_blocks(got, src[:1], dst[:1] % 5)
    copy_blocks_ref(ref, src[:1], dst[:1] % 5)
    assert torch.equal(raw(got), raw(ref))
    copy_blocks(got, src[:0], dst[:0])  # nothing to copy
    assert torch.equal(raw(got), raw(ref))


def test_copy_blocks_rejects_bad_input(device):
    pool = make_pool(2, 8, "nhd", 4, 1, 16, torch.float16, device)
    ids = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    cases = [
        ("src", dict(src=ids(0, 8), dst=ids(1, 2))),  # out of range
        ("src", dict(src=ids(-1, 0), dst=ids(1, 2))),
        ("src", dict(src=ids(0, 1).float(), dst=ids(2, 3))),
        ("dst", dict(src=ids(0, 1), dst=ids(2))),  # length mismatch
        ("dst", dict(src=ids(0, 1), dst=ids(2, 2))),  # dst twice
        ("dst", dict(src=ids(0, 1), dst=ids(1, 2))),  # dst also a src
        ("pool", dict(pool=pool[0])),
        ("pool", dict(pool=pool.transpose(2, 3))),
        ("rows_per_program", dict(rows_per_program=3)),
    ]
    base = dict(pool=pool, src=ids(0, 1), dst=ids(2, 3))
    for name, change in cases:
        with pytest.raises(ValueError, match=name):
            copy_blocks(**{**base, **change})


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "a GPU nobody measured"])
def test_prefill_table_is_data_and_every_entry_launches(gpu):
    """tuning/write_prefill.json: an unmeasured GPU gets the default GPU's table; every entry is a valid launch."""
    table = write_mod.prefill_defaults(gpu)
    assert {(lay, q) for lay in Layout for q in (False, True)} == set(table)
    for (layout, quantized), cfg in table.items():
        c = write_mod.launch_config(4096, 8, 128, 16, layout, quantized, **cfg)
        assert c.scheme == cfg["scheme"]
