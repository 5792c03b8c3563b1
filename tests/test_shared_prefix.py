"""Shared-prefix decode: the runs found from block tables, the cascade plan against the references (every layout,
fp16 / bf16 / fp8, batches that share nothing, everything, nested prefixes), the cost model and selector, and
overlap-aware batching."""

import itertools
import json
import random

import pytest
import torch
from conftest import poison_like
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode import rel_err
from workbench.kernels import CascadePlan
from workbench.kernels.decode.reference import cascade_decode_ref, paged_decode_ref

import workbench
from workbench.core.layout import from_nhd
from workbench.shared_prefix import (
    CostModel,
    Geometry,
    SharedPrefixDecode,
    choose,
    cut,
    find_shared_runs,
    fit,
    group_by_overlap,
    step_bytes,
    step_bytes_of_batches,
)

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

# a batch's sharing, as a tree: (blocks of this node, [children] or the number of private tokens of a leaf)
TREES = {
    "none": [(0, [37]), (0, [1]), (0, [70]), (0, [16])],
    "all": [(4, [(0, [0]), (0, [0]), (0, [0])])],  # three sequences, every block shared, nothing private
    "nested": [(2, [(1, [5, 20]), (2, [(1, [1, 33]), 9]), 0]), (0, [50])],  # a fork of a fork, a loner
}


