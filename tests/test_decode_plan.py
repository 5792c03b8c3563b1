"""DecodePlan (plan once per step, run per layer), its CSR constructor, and merge_states / merge_state."""

import math

import pytest
import torch
from conftest import poison_like
from test_decode import TOL, make_case, rel_err
from test_kernel_validation import _count_host_reads, _NoLaunch
from workbench.kernels import DecodePlan, merge_state, merge_states, paged_decode
from workbench.kernels.decode import api as decode_mod
from workbench.kernels.decode import kernel as decode_kernels
from workbench.kernels.decode.reference import merge_states_ref, paged_decode_ref
from workbench.kernels.gather.reference import paged_gather_ref

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

LENS = [37, 0, 150, 1]  # ragged (a partial last tile at 37 and 150), one empty, one token; under the interpreter
# each sequence costs its programs (heads x splits), so four, not more


def plan_for(q, k, v, layout, table, lens, **kw):
    return DecodePlan(table, lens, layout=layout, k_cache=k, v_cache=v, num_q_heads=q.shape[1], q_dtype=q.dtype, **kw)


def another_layer(cache: torch.Tensor, seed: int) -> torch.Tensor:
    """A cache of the same geometry (shape, strides, dtype) holding other random values."""
    g = torch.Generator().manual_seed(seed)
    other = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=cache.device)
    other.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    return other


CASES = [
    # layout, block_size, hkv, group, head_dim, q dtype, kv dtype, num_splits, BLOCK_N
    pytest.param("nhd", 16, 2, 4, 64, torch.float16, None, 2, None, id="nhd-gqa4-split2-fp16"),
    pytest.param("nhd", 8, 2, 1, 32, torch.bfloat16, None, 1, None, id="nhd-mha-split1-bf16"),
    pytest.param("hnd", 16, 1, 8, 64, torch.bfloat16, None, 3, None, id="hnd-gqa8-split3-bf16"),
    pytest.param("hnd", 32, 2, 2, 64, torch.float16, None, 1, None, id="hnd-gqa2-split1-fp16"),
    pytest.param("vllm", 16, 2, 4, 64, torch.float16, None, 1, None, id="vllm-gqa4-split1-fp16"),
    pytest.param("vllm", 32, 1, 4, 80, torch.bfloat16, None, 2, 64, id="vllm-gqa4-split2-bf16-d80"),
    pytest.param("nhd", 16, 2, 2, 64, torch.float16, torch.float8_e4m3fn, 2, None, id="nhd-gqa2-split2-fp8e4m3"),
    pytest.param("vllm", 16, 2, 4, 64, torch.float16, None, None, None, id="vllm-gqa4-heuristic-fp16"),
]


@pytest.mark.parametrize("layout,block_size,hkv,group,head_dim,dtype,kv_dtype,num_splits,block_n", CASES)
def test_plan_run_matches_reference(layout, block_size, hkv, group, head_dim, dtype, kv_dtype, num_splits, block_n,
                                    device):
    q, k, v, table, lens = make_case(layout, block_size, hkv, group, head_dim, dtype, LENS, device, seed=block_size,
                                     kv_dtype=kv_dtype)
    scales = dict(k_scale=0.5, v_scale=torch.tensor([1.5], device=device)) if kv_dtype else {}
    ref_scales = {key: float(val) for key, val in scales.items()}
    launch = {"BLOCK_N": block_n} if block_n else {}
    plan = plan_for(q, k, v, layout, table, lens, num_splits=num_splits, **scales, **launch)
    if num_splits is not None:
        assert plan.num_splits == num_splits
    out = poison_like(q)
    got = plan.run(q, k, v, out)
    assert got is out
    ref = paged_decode_ref(q, k, v, layout, table, lens, **ref_scales)
    err = rel_err(got, ref)
    print(f"{plan}: rel_err {err:.2e}")
    assert err < (2e-2 if kv_dtype else TOL[dtype]), f"rel_err {err:.3e}"
    assert torch.equal(got[1].float(), torch.zeros_like(got[1].float())), "an empty sequence gives zeros"
    # the one-shot shortcut gives the same bits
    again = paged_decode(q, k, v, layout, table, lens, num_splits=num_splits, out=poison_like(q), **scales, **launch)
    assert torch.equal(again, got)


@pytest.mark.parametrize("layout,num_splits", [pytest.param("nhd", 2, id="nhd-split2"),
                                               pytest.param("vllm", 1, id="vllm-split1"),
                                               pytest.param("hnd", 3, id="hnd-split3")])
def test_one_plan_many_layers(layout, num_splits, device):
    """One plan, several layers: each its own caches (same geometry) and queries; each gives its reference (the
    second layer's output allocated by run, none given)."""
    q0, k0, v0, table, lens = make_case(layout, 8, 2, 4, 32, torch.float16, LENS, device, seed=5, pad=8)
    plan = plan_for(q0, k0, v0, layout, table, lens, num_splits=num_splits)
    g = torch.Generator().manual_seed(9)
    for layer in range(2):
        k, v = another_layer(k0, 10 + layer), another_layer(v0, 20 + layer)
        q = torch.randn(q0.shape, generator=g).to(q0.dtype).to(device)
        got = plan.run(q, k, v, poison_like(q) if layer == 0 else None)
        assert got.shape == q.shape
        ref = paged_decode_ref(q, k, v, layout, table, lens)
        err = rel_err(got, ref)
        assert err < TOL[torch.float16], (layer, err)


def test_run_does_no_host_sync_and_no_allocation(monkeypatch, device):
    """run: no device -> host read and no allocation (out given); planning: one read by default, none with
    max_seq_len and validate=False."""
    q, k, v, table, lens = make_case("nhd", 8, 2, 2, 32, torch.float16, [20, 9, 33], device, seed=1)
    plan_for(q, k, v, "nhd", table, lens, num_splits=2, BLOCK_N=16).run(q, k, v)  # compile outside the counting
    for name in ("_paged_decode_kernel", "_decode_reduce_kernel"):
        monkeypatch.setattr(decode_kernels, name, _NoLaunch())
    count = _count_host_reads(monkeypatch)
    allocs = [0]
    for name in ("empty", "empty_like", "zeros", "full", "empty_strided"):
        orig = getattr(torch, name)

        def wrapped(*a, _orig=orig, **kw):
            allocs[0] += 1
            return _orig(*a, **kw)

        monkeypatch.setattr(torch, name, wrapped)
    for kw, want in ((dict(), 1), (dict(max_seq_len=33), 1), (dict(max_seq_len=33, validate=False), 0)):
        count[0] = 0
        plan = plan_for(q, k, v, "nhd", table, lens, num_splits=2, BLOCK_N=16, **kw)
        assert count[0] == want, (kw, count[0])
        assert plan.num_splits == 2
    out = torch.empty_like(q)
    count[0] = allocs[0] = 0
    for _ in range(4):
        plan.run(q, k, v, out)
    assert count[0] == 0 and allocs[0] == 0, (count[0], allocs[0])
    plan.run(q, k, v)
    assert count[0] == 0 and allocs[0] == 1, "run allocates out alone when not given"


def test_run_refuses_other_geometry(device):
    q, k, v, table, lens = make_case("nhd", 8, 2, 2, 32, torch.float16, [20, 9], device, seed=2)
    plan = plan_for(q, k, v, "nhd", table, lens)
    wider = make_case("nhd", 8, 2, 2, 32, torch.float16, [20, 9], device, seed=2, pad=8)[1]
    cases = [
        ("q", dict(q=q[:1])),
        ("q", dict(q=q.float())),
        ("q", dict(q=torch.zeros(2, 4, 32, 2, dtype=q.dtype, device=device)[..., 0])),  # strided last dim
        ("k_cache", dict(k=k[:-1])),  # fewer blocks
        ("k_cache", dict(k=wider)),  # padded block stride
        ("k_cache", dict(k=k.to(torch.bfloat16))),
        ("v_cache", dict(v=v.tolist())),
        ("v_cache", dict(v=v[:, :4])),
        ("out", dict(out=torch.empty(2, 4, 16, dtype=q.dtype, device=device))),
        ("out", dict(out=q.float())),
    ]
    for what, change in cases:
        a = dict(q=q, k=k, v=v, out=None)
        a.update(change)
        with pytest.raises(ValueError, match=f"^{what} ") as err:
            plan.run(a["q"], a["k"], a["v"], a["out"])
        print(err.value)
    with pytest.raises(AttributeError):
        plan.num_splits = 4