def build_tree(tree, block_size, rng):
    """``(tables, lens)`` of the sequences a tree describes (physical ids assigned in order, shuffled later)."""
    tables, lens, counter = [], [], itertools.count()

    def walk(node, prefix):
        if isinstance(node, int):  # a leaf: private tokens after the shared prefix
            own = [next(counter) for _ in range(-(-node // block_size))]
            tables.append(prefix + own)
            lens.append(len(prefix) * block_size + node)
            return
        n_blocks, children = node
        blocks = prefix + [next(counter) for _ in range(n_blocks)]
        for child in children:
            walk(child, blocks)

    for top in tree:
        walk(top, [])
    n = next(counter)
    perm = list(range(n + 3))
    rng.shuffle(perm)  # fragmented: physical ids in random order, three blocks never used
    return [[perm[b] for b in t] for t in tables], lens, n + 3


def make_shared_case(tree, layout, block_size, hkv, group, head_dim, dtype, device, seed, kv_dtype=None):
    """Random q and K/V caches (blocks no sequence holds are NaN) for the sequences of ``tree``."""
    rng = random.Random(seed)
    tables, lens, num_blocks = build_tree(TREES[tree] if isinstance(tree, str) else tree, block_size, rng)
    g = torch.Generator().manual_seed(seed)
    width = max(1, max(len(t) for t in tables)) + 1
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    used = sorted({b for t in tables for b in t})
    caches = []
    for kind in ("k", "v"):
        nhd = torch.full((num_blocks, block_size, hkv, head_dim), float("nan"))
        nhd[used] = torch.randn(len(used), block_size, hkv, head_dim, generator=g)
        caches.append(from_nhd(nhd.to(kv_dtype or dtype), layout, kind).to(device))
    q = torch.randn(len(tables), hkv * group, head_dim, generator=g).to(dtype).to(device)
    return q, caches[0], caches[1], table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


CASES = [
    # tree, layout, block_size, hkv, group, head_dim, q dtype, kv dtype
    pytest.param("nested", "nhd", 16, 2, 4, 64, torch.float16, None, id="nested-nhd-gqa4-fp16"),
    pytest.param("nested", "hnd", 8, 2, 1, 32, torch.bfloat16, None, id="nested-hnd-mha-bf16"),
    pytest.param("nested", "vllm", 16, 1, 8, 64, torch.float16, torch.float8_e4m3fn, id="nested-vllm-gqa8-fp8"),
    pytest.param("all", "nhd", 16, 2, 1, 32, torch.bfloat16, torch.float8_e4m3fn, id="all-nhd-mha-fp8"),
    pytest.param("all", "vllm", 8, 2, 4, 64, torch.bfloat16, None, id="all-vllm-gqa4-bf16"),
    pytest.param("none", "hnd", 16, 1, 4, 64, torch.float16, None, id="none-hnd-gqa4-fp16"),
]


@pytest.mark.parametrize("tree,layout,block_size,hkv,group,head_dim,dtype,kv_dtype", CASES)
def test_cascade_matches_references(tree, layout, block_size, hkv, group, head_dim, dtype, kv_dtype, device):
    q, k, v, table, lens = make_shared_case(tree, layout, block_size, hkv, group, head_dim, dtype, device,
                                            seed=block_size + group, kv_dtype=kv_dtype)
    runs = find_shared_runs(table, lens, block_size)
    segments, suffix = cut(runs, range(len(runs)), len(lens))
    if tree != "none":
        assert segments, "the tree shares blocks: runs must be found"
    scales = dict(k_scale=0.75, v_scale=1.25) if kv_dtype else {}
    plan = CascadePlan(table, lens, segments, suffix, layout=layout, k_cache=k, v_cache=v, num_q_heads=q.shape[1],
                       q_dtype=q.dtype, rows_per_tile=16, return_lse=True, **scales)
    out = poison_like(q)
    got, lse = plan.run(q, k, v, out)
    assert got is out
    ref = paged_decode_ref(q, k, v, layout, table, lens, **scales)
    ref_c, ref_lse = cascade_decode_ref(q, k, v, layout, table, lens, segments, suffix, block_size, **scales)
    assert rel_err(ref_c, ref.cpu()) < 1e-9  # the decomposition itself is exact
    err = rel_err(got.cpu(), ref.cpu())
    print(f"{plan}: rel_err {err:.2e}")
    assert err < (2e-2 if kv_dtype else 1e-2), f"rel_err {err:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse.cpu().double()[finite], ref_lse[finite], atol=2e-2 if kv_dtype else 5e-3)


@pytest.mark.parametrize("tree", [[(8, [(3, [5, 60]), 0, 30]), (0, [50])], [(10, [0, 0])]], ids=["nested", "all"])
@pytest.mark.parametrize("splits, shared_splits", [(3, 2), (2, 5)])
def test_cascade_merges_every_split_of_both_passes(tree, splits, shared_splits, device):
    """The merge reads each pass's split partials itself: rows whose segment or suffix has fewer chunks than
    splits (their later splits never written: poison), empty suffixes ("all"), rows in fewer segments."""
    q, k, v, table, lens = make_shared_case(tree, "nhd", 8, 2, 4, 32, torch.float16, device, seed=splits)
    segments, suffix = cut(*(lambda r: (r, range(len(r))))(find_shared_runs(table, lens, 8)), len(lens))
    plan = CascadePlan(table, lens, segments, suffix, layout="nhd", k_cache=k, v_cache=v, num_q_heads=q.shape[1],
                       q_dtype=q.dtype, rows_per_tile=16, return_lse=True, num_splits=splits, BLOCK_N=16,
                       shared_launch={"num_splits": shared_splits})  # 16-token tiles: a GPU's would take no split
    for p in filter(None, plan.plans):  # unwritten splits hold NaN: a merge that read one would show it
        p._o_part.fill_(float("nan"))
        p._lse.fill_(float("nan"))
    shared, sfx = plan.plans
    assert shared.num_splits > 1 and (sfx.num_splits > 1 or sfx.max_seq_len == 0)  # "all": no suffix tokens
    got, lse = plan.run(q, k, v)
    ref_c, ref_lse = cascade_decode_ref(q, k, v, "nhd", table, lens, segments, suffix, 8)
    assert rel_err(got.cpu(), ref_c) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse.cpu()))
    assert torch.allclose(lse.cpu().double()[finite], ref_lse[finite], atol=5e-3)


@pytest.mark.parametrize("tree,layout,block_size,hkv,group,head_dim,dtype,kv_dtype", CASES[:5] + [
    pytest.param("nested", "nhd", 16, 3, 3, 64, torch.float16, None, id="nested-nhd-gqa3")])  # rows straddle tiles
def test_the_shared_pass_reads_its_queries_as_the_gather_does(tree, layout, block_size, hkv, group, head_dim, dtype,
                                                               kv_dtype, device):
    """The shared pass reading its stacked query rows from q through the row map (three launches) against the
    separate gather (four): the same output and LSE, bit for bit, for layers run back to back through one plan and,
    on a GPU, replayed from a CUDA graph."""
    q, k, v, table, lens = make_shared_case(tree, layout, block_size, hkv, group, head_dim, dtype, device,
                                            seed=block_size + 2 * group, kv_dtype=kv_dtype)
    segments, suffix = cut(*(lambda r: (r, range(len(r))))(find_shared_runs(table, lens, block_size)), len(lens))
    kw = dict(layout=layout, k_cache=k, v_cache=v, num_q_heads=q.shape[1], q_dtype=q.dtype, rows_per_tile=16,
              return_lse=True, **(dict(k_scale=0.75, v_scale=1.25) if kv_dtype else {}))
    own, gathered = (CascadePlan(table, lens, segments, suffix, fuse_gather=f, **kw) for f in (True, False))
    assert own.gathers_in_pass and not gathered.gathers_in_pass
    qs = [q, torch.randn_like(q)]
    want = [gathered.run(x, k, v) for x in qs]

    def step(outs):
        for x, (o, s) in zip(qs, outs, strict=True):
            s.copy_(own.run(x, k, v, o)[1])

    def check(outs):
        for (o, s), (w, w_lse) in zip(outs, want, strict=True):
            assert torch.equal(o, w) and torch.equal(s, w_lse)

    outs = [(poison_like(q), poison_like(w[1])) for w in want]
    step(outs)
    check(outs)
    if device.type == "cuda":
        graph_outs = [(poison_like(q), poison_like(w[1])) for w in want]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(graph_outs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(graph_outs)
        for o, s in graph_outs:
            o.fill_(float("nan"))
            s.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(graph_outs)
    with pytest.raises(ValueError, match="fuse_gather must be a bool"):
        CascadePlan(table, lens, segments, suffix, fuse_gather=1, **kw)


def test_run_partials_is_the_plans_decode_without_its_merge(device):
    from workbench.kernels import DecodePlan
    from workbench.kernels.decode.merge import merge_states

    q, k, v, table, lens = make_shared_case("nested", "nhd", 8, 2, 4, 32, torch.float16, device, seed=3)
    kw = dict(layout="nhd", k_cache=k, v_cache=v, num_q_heads=q.shape[1], q_dtype=q.dtype, num_splits=3)
    with pytest.raises(ValueError, match="return_lse=True"):
        DecodePlan(table, lens, **kw).run_partials(q, k, v)
    plan = DecodePlan(table, lens, return_lse=True, **kw)
    with pytest.raises(ValueError, match="q must be"):
        plan.run_partials(q[:, :1], k, v)
    out, lse = plan.run(q, k, v)
    o_part, s_part = plan.run_partials(q, k, v)
    n = torch.clamp((lens + plan.chunk - 1) // plan.chunk, max=plan.num_splits)
    got, got_lse = merge_states(o_part.transpose(1, 2), s_part.transpose(1, 2), num_valid=n.to(torch.int32))
    assert torch.equal(got.to(out.dtype), out) and torch.equal(got_lse, lse)


def test_shared_prefix_decode_paths_agree(device):
    q, k, v, table, lens = make_shared_case("nested", "nhd", 16, 2, 2, 32, torch.float16, device, seed=3)
    outs = {}
    for path in ("shared", "plain"):
        dec = SharedPrefixDecode(table, lens, layout="nhd", k_cache=k, v_cache=v, num_q_heads=q.shape[1],
                                 q_dtype=q.dtype, path=path, rows_per_tile=16)
        assert dec.path == path
        outs[path] = dec.run(q, k, v, out=poison_like(q))
    assert rel_err(outs["shared"].cpu(), outs["plain"].cpu().double()) < 1e-2


# ---- the runs ---------------------------------------------------------------------------------------------------
def random_tree(rng, depth=0):
    """A random forest of shared prefixes (nested up to depth 3)."""
    kids = []
    for _ in range(rng.randint(1, 3)):
        if depth < 3 and rng.random() < 0.5:
            kids.append((rng.randint(0, 3), random_tree(rng, depth + 1)))
        else:
            kids.append(rng.randint(0, 40))
    return kids


def common_full_blocks(ta, la, tb, lb, bs):
    n = min(la // bs, lb // bs)
    i = 0
    while i < n and ta[i] == tb[i]:
        i += 1
    return i


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 4, 16]))
def test_runs_match_pairwise_prefixes(seed, block_size):
    """For every pair of rows, the deepest run holding both ends at their common prefix of full blocks; cut()
    gives segments that tile each row's shared head in order."""
    rng = random.Random(seed)
    tables, lens, _ = build_tree([(rng.randint(0, 3), random_tree(rng))], block_size, rng)
    runs = find_shared_runs(tables, lens, block_size)
    for a, b in itertools.combinations(range(len(tables)), 2):
        want = common_full_blocks(tables[a], lens[a], tables[b], lens[b], block_size)
        got = max((r.end for r in runs if a in r.rows and b in r.rows), default=0)
        assert got == want, (a, b, runs)
    for r in runs:
        assert r.sharers >= 2 and r.start < r.end
        assert r.parent is None or (runs[r.parent].end == r.start and set(r.rows) < set(runs[r.parent].rows))
    chosen = [i for i in range(len(runs)) if rng.random() < 0.6]
    segments, suffix = cut(runs, chosen, len(tables))
    ends = [0] * len(tables)
    for s, e, rows in segments:
        for r in rows:
            assert ends[r] == s
            ends[r] = e
            assert tables[r][s:e] == tables[rows[0]][s:e] and e * block_size <= lens[r]
    assert ends == suffix


def test_ref_counts_only_narrow_the_search():
    rng = random.Random(5)
    tables, lens, n = build_tree(TREES["nested"], 4, rng)
    refs = [0] * n
    for t in tables:
        for b in t:
            refs[b] += 1
    assert find_shared_runs(tables, lens, 4, ref_counts=refs) == find_shared_runs(tables, lens, 4)
    assert find_shared_runs(tables, lens, 4, ref_counts=[1] * n) == []  # nothing held twice: nothing shared


def test_runs_reject_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        find_shared_runs([[1]], [4], 0)
    with pytest.raises(ValueError, match="seq_lens"):
        find_shared_runs([[1], [1]], [4], 4)
    with pytest.raises(ValueError, match="block_table"):
        find_shared_runs("ab", [4], 4)


# ---- the plan's checks ------------------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_cascade_rejects_random_bad_cuts(seed):
    """A corrupted cut (a segment past a length, over rows that do not share it, out of order, a wrong suffix
    start, a bad type) raises a ValueError naming the argument, before any kernel or buffer."""
    rng = random.Random(seed)
    q, k, v, table, lens = make_shared_case("nested", "nhd", 4, 1, 2, 16, torch.float32, torch.device("cpu"), seed=1)
    runs = find_shared_runs(table, lens, 4)
    segments, suffix = cut(runs, range(len(runs)), len(lens))
    segments = [list(s) for s in segments]
    i = rng.randrange(len(segments))
    kind = rng.choice(["end", "rows", "order", "suffix", "type", "dup"])
    if kind == "end":
        segments[i][1] = int(table.shape[1]) + rng.randint(1, 5)
    elif kind == "rows":
        loner = len(lens) - 1  # the tree's last sequence shares nothing
        segments[i][2] = tuple(segments[i][2]) + (loner,)
    elif kind == "order":
        segments = segments[::-1] if len(segments) > 1 else [[segments[0][0] + 1, *segments[0][1:]]]
    elif kind == "suffix":
        suffix = list(suffix)
        suffix[rng.randrange(len(suffix))] += rng.randint(1, 3)
    elif kind == "type":
        segments[i][0] = float(segments[i][0])
    else:
        segments[i][2] = (segments[i][2][0],) * 2
    with pytest.raises(ValueError, match="segments|suffix_start|block_table"):
        CascadePlan(table, lens, [tuple(s) for s in segments], suffix, layout="nhd", k_cache=k, v_cache=v,
                    num_q_heads=q.shape[1], q_dtype=q.dtype, rows_per_tile=16)


def test_cascade_rejects_bad_arguments(device):
    q, k, v, table, lens = make_shared_case("all", "nhd", 16, 2, 1, 32, torch.float16, device, seed=2)
    runs = find_shared_runs(table, lens, 16)
    segments, suffix = cut(runs, range(len(runs)), len(lens))
    kw = dict(layout="nhd", k_cache=k, v_cache=v, num_q_heads=q.shape[1], q_dtype=q.dtype)
    with pytest.raises(ValueError, match="rows_per_tile"):
        CascadePlan(table, lens, segments, suffix, rows_per_tile=24, **kw)
    with pytest.raises(ValueError, match="num_q_heads"):
        CascadePlan(table, lens, segments, suffix, **{**kw, "num_q_heads": 0})
    with pytest.raises(ValueError, match="overlap"):
        CascadePlan(table, lens, segments, suffix, overlap="yes", **kw)
    plan = CascadePlan(table, lens, segments, suffix, rows_per_tile=16, **kw)
    out = poison_like(q)
    with pytest.raises(ValueError, match="q must be"):
        plan.run(q[:, :1], k, v, out)
    with pytest.raises(ValueError, match="k_cache"):
        plan.run(q, k[:-1], v, out)
    assert torch.isnan(out).all()  # nothing written by the failed runs
    with pytest.raises(AttributeError):
        plan.rows_per_tile = 32


# ---- cost model, selector, batching -----------------------------------------------------------------------------
MODEL = CostModel(plain_us=8.0, plain_gbs=4000.0, cascade_us=25.0, shared_gbs=2500.0, margin=1.2)


def forks(prefix_blocks, sharers, suffix_tokens, block_size=16):
    tables = [list(range(prefix_blocks)) + [1000 + 100 * i + j for j in range(-(-suffix_tokens // block_size))]
              for i in range(sharers)]
    return tables, [prefix_blocks * block_size + suffix_tokens] * sharers


def test_selector_takes_long_shared_prefixes_only():
    geo = Geometry(32, 8, 128, 16)
    small = forks(8, 4, 128)  # a 128-token prefix, four sharers
    big = forks(2048, 64, 256)  # 32k tokens, 64 sharers
    none = ([[i] for i in range(8)], [16] * 8)
    picks = {}
    for name, (tables, lens) in {"small": small, "big": big, "none": none}.items():
        picks[name] = choose(find_shared_runs(tables, lens, 16), lens, geo, MODEL)
    assert picks["small"].path == "plain" and picks["none"].path == "plain"
    assert picks["big"].path == "shared" and picks["big"].predicted_speedup > 5
    b = picks["big"].bytes
    assert b["shared"] == 4 * 2048 * 16 * geo.token_bytes  # 64 sharers x 4 heads = 256 rows: 4 tiles of 64
    assert choose([], [16], geo, MODEL, path="shared").segments == []  # forced, nothing shared: suffixes only
    with pytest.raises(ValueError, match="path"):
        choose([], [16], geo, MODEL, path="fast")


def test_fit_recovers_a_model_and_sets_a_safe_margin():
    rng = random.Random(0)
    rows = []
    for prefix, sharers, suffix in itertools.product([128, 1024, 8192], [1, 4, 64], [128, 1024]):
        geo = Geometry(32, 8, 128, 16)
        tables, lens = forks(prefix // 16, sharers, suffix)
        runs = find_shared_runs(tables, lens, 16)
        segs, sfx = cut(runs, range(len(runs)), len(lens))
        b = step_bytes(segs, lens, sfx, geo)
        noise = 1 + rng.uniform(-0.03, 0.03)
        rows.append({"plain_bytes": b["plain"], "shared_bytes": b["shared"], "suffix_bytes": b["suffix"],
                     "plain_us": MODEL.plain(b) * noise, "cascade_us": MODEL.cascade(b) / noise})
    m = fit(rows)
    assert abs(m.plain_gbs / MODEL.plain_gbs - 1) < 0.1 and abs(m.shared_gbs / MODEL.shared_gbs - 1) < 0.15
    assert abs(m.cascade_us - MODEL.cascade_us) < 5
    for r in rows:  # the margin: never the cascade where it was measured slower
        b = {"plain": r["plain_bytes"], "shared": r["shared_bytes"], "suffix": r["suffix_bytes"]}
        if r["cascade_us"] >= r["plain_us"]:
            assert m.plain(b) <= m.margin * m.cascade(b)


def test_group_by_overlap_reads_less_than_arrival_order():
    rng = random.Random(1)
    tables, lens = [], []
    for g in range(6):  # six prompts, each forked into 2-6 samples, arriving interleaved
        t, n = forks(rng.randint(4, 40), rng.randint(2, 6), rng.randint(1, 100))
        tables += [[b + 10_000 * g if b < 1000 else b + 10_000 * g for b in row] for row in t]
        lens += n
    order = list(range(len(tables)))
    rng.shuffle(order)
    tables, lens = [tables[i] for i in order], [lens[i] for i in order]
    geo = Geometry(32, 8, 128, 16)
    grouped = group_by_overlap(tables, lens, 16, max_batch=8)
    arrival = [list(range(i, min(i + 8, len(tables)))) for i in range(0, len(tables), 8)]
    assert sorted(r for b in grouped for r in b) == list(range(len(tables)))
    assert all(len(b) <= 8 for b in grouped)
    g_bytes = step_bytes_of_batches(grouped, tables, lens, geo)
    a_bytes = step_bytes_of_batches(arrival, tables, lens, geo)
    assert g_bytes["plain"] == a_bytes["plain"]
    assert g_bytes["cascade"] < 0.8 * a_bytes["cascade"]
    with pytest.raises(ValueError, match="max_batch"):
        group_by_overlap(tables, lens, 16, max_batch=0)


def test_overlapped_passes_give_the_same_output(device):
    """The shared pass on a side stream changes when it runs, never the result: eagerly and captured in a CUDA graph
    (on a GPU), two layers back to back through one plan (the second's shared pass overwrites the scratch the first's
    merge reads: the fork must wait for it)."""
    q, k, v, table, lens = make_shared_case("nested", "nhd", 16, 2, 4, 64, torch.float16, device, seed=7)
    runs = find_shared_runs(table, lens, 16)
    segments, suffix = cut(runs, range(len(runs)), len(lens))
    kw = dict(layout="nhd", k_cache=k, v_cache=v, num_q_heads=q.shape[1], q_dtype=q.dtype, rows_per_tile=16)
    serial = CascadePlan(table, lens, segments, suffix, **kw)
    overlapped = CascadePlan(table, lens, segments, suffix, overlap=True, **kw)
    assert (overlapped._side is not None) == (device.type == "cuda")
    q2 = torch.randn_like(q)
    want = [serial.run(x, k, v).clone() for x in (q, q2)]

    def step(outs):
        for x, o in zip((q, q2), outs, strict=True):
            overlapped.run(x, k, v, o)
    outs = [poison_like(q), poison_like(q)]
    step(outs)
    assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))
    if device.type == "cuda":
        graph_outs = [poison_like(q), poison_like(q)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up off the default stream, as torch's graph docs ask
            step(graph_outs)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        for o in graph_outs:
            o.fill_(float("nan"))
        with torch.cuda.graph(graph):
            step(graph_outs)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, w) for o, w in zip(graph_outs, want, strict=True))


def test_shared_pass_takes_the_measured_tile_on_a_gpu(monkeypatch):
    """fp16 / bf16 at 64 rows a tile: 16 KB of K a tile and 3 stages (tuning/shared_prefix.json); a caller's own
    choice, other caches and tiles, and the interpreter keep the decode's."""
    from workbench.kernels.decode import cascade

    k = torch.empty((4, 16, 8, 128), dtype=torch.float16)
    assert cascade._shared_defaults(k, 128, 64, {}) == {}  # the interpreter: no SMs
    monkeypatch.setattr(cascade, "_num_sms", lambda device: 132)
    assert cascade._shared_defaults(k, 128, 64, {}) == {"BLOCK_N": 64, "num_stages": 3}
    assert cascade._shared_defaults(k, 64, 64, {}) == {"BLOCK_N": 128, "num_stages": 3}
    assert cascade._shared_defaults(k, 128, 128, {}) == {}
    assert cascade._shared_defaults(k, 128, 64, {"BLOCK_N": 32}) == {}
    assert cascade._shared_defaults(k.to(torch.float8_e4m3fn), 128, 64, {}) == {}


def test_batch_fast_grid_gives_the_same_output(device):
    """The sequence-fastest program order (the cascade's shared pass) changes the order, never the result."""
    from test_decode import make_case
    from workbench.kernels import DecodePlan

    q, k, v, table, lens = make_case("nhd", 16, 2, 4, 32, torch.float16, [37, 0, 100, 1], device, seed=4)
    outs = []
    for fast in (False, True):
        plan = DecodePlan(table, lens, layout="nhd", k_cache=k, v_cache=v, num_q_heads=q.shape[1], q_dtype=q.dtype,
                          num_splits=2, batch_fast=fast)
        outs.append(plan.run(q, k, v, poison_like(q)))
    assert torch.equal(outs[0], outs[1])


def test_committed_selector_never_picks_a_measured_loss():
    """On every committed H200 map point, the tuned selector (graph and eager models) takes the cascade only where
    the same run measured it faster than plain decode."""
    from workbench.results import run_files
    from workbench.shared_prefix import cost_model

    runs = run_files.load_runs("shared-prefix-h200-*.json", where={"mode": "full"})
    rows = [r for r in runs[-1]["rows"] if r["section"] == "map" and r["impl"] == "cascade"] if runs else []
    if not rows:
        pytest.skip("no committed shared-prefix map in data/results")
    for mode, key in (("graph", "speedup_graph"), ("eager", "speedup")):
        model = cost_model("NVIDIA H200", mode)
        picked = 0
        for r in rows:
            b = {"plain": r["plain_bytes"], "shared": r["shared_bytes"], "suffix": r["suffix_bytes"]}
            if model.plain(b) > model.margin * model.cascade(b):
                picked += 1
                assert r[key] > 1, (mode, r["gqa"], r["prefix"], r["sharers"], r["suffix"], r[key])
        assert picked >= 10, f"the {mode} model should take the cascade somewhere on the map"


@pytest.mark.parametrize("layout,kv_dtype", [("nhd", "fp16"), ("vllm", "fp8_e4m3/tensor")])
def test_decode_step_reads_forked_prefixes_once(layout, kv_dtype):
    """A cache with a prompt forked three times: the step's shared-prefix path (runs found from the tables and the
    allocator's reference counts) gives the plain step's output; a bad option is refused before anything runs."""
    from workbench.cache import PagedKVCache

    dev = workbench.device()
    kw = dict(k_scale=torch.tensor([0.02]), v_scale=torch.tensor([0.02])) if kv_dtype.startswith("fp8") else {}
    cache = PagedKVCache(1, 2, 32, 16, layout=layout, kv_dtype=kv_dtype, page_tokens=8, **kw)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 37, 2, 32, generator=g).to(dev) for _ in range(2))
    cache.add("a", list(range(37)), k, v)
    for child in ("b", "c", "d"):
        cache.fork("a", child)
    with cache.begin_step(["a", "b", "c", "d"], [1, 2, 3, 4]) as step:
        step.write(0, *(torch.randn(4, 2, 32, generator=g).to(dev) for _ in range(2)))
        q = torch.randn(4, 8, 32, generator=g).to(dev).half()
        plain = step.attend(q, 0)
        shared = step.attend(q, 0, shared_prefix="shared")
        assert step._plans[next(k for k in step._plans if k[3] == "shared")].choice.segments  # 4 blocks shared
        with pytest.raises(ValueError, match="shared_prefix"):
            step.attend(q, 0, shared_prefix="yes")
    assert rel_err(shared.cpu(), plain.cpu().double()) < 1e-2


def test_bench_smoke_runs_the_cascade_against_the_reference(tmp_path):
    """``bench shared_prefix --smoke``: tiny shapes through the interpreter, written to the folder given."""
    from workbench.bench import shared_prefix as bench

    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads(next(tmp_path.glob("shared-prefix-*.json")).read_text())["rows"]
    assert len(rows) == 2 and all(r["rel_err"] < 2e-2 for r in rows)