def test_plan_rejects_bad_input(device):
    q, k, v, table, lens = make_case("nhd", 4, 2, 2, 16, torch.float16, [5, 3], device, seed=0)
    base = dict(layout="nhd", k_cache=k, v_cache=v, num_q_heads=4, q_dtype=torch.float16)
    cases = [
        ("q heads", dict(num_q_heads=3)),
        ("num_q_heads", dict(num_q_heads=0)),
        ("q_dtype", dict(q_dtype=torch.int32)),
        ("k_cache", dict(q_dtype=torch.bfloat16)),
        ("block_table", dict(table=table.long())),
        ("seq_lens", dict(lens=torch.tensor([99, 1], dtype=torch.int32, device=device))),
        ("block_table", dict(table=torch.full_like(table, 50))),
        ("layout", dict(layout="nope")),
        ("num_splits", dict(num_splits=0)),
        ("launch", dict(BLOCK=16)),
    ]
    for what, change in cases:
        kw = {**base, **{key: val for key, val in change.items() if key not in ("table", "lens")}}
        with pytest.raises(ValueError, match=what):
            DecodePlan(change.get("table", table), change.get("lens", lens), **kw)


def to_csr(table: torch.Tensor, lens: torch.Tensor, block_size: int, spare: int = 3):
    """FlashInfer's page table for a padded one: indptr, indices (with ``spare`` junk entries past the end, as a
    preallocated buffer has), last_page_len (1..page_size; page_size for an empty sequence)."""
    per_seq = [-(-n // block_size) for n in lens.tolist()]
    indptr = torch.tensor([0, *torch.tensor(per_seq).cumsum(0).tolist()], dtype=torch.int32)
    pages = [table[b, :n].cpu() for b, n in enumerate(per_seq)]
    indices = torch.cat([*pages, torch.full((spare,), -5, dtype=torch.int32)]).to(torch.int32)
    last = torch.tensor([(n - 1) % block_size + 1 for n in lens.tolist()], dtype=torch.int32)
    dev = table.device
    return indptr.to(dev), indices.to(dev), last.to(dev)


@pytest.mark.parametrize("layout", ["nhd", "vllm"])
def test_csr_equals_padded_table(monkeypatch, layout, device):
    q, k, v, table, lens = make_case(layout, 16, 1, 4, 32, torch.float16, LENS, device, seed=4)  # one kv head: tables
    indptr, indices, last = to_csr(table, lens, 16)
    padded = plan_for(q, k, v, layout, table, lens, num_splits=2)
    want = padded.run(q, k, v, poison_like(q))
    kw = dict(layout=layout, k_cache=k, v_cache=v, num_q_heads=q.shape[1], q_dtype=q.dtype, num_splits=2)
    for extra in (dict(), dict(max_seq_len=max(LENS), validate=False)):
        plan = DecodePlan.from_csr(indptr, indices, last, **kw, **extra)
        assert torch.equal(plan.seq_lens, lens)
        for b, n in enumerate(LENS):
            used = -(-n // 16)
            assert torch.equal(plan.block_table[b, :used], table[b, :used]), b
        assert (plan.max_seq_len, plan.num_splits, plan.chunk) == (padded.max_seq_len, 2, padded.chunk)
        assert torch.equal(plan.run(q, k, v, poison_like(q)), want), extra
    # host reads: one by default (lengths, widths and checks together), none with max_seq_len and validate=False
    count = _count_host_reads(monkeypatch)
    DecodePlan.from_csr(indptr, indices, last, **kw)
    assert count[0] == 1, count[0]
    count[0] = 0
    DecodePlan.from_csr(indptr, indices, last, **kw, max_seq_len=max(LENS), validate=False)
    assert count[0] == 0, count[0]


def test_csr_rejects_bad_tables(device):
    q, k, v, table, lens = make_case("nhd", 16, 2, 4, 32, torch.float16, [20, 40], device, seed=6)
    indptr, indices, last = to_csr(table, lens, 16)
    kw = dict(layout="nhd", k_cache=k, v_cache=v, num_q_heads=q.shape[1], q_dtype=q.dtype)
    bad_id = indices.clone()
    bad_id[2] = k.shape[0]
    with pytest.raises(ValueError, match=rf"kv_indices\[2\] = {k.shape[0]} is out of range"):
        DecodePlan.from_csr(indptr, bad_id, last, **kw)
    bad_last = last.clone()
    bad_last[1] = 17
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\] = 17"):
        DecodePlan.from_csr(indptr, indices, bad_last, **kw)
    with pytest.raises(ValueError, match="kv_indptr"):
        DecodePlan.from_csr(indptr.flip(0).contiguous(), indices, last, **kw)
    with pytest.raises(ValueError, match="kv_indptr"):
        DecodePlan.from_csr(indptr[:-1], indices, last, **kw)
    with pytest.raises(ValueError, match="kv_indices"):
        DecodePlan.from_csr(indptr, indices.long(), last, **kw)


def test_paged_decode_plan_cache_key_is_integral(device):
    """paged_decode's cached plans (no device reads) key on the mean rounded to a token: no miss per float."""
    q, k, v, table, lens = make_case("nhd", 8, 2, 2, 32, torch.float16, [20, 9], device, seed=3)
    decode_mod._PLANS.clear()
    outs = [paged_decode(q, k, v, "nhd", table, lens, max_seq_len=20, mean_seq_len=m, validate=False)
            for m in (14.6, 14.9, 15.2)]
    assert len(decode_mod._PLANS) == 1
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert not any(isinstance(x, float) for key in decode_mod._PLANS for x in key if x is not None
                   and not isinstance(x, bool)), "no float in the key"
    validated = paged_decode(q, k, v, "nhd", table, lens, out=poison_like(q))  # reads the lengths: not cached
    assert len(decode_mod._PLANS) == 1 and torch.equal(validated, outs[0])


@pytest.mark.parametrize("layout,num_splits", [pytest.param("nhd", 1, id="nhd-split1"),
                                               pytest.param("vllm", 2, id="vllm-split2"),
                                               pytest.param("hnd", 3, id="hnd-split3")])
def test_two_plans_and_merge_state_give_the_whole_context(layout, num_splits, device):
    """A shared-prefix decode in miniature: one plan over every sequence's first pages, one over the rest, both
    with return_lse; merge_state of the two equals decode over the whole context, and the LSEs are base 2."""
    bs, pre = 16, 3  # the first 3 pages (48 tokens) in the first plan
    q, k, v, table, lens = make_case(layout, bs, 2, 4, 32, torch.float16, LENS, device, seed=11)
    lens_a = lens.clamp(max=pre * bs)
    lens_b = (lens - pre * bs).clamp(min=0)
    kw = dict(num_splits=num_splits, return_lse=True)
    plan_a = plan_for(q, k, v, layout, table[:, :pre], lens_a, **kw)
    plan_b = plan_for(q, k, v, layout, table[:, pre:], lens_b, **kw)
    out_a, lse_a = plan_a.run(q, k, v, poison_like(q), poison_like(q[..., 0].float()))
    out_b, lse_b = plan_b.run(q, k, v)
    assert torch.isinf(lse_b[1]).all() and torch.isinf(lse_b[0]).all(), "sequences within the prefix: empty rest"
    merged, lse = merge_state(out_a, lse_a, out_b, lse_b)
    ref = paged_decode_ref(q, k, v, layout, table, lens)
    assert rel_err(merged, ref) < TOL[torch.float16], rel_err(merged, ref)
    # the LSE of the whole context, from the gathered keys
    for b, n in enumerate(LENS):
        if n == 0:
            assert torch.isinf(lse[b]).all() and (lse[b] < 0).all()
            continue
        keys = paged_gather_ref(k, layout, "k", table[b : b + 1], lens[b : b + 1]).double()  # [n, Hkv, D]
        keys = keys.repeat_interleave(4, dim=1)  # per query head
        s = torch.einsum("hd,nhd->hn", q[b].double(), keys) * 32**-0.5
        want = torch.logsumexp(s, -1) / math.log(2)
        assert torch.allclose(lse[b].double(), want, atol=2e-2), (b, lse[b], want)
    # without return_lse a plan refuses an lse buffer
    with pytest.raises(ValueError, match="lse"):
        plan_for(q, k, v, layout, table, lens).run(q, k, v, None, torch.empty(q.shape[:2], device=device))


# ----------------------------------------------------------------------------- merge_states
def attention_state(q, k, v, scale):
    """Attention of q ``[H, D]`` over k/v ``[n, H, D]``: (output ``[H, D]``, base-2 LSE ``[H]``); -inf if empty."""
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:1], float("-inf"), dtype=torch.float64)
    s = torch.einsum("hd,nhd->hn", q, k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v), torch.logsumexp(s, -1) / math.log(2)


def test_merge_states_equals_attention_over_the_union(device):
    """Segments of one context merged by their LSEs give attention over the whole context; an empty segment
    (-inf, its v NaN) counts for nothing."""
    g = torch.Generator().manual_seed(0)
    N, H, D, cuts = 3, 4, 32, [0, 7, 7, 30, 51]  # segment 1 is empty
    k = torch.randn(N, cuts[-1], H, D, generator=g, dtype=torch.float64)
    vv = torch.randn(N, cuts[-1], H, D, generator=g, dtype=torch.float64)
    q = torch.randn(N, H, D, generator=g, dtype=torch.float64)
    segments = list(zip(cuts[:-1], cuts[1:], strict=True))
    parts = [[attention_state(q[n], k[n, a:b], vv[n, a:b], D**-0.5) for a, b in segments] for n in range(N)]
    v = torch.stack([torch.stack([p[0] for p in row]) for row in parts]).float()  # [N, S, H, D]
    s = torch.stack([torch.stack([p[1] for p in row]) for row in parts]).float()  # [N, S, H]
    v[:, 1] = float("nan")  # an empty segment's output is never read
    full = torch.stack([attention_state(q[n], k[n], vv[n], D**-0.5)[0] for n in range(N)])
    full_lse = torch.stack([attention_state(q[n], k[n], vv[n], D**-0.5)[1] for n in range(N)])
    out = (poison_like(torch.empty(N, H, D, device=device)), poison_like(torch.empty(N, H, device=device)))
    got_v, got_s = merge_states(v.to(device), s.to(device), out=out)
    assert got_v is out[0] and got_s is out[1]
    assert torch.allclose(got_v.double().cpu(), full, atol=1e-5), (got_v.double().cpu() - full).abs().max()
    assert torch.allclose(got_s.double().cpu(), full_lse, atol=1e-5)
    # natural-log LSEs: the same merge
    got_v_e, got_s_e = merge_states(v.to(device), (s * math.log(2)).to(device), base=math.e)
    assert torch.allclose(got_v_e.double().cpu(), full, atol=1e-5)
    assert torch.allclose(got_s_e.double().cpu(), full_lse * math.log(2), atol=1e-5)


MERGE_CASES = [
    pytest.param(5, 3, 2, 64, torch.float32, False, id="s3-fp32"),
    pytest.param(4, 37, 3, 80, torch.float16, False, id="s37-fp16-d80"),  # several passes of the state loop
    pytest.param(6, 5, 4, 32, torch.bfloat16, True, id="s5-bf16-ragged"),
    pytest.param(2, 1, 1, 16, torch.float32, True, id="s1-ragged"),
]


@pytest.mark.parametrize("N,S,H,D,dtype,ragged", MERGE_CASES)
def test_merge_states_matches_reference(N, S, H, D, dtype, ragged, device):
    g = torch.Generator().manual_seed(S + D)
    # [N, H, S, D] storage read as [N, S, H, D]: any strides
    v = torch.randn(N, H, S, D, generator=g).to(dtype).transpose(1, 2)
    s = torch.randn(N, H, S, generator=g).mul(4).transpose(1, 2)
    s[0, 0, 0] = float("-inf")  # an empty state ...
    v[0, 0, 0] = float("nan")  # ... whose output is garbage
    s[-1, :, -1] = float("-inf")  # a row and head with no state at all (when S == 1)
    num_valid = None
    if ragged:
        num_valid = torch.randint(0, S + 1, (N,), generator=g, dtype=torch.int32)
        num_valid[0] = S
        for n, c in enumerate(num_valid.tolist()):
            v[n, c:] = float("nan")  # never read
            s[n, c:] = float("nan")
    v, s = v.to(device), s.to(device)
    nv = None if num_valid is None else num_valid.to(device)
    want_v, want_s = merge_states_ref(v, s, nv)
    out = (poison_like(torch.empty(N, H, D, dtype=dtype, device=device)), poison_like(torch.empty(N, H, device=device)))
    got_v, got_s = merge_states(v, s, num_valid=nv, out=out)
    assert not got_v.isnan().any() and not got_s.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got_v.double(), want_v, atol=tol, rtol=tol), (got_v.double() - want_v).abs().max()
    finite = torch.isfinite(want_s)
    assert torch.equal(torch.isfinite(got_s), finite)
    assert torch.allclose(got_s.double()[finite], want_s[finite], atol=1e-4)
    empty = ~finite
    assert torch.equal(got_v[empty].float(), torch.zeros_like(got_v[empty].float())), "no state: zeros"
    # allocated outputs: the same values
    again_v, again_s = merge_states(v, s, num_valid=nv)
    assert torch.equal(again_v, got_v) and torch.equal(again_s, got_s)


def test_merge_state_two(device):
    g = torch.Generator().manual_seed(1)
    va, vb = (torch.randn(7, 3, 16, generator=g).to(device) for _ in "ab")
    sa, sb = (torch.randn(7, 3, generator=g).to(device) for _ in "ab")
    sb[2, 1] = float("-inf")
    vb[2, 1] = float("nan")
    got_v, got_s = merge_state(va, sa, vb, sb)
    want_v, want_s = merge_states_ref(torch.stack([va, vb], 1), torch.stack([sa, sb], 1))
    assert torch.allclose(got_v.double(), want_v, atol=1e-5)
    assert torch.allclose(got_s.double(), want_s, atol=1e-5)
    assert torch.allclose(got_v[2, 1], va[2, 1]) and torch.allclose(got_s[2, 1], sa[2, 1])


def test_merge_states_rejects_bad_input(device):
    v = torch.zeros(2, 3, 4, 8, device=device)
    s = torch.zeros(2, 3, 4, device=device)
    for what, args, kw in [("v", (v[..., 0], s), {}), ("s", (v, s.double()), {}), ("s", (v, s[:, :2]), {}),
                           ("num_valid", (v, s), dict(num_valid=torch.zeros(2, device=device))),
                           ("base", (v, s), dict(base=1.0)), ("out", (v, s), dict(out=(v[:, 0], s)))]:
        with pytest.raises(ValueError, match=what):
            merge_states(*args, **kw)
    with pytest.raises(ValueError, match="v_a"):
        merge_state(v[:, 0], s[:, 0], v[:, 0, :2], s[:, 0])


# ----------------------------------------------------------------------------- CUDA graphs (GPU only)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU (none here: the "
                    "Triton interpreter runs the kernels on the CPU, and CPUs have no graphs)")
@pytest.mark.parametrize("layout,num_splits,return_lse", [pytest.param("nhd", 1, False, id="nhd-split1"),
                                                          pytest.param("vllm", 4, False, id="vllm-split4"),
                                                          pytest.param("hnd", None, False, id="hnd-heuristic"),
                                                          pytest.param("nhd", 2, True, id="nhd-split2-lse")])
def test_cuda_graph_of_a_four_layer_step(layout, num_splits, return_lse):
    """One plan, a whole 4-layer step captured in one CUDA graph, replayed with new queries: equals eager runs."""
    device = torch.device("cuda")
    q0, k0, v0, table, lens = make_case(layout, 16, 2, 4, 64, torch.float16, [300, 0, 1000, 17, 640], device, seed=8)
    ks = [another_layer(k0, 30 + i) for i in range(4)]
    vs = [another_layer(v0, 40 + i) for i in range(4)]
    plan = plan_for(q0, k0, v0, layout, table, lens, num_splits=num_splits, max_seq_len=1000, return_lse=return_lse)
    q = torch.randn((4, *q0.shape), device=device).to(q0.dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=device)

    def step():
        for layer in range(4):
            plan.run(q[layer], ks[layer], vs[layer], out[layer], lse[layer] if return_lse else None)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(2):
        q.copy_(torch.randn(q.shape, device=device).to(q.dtype))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(4):
            eager = plan.run(q[layer], ks[layer], vs[layer])
            if return_lse:
                eager, eager_lse = eager
                assert torch.equal(lse[layer], eager_lse), (trial, layer)
            assert torch.equal(out[layer], eager), (trial, layer)
            ref = paged_decode_ref(q[layer], ks[layer], vs[layer], layout, table, lens)
            assert rel_err(out[layer], ref) < 1e-2, (trial, layer)


def test_decode_tuning_table_is_data_with_a_default_gpu():
    """kernels/tuning/decode.json: an unmeasured GPU gets the default GPU's numbers, all of them present."""
    from workbench.kernels.decode import config

    measured, unknown = config._tuning("NVIDIA H200"), config._tuning("a GPU nobody measured")
    assert measured == unknown
    assert {"tile_bytes", "num_warps", "stages_deep", "stages_short", "smem_per_sm", "ragged_factor"} <= set(measured)
    cfg = config.decode_config(64, 8, 4, 128, 16, 4096, num_sms=132)
    assert cfg == {"BLOCK_N": 32, "num_splits": 1, "num_warps": 4, "num_stages": 4, "use_dot": True}  # W1's choice
