"""Quest page selection on the paged cache: the per-block key bounds the cache keeps (every write path, every layout,
fp16/bf16/fp8/int8, copy-on-write, compaction), the page-scores and compacted-table kernels against their references,
Quest decode against full decode and against dense attention over the chosen pages, recall, refusals, the bench
smoke run. Random data throughout (never zeros); bounds poisoned with NaN before the writes that must set them."""

import math

import pytest
import torch
from workbench.kernels.quest import QuestPlan, key_bounds, quest_page_scores, quest_select
from workbench.kernels.quest.reference import key_bounds_ref, quest_page_scores_ref

import workbench
from workbench import quant
from workbench.cache import PagedKVCache, compaction
from workbench.compress.page_selection import page_key_bounds, page_upper_bounds, quest_recall, select_pages
from workbench.compress.quest_decode import QuestDecode, quest_decode

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

L, H, D, PAGE = 2, 2, 32, 16


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def rand_kv(n, *, layers=L, heads=H, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    dev = workbench.device()
    k = (torch.randn(layers, n, heads, D, generator=g) * scale + 0.3).to(dev)  # an offset: bounds are not symmetric
    v = torch.randn(layers, n, heads, D, generator=g).to(dev)
    return k, v


def make_cache(kv_dtype="fp16", layout="nhd", pages=12, ops="kernels", layers=L, **kw):
    s = quant.get(kv_dtype)
    if s.static:
        kw.update(k_scale=torch.tensor([0.02]) if s.granularity == "tensor" else torch.tensor([0.02, 0.03]),
                  v_scale=torch.tensor([0.02]) if s.granularity == "tensor" else torch.tensor([0.02, 0.03]))
    kw.setdefault("page_tokens", PAGE)
    return PagedKVCache(layers, H, D, pages, layout=layout, kv_dtype=kv_dtype, key_bounds=True, ops=ops,
                        **kw)


def block_counts(cache, seq_ids):
    fill = {}
    for s in seq_ids:
        n = cache.manager.num_tokens(s)
        for i, b in enumerate(cache.manager.block_table(s)):
            fill[b] = max(fill.get(b, 0), min(PAGE, n - i * PAGE))
    return fill


def check_bounds(cache, seq_ids):
    """The cache's bounds of every live block equal the reference on its stored keys (exactly) and bound the keys as
    attention reads them (``cache.read``), tightly."""
    fill = block_counts(cache, seq_ids)
    blocks = torch.tensor(list(fill), device=cache.device)
    counts = torch.tensor(list(fill.values()), device=cache.device)
    layers = cache.num_layers
    for layer in range(layers):
        got = cache.key_bounds(layer)[blocks]
        ref = key_bounds_ref(cache.scheme, cache.k_cache(layer), cache.layout, D, blocks, counts,
                             cache.k_scale if cache.scheme.static else None)
        bad = ~((got == ref) | (got.isnan() & ref.isnan()))
        assert not bad.any(), f"layer {layer}: {int(bad.sum())} entries differ: {got[bad][:4]} vs {ref[bad][:4]}"
    for s in seq_ids:
        k, _ = cache.read(s)  # [L, n, H, D] fp32, as attention reads it
        dense = torch.stack([page_key_bounds(k[i], PAGE) for i in range(layers)])  # [L, P, H, 2, D]
        got = torch.stack([cache.key_bounds(i)[cache.manager.block_table(s)] for i in range(layers)]).float()
        assert (got[..., 0, :] <= dense[..., 0, :]).all() and (got[..., 1, :] >= dense[..., 1, :]).all(), s
        slack = (got - dense).abs() / dense.abs().clamp_min(1e-3)
        assert slack.max() < 4e-3, f"{s}: bounds loose by {slack.max():.2e}"


# ---- bounds kept by the cache -----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout, kv_dtype, layers", [
    ("nhd", "fp16", 2), ("hnd", "bf16", 1), ("vllm", "fp16", 1), ("vllm", "fp8_e4m3/tensor", 1),
    ("nhd", "int8/head", 1), ("hnd", "fp8_e5m2/token", 1), ("vllm", "int8_asym/token", 1),
])
def test_bounds_through_every_write_path(layout, kv_dtype, layers):
    """Every layout, plain / static-scale / per-token-scale (asymmetric too) formats; add, append, fork + append
    (copy-on-write), a DecodeStep's per-layer writes, append_batch."""
    cache = make_cache(kv_dtype, layout, layers=layers)
    cache.k_bounds.fill_(float("nan"))  # poisoned: every bound read below must have been written
    cache.add("a", list(range(37)), *rand_kv(37, layers=layers, seed=1))  # two full blocks and a partial one
    cache.add("b", list(range(100, 120)), *rand_kv(20, layers=layers, seed=2))
    cache.fork("a", "c")  # shares the partial block: the next append copies it (with its bounds) first
    cache.append("c", [60, 61], *rand_kv(2, layers=layers, seed=4, scale=3.0))
    check_bounds(cache, ["a", "b", "c"])
    with cache.begin_step(["a", "b", "c"], [7, 8, 9]) as step:  # the per-layer decode step
        for layer in range(layers):
            k, v = rand_kv(3, layers=1, seed=10 + layer, scale=2.0)
            step.write(layer, k[0], v[0])
    cache.append_batch(["a", "c"], [1, 2], *rand_kv(2, layers=layers, seed=20, scale=0.5))
    check_bounds(cache, ["a", "b", "c"])


def test_new_blocks_forget_their_previous_keys():
    cache = make_cache(pages=3)
    cache.add("big", list(range(40)), *rand_kv(40, seed=1, scale=50.0))
    cache.free("big")
    cache.add("small", list(range(200, 230)), *rand_kv(30, seed=2, scale=0.1))  # the same blocks again
    check_bounds(cache, ["small"])
    assert cache.key_bounds(0)[cache.manager.block_table("small")].float().abs().max() < 5


def test_bounds_follow_compaction():
    cache = make_cache(pages=6, ops="torch", prefix_caching=False, page_tokens=4 * PAGE, block_sizes=(PAGE,))
    for i in range(6):
        cache.add(i, list(range(i * 100, i * 100 + 20 + 3 * i)), *rand_kv(20 + 3 * i, seed=i))
    for i in (0, 2, 3):
        cache.free(i)
    before = {s: cache.manager.block_table(s) for s in (1, 4, 5)}
    cache.k_bounds[:, [b for t in before.values() for b in t]] = float("nan")  # moved blocks must carry them
    cache.refresh_key_bounds()
    p = compaction.compact(cache)
    assert p.num_moves > 0 and any(cache.manager.block_table(s) != t for s, t in before.items())
    check_bounds(cache, [1, 4, 5])


def test_key_bounds_refused_where_unsupported(tmp_path):
    with pytest.raises(ValueError, match="key_bounds=True needs a cache with one block size"):
        PagedKVCache(L, H, D, 4, page_tokens=16, block_sizes=(8, 16), key_bounds=True)
    with pytest.raises(ValueError, match="key_bounds=True is not supported with kv_dtype int4/kivi"):
        PagedKVCache(L, H, 64, 4, page_tokens=32, kv_dtype="int4/kivi", key_bounds=True)
    with pytest.raises(ValueError, match="key_bounds must be True or False"):
        PagedKVCache(L, H, D, 4, key_bounds=1)
    with pytest.raises(ValueError, match="build it with key_bounds=True"):
        PagedKVCache(L, H, D, 4).key_bounds(0)
    from workbench.tiers import TieredCache

    cache = make_cache(pages=4)
    with pytest.raises(ValueError, match="not supported with key_bounds=True"):
        TieredCache(cache, host_bytes=1 << 20)
    assert cache.on_evict is None and cache.manager.pool.evicted is None


def test_key_bounds_kernel_empty_blocks_and_rounding(device):
    """Count 0 resets to the empty bound; fp16 extremes stay finite and outward; subnormals stay outward."""
    k_cache = torch.empty((3, PAGE, 1, 16), dtype=torch.float16, device=device).normal_()
    k_cache[1, :4] = torch.tensor([65504.0, -65504.0, 3e-6, -3e-6], dtype=torch.float16)[:, None, None]
    bounds = torch.full((3, 1, 2, 16), float("nan"), dtype=torch.float16, device=device)
    blocks = torch.tensor([0, 1, 2], device=device)
    counts = torch.tensor([0, 4, 1], device=device)
    key_bounds(k_cache, "nhd", bounds, blocks, counts)
    assert (bounds[0, :, 0] == float("inf")).all() and (bounds[0, :, 1] == float("-inf")).all()
    assert (bounds[1, :, 0] == -65504).all() and (bounds[1, :, 1] == 65504).all()
    assert (bounds[2, :, 0] < k_cache[2, 0].float()).all() and (bounds[2, :, 1] > k_cache[2, 0].float()).all()
    assert torch.equal(bounds, key_bounds_ref(quant.get("fp16"), k_cache, "nhd", 16, blocks, counts))


# ---- dense helpers ----------------------------------------------------------------------------------------------
def test_dense_bounds_and_upper_bounds():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(45, 2, 8, generator=g)
    q = torch.randn(3, 4, 8, generator=g)
    b = page_key_bounds(k, 16)
    assert b.shape == (3, 2, 2, 8)
    assert torch.equal(b[2, :, 0], k[32:].amin(0)) and torch.equal(b[2, :, 1], k[32:].amax(0))
    ub = page_upper_bounds(q, b, "none")  # [3, 4, P]
    dots = torch.einsum("nhd,thd->nht", q, k.repeat_interleave(2, 1))  # [3, 4, T]
    for p in range(3):
        assert (dots[..., 16 * p:16 * (p + 1)].amax(-1) <= ub[..., p] + 1e-5).all()
    assert torch.allclose(page_upper_bounds(q, b, "max"), ub.amax(1))
    assert torch.allclose(page_upper_bounds(q, b, "sum"), ub.sum(1) / math.sqrt(8))
    assert torch.allclose(page_upper_bounds(q, b, "softmax").sum(-1), torch.full((3,), 4.0))
    assert page_upper_bounds(q[0], b).shape == (3,)


def test_recall_full_budget_is_one_and_oracle_is_best():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(70, 2, 16, generator=g)
    k[5] *= 4  # a few loud keys: recall depends on the choice
    q = torch.randn(6, 4, 16, generator=g) * 2
    full = quest_recall(q, k, 16, 5)
    for t in full:
        assert torch.allclose(t, torch.ones_like(t), atol=1e-5)
    for reduce in ("max", "sum", "softmax"):
        r = quest_recall(q, k, 16, 2, reduce=reduce)
        assert all(((t >= 0) & (t <= 1 + 1e-6)).all() for t in r)
        assert (r.oracle.mean(-1) >= r.shared.mean(-1) - 1e-6).all()
        assert r.per_head.shape == r.shared.shape == (6, 4)


# ---- kernels against references ---------------------------------------------------------------------------------
def scores_problem(device, seed=0, q_dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    nb, hkv, hq = 23, 2, 6  # odd group (3): G padded in the kernel
    lo = torch.randn(nb, hkv, D, generator=g)
    bounds = torch.stack([lo, lo + torch.rand(nb, hkv, D, generator=g)], 2).half().to(device)
    lens = torch.tensor([70, 0, 16, 33], dtype=torch.int32)
    table = torch.randperm(nb, generator=g)[:20].reshape(4, 5).to(torch.int32)
    q = torch.randn(4, hq, D, generator=g).to(q_dtype)
    return q.to(device), bounds, table.to(device), lens.to(device)


@pytest.mark.parametrize("reduce, q_dtype", [("max", torch.float16), ("sum", torch.float16), ("none", torch.float16),
                                             ("sum", torch.float32), ("max", torch.bfloat16)])
def test_page_scores_kernel(device, reduce, q_dtype):
    q, bounds, table, lens = scores_problem(device, q_dtype=q_dtype)
    shape = (q.shape[0], q.shape[1], table.shape[1]) if reduce == "none" else tuple(table.shape)
    out = torch.full(shape, float("nan"), device=device)  # poisoned: every entry must be written
    got = quest_page_scores(q, bounds, table, lens, page_size=PAGE, reduce=reduce, keep_first=1, keep_last=1, out=out)
    assert got is out and not got.isnan().any()
    ref = quest_page_scores_ref(q, bounds, table, lens, PAGE, reduce, keep_first=1, keep_last=1)
    assert torch.equal(got.isinf() & (got > 0), ref.isinf() & (ref > 0)) and torch.equal(got == -math.inf,
                                                                                          ref == -math.inf)
    fin = ref.isfinite()
    err = (got.double()[fin] - ref[fin]).abs().max()
    assert err < 1e-4 * ref[fin].abs().max(), f"max abs error {err:.3g}"
    assert (got[1] == -math.inf).all()  # an empty sequence: padding only


def test_select_kernel_matches_select_pages(device):
    q, bounds, table, lens = scores_problem(device, seed=3)
    s = quest_page_scores(q, bounds, table, lens, page_size=PAGE, keep_first=1, keep_last=1)
    for budget in (2, 3, 9):
        t, n = quest_select(s, table, lens, budget, page_size=PAGE)
        t_ref, n_ref = select_pages(s, lens, table, budget, page_size=PAGE)
        assert torch.equal(t, t_ref) and torch.equal(n, n_ref), (budget, t, t_ref, n, n_ref)
    # by hand: 70 tokens = 5 pages (the last of 6 tokens); budget 3 keeps page 0, page 4 and the best other (2)
    sc = torch.tensor([[0.0, 1.0, 5.0, 2.0, -1.0]], device=device)
    tab = torch.tensor([[10, 11, 12, 13, 14]], dtype=torch.int32, device=device)
    t, n = select_pages(sc, torch.tensor([70], device=device), tab, 3, page_size=PAGE)
    assert t.tolist() == [[10, 12, 14]] and n.tolist() == [2 * PAGE + 6]
    t, n = select_pages(sc, torch.tensor([70], device=device), tab, 3, page_size=PAGE, keep_first=0, keep_last=0)
    assert t.tolist() == [[11, 12, 13]] and n.tolist() == [3 * PAGE]


# ---- the fused top-k select against select_pages ----------------------------------------------------------------
def select_problem(device, B, W, seed, *, lens=None):
    """Scores with ties, NaN, both zeros and infinities, ragged lengths (empty, one page, a partial last page, one
    past the table's end); a table of distinct block ids."""
    g = torch.Generator().manual_seed(seed)
    sc = torch.randn(B, W, generator=g).mul_(4).round_().div_(4)  # quarter steps: many ties
    specials = torch.tensor([float("nan"), 0.0, -0.0, float("inf"), float("-inf")])
    pick = torch.rand(B, W, generator=g) < 0.1
    sc[pick] = specials[torch.randint(0, 5, (int(pick.sum()),), generator=g)]
    if lens is None:
        lens = torch.randint(1, W * PAGE + 1, (B,), generator=g)
        lens[:4] = torch.tensor([0, 1, W * PAGE, W * PAGE + 5])[:B]
    table = torch.randperm(4 * B * W, generator=g)[:B * W].reshape(B, W).to(torch.int32)
    return sc.to(device), table.to(device), torch.as_tensor(lens, dtype=torch.int32).to(device)


def assert_same_selection(sc, table, lens, budget, **kw):
    k = min(budget, sc.shape[1])  # poisoned buffers: every row's table and length must be written
    out_t = torch.full((sc.shape[0], k), -7, dtype=torch.int32, device=sc.device)
    out_n = torch.full((sc.shape[0],), -7, dtype=torch.int32, device=sc.device)
    got_t, got_n = quest_select(sc, table, lens, budget, page_size=PAGE, out_table=out_t, out_lens=out_n, **kw)
    ref_t, ref_n = select_pages(sc, lens, table, budget, page_size=PAGE, keep_first=0, keep_last=0)
    bad = [b for b in range(sc.shape[0]) if not (torch.equal(got_t[b], ref_t[b]) and got_n[b] == ref_n[b])]
    assert not bad, "\n".join(f"budget {budget} row {b} (len {int(lens[b])}): got {got_t[b].tolist()} len "
                              f"{int(got_n[b])}, expected {ref_t[b].tolist()} len {int(ref_n[b])}" for b in bad[:3])
    return got_t, got_n


@pytest.mark.parametrize("W, block_w", [(37, None), (37, 16), (16, 16), (150, 64)],
                         ids=["w37-one-tile", "w37-tiles16", "w16-exact-tile", "w150-tiles64"])
def test_fused_select_is_the_reference_choice(device, W, block_w):
    """The exact reference table (same pages, same tie rule) for budgets below, at and past the pages, on one or
    several tiles (W not a multiple of the tile)."""
    sc, table, lens = select_problem(device, 5, W, seed=W)
    budgets = {1, 17, W // 2, W + 3} if block_w else {1, 2, 17, W // 2, W, W + 3}  # tiles: slower in the interpreter
    for budget in sorted(budgets):
        got_t, got_n = assert_same_selection(sc, table, lens, budget, block_w=block_w)
        full = lens <= min(budget, W) * PAGE  # budget >= pages: every page, the length unchanged
        assert torch.equal(got_n[full], lens[full])


def test_fused_select_ties_go_to_the_lower_page(device):
    tab = torch.arange(100, 108, dtype=torch.int32, device=device)[None]
    lens = torch.tensor([8 * PAGE], dtype=torch.int32, device=device)
    cases = [([1.0, 3.0, 3.0, 3.0, 2.0, 3.0, 3.0, 0.5], 3, [101, 102, 103]),  # five pages tie for three places
             ([2.0] * 8, 4, [100, 101, 102, 103]),  # all equal
             ([0.0, -0.0, -1.0, -0.0, 0.0, -1.0, -2.0, -3.0], 2, [100, 101]),  # -0.0 ties with +0.0
             ([float("nan"), 1.0, float("inf"), 5.0, 1.0, 1.0, 0.0, 1.0], 3, [100, 102, 103]),  # NaN counts as +inf
             ([float("-inf")] * 7 + [-1e30], 2, [100, 107])]  # -inf pages are still pages (over the padding)
    for vals, budget, want in cases:
        sc = torch.tensor([vals], device=device)
        t, n = assert_same_selection(sc, tab, lens, budget)
        assert t[0].tolist() == want and int(n[0]) == budget * PAGE, (vals, t, n)


@pytest.mark.parametrize("budget, keep_first, keep_last", [(1, 1, 0), (1, 0, 1), (2, 1, 1), (2, 0, 1)])
def test_fused_select_with_forced_pages(device, budget, keep_first, keep_last):
    """Budgets 1 and 2 with the scores kernel's forced pages (+inf): exactly them (then the best other)."""
    q, bounds, table, lens = scores_problem(device, seed=5)
    s = quest_page_scores(q, bounds, table, lens, page_size=PAGE, keep_first=keep_first, keep_last=keep_last)
    t, n = quest_select(s, table, lens, budget, page_size=PAGE)
    t_ref, n_ref = select_pages(s, lens, table, budget, page_size=PAGE, keep_first=keep_first, keep_last=keep_last)
    assert torch.equal(t, t_ref) and torch.equal(n, n_ref), (t, t_ref, n, n_ref)
    # sequence 0: 70 tokens, 5 pages, the last holds 6
    row, pages = t[0].tolist(), table[0].tolist()
    if keep_first:
        assert row[0] == pages[0]
    if keep_last:
        assert pages[4] in row and int(n[0]) == (budget - 1) * PAGE + 6
    if keep_first + keep_last == budget:
        assert sorted(row) == sorted(pages[i] for i in [0] * keep_first + [4] * keep_last)


def test_quest_plan_is_the_public_kernels(device):
    """Planned once, run per layer: the same scores and table as the two public calls, for two layers' bounds;
    the metadata of q and the bounds checked against the plan."""
    q, bounds, table, lens = scores_problem(device, seed=2)
    plan = QuestPlan(table, lens, 3, page_size=PAGE, num_q_heads=q.shape[1], num_kv_heads=bounds.shape[1],
                     head_dim=D, q_dtype=q.dtype, keep_first=1, keep_last=1)
    for layer_bounds in (bounds, bounds.flip(0).contiguous()):
        t, n = plan.run(q, layer_bounds)
        s = quest_page_scores(q, layer_bounds, table, lens, page_size=PAGE, keep_first=1, keep_last=1)
        t_ref, n_ref = quest_select(s, table, lens, 3, page_size=PAGE)
        assert torch.equal(plan.scores, s) and torch.equal(t, t_ref) and torch.equal(n, n_ref), (t, t_ref, n, n_ref)
    for args, match in [((q.float(), bounds), "q must be a"), ((q[:2], bounds), "q must be a"),
                        ((q, bounds.float()), "bounds must be fp16"), ((q, bounds[:, :1]), "bounds must be fp16")]:
        with pytest.raises(ValueError, match=match):
            plan.run(*args)
    with pytest.raises(ValueError, match="reduce must be 'max' or 'sum'"):
        QuestPlan(table, lens, 3, page_size=PAGE, num_q_heads=6, num_kv_heads=2, head_dim=D, q_dtype=q.dtype,
                  reduce="none")


# ---- quest decode -----------------------------------------------------------------------------------------------
def decode_cache(ops="kernels", kv_dtype="fp16"):
    cache = make_cache(kv_dtype, pages=16, ops=ops)
    for i, n in enumerate((75, 40, 9)):
        cache.add(i, list(range(1000 * i, 1000 * i + n)), *rand_kv(n, seed=i))
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, D, generator=g).to(cache.dtype if not cache.scheme.quantized else torch.float16)
    return cache, q.to(cache.device)


def restricted_dense(cache, q, seq_ids, layer, table, lens):
    """fp64 attention over the pages named in the compacted table, from ``cache.read`` (an independent path)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, s in enumerate(seq_ids):
        k, v = (t.cpu() for t in cache.read(s))  # the reference runs on the host, whatever the cache's device
        full = cache.manager.block_table(s)
        n = cache.manager.num_tokens(s)
        rows = [t for blk in table[b].tolist()[:-(-int(lens[b]) // PAGE)]
                for t in range(full.index(blk) * PAGE, min(n, (full.index(blk) + 1) * PAGE))]
        assert len(rows) == int(lens[b])
        kk, vv = k[layer, rows].double(), v[layer, rows].double()  # [n, H, D]
        g = q.shape[1] // H
        sc = torch.einsum("hd,nhd->hn", q[b].double(), kk.repeat_interleave(g, 1)) / math.sqrt(D)
        out[b] = torch.einsum("hn,nhd->hd", sc.softmax(-1), vv.repeat_interleave(g, 1))
    return out


@pytest.mark.parametrize("ops", ["kernels", "torch"])
def test_quest_decode_at_full_budget_is_full_decode(ops):
    cache, q = decode_cache(ops)
    full = cache.decode(q, [0, 1, 2], 1)
    got = quest_decode(cache, q, [0, 1, 2], 1, page_budget=5)
    assert torch.equal(got, full), (got.float() - full.float()).abs().max()


@pytest.mark.parametrize("ops, kv_dtype, reduce", [("kernels", "fp16", "sum"), ("kernels", "fp8_e4m3/tensor", "max"),
                                                   ("kernels", "fp16", "softmax"), ("torch", "fp16", "softmax")])
def test_quest_decode_is_attention_over_the_chosen_pages(ops, kv_dtype, reduce):
    cache, q = decode_cache(ops, kv_dtype)
    qd = QuestDecode(cache, [0, 1, 2], 3, reduce=reduce)
    got = qd.run(q, 0, out=torch.full_like(q, float("nan")))  # poisoned output
    table, lens = qd.block_table.cpu(), qd.seq_lens.cpu()
    assert lens.tolist() == [2 * PAGE + 75 - 4 * PAGE, 40, 9]  # the long one: 3 pages, its last partial
    assert table[0, 0] == cache.manager.block_table(0)[0] and table[0, 2] == cache.manager.block_table(0)[-1]
    ref = restricted_dense(cache, q.cpu(), [0, 1, 2], 0, table, lens)
    err = (got.double().cpu() - ref).norm() / ref.norm()
    assert err < 2e-3, f"rel err {err:.3g}"
    # the choice follows the scores: the middle page kept is the best-scoring one of the long sequence
    s = qd.scores[0, 1:4].cpu()
    assert cache.manager.block_table(0)[1 + int(s.argmax())] == int(table[0, 1])
    if reduce != "sum":
        return
    # the next layer through the same plans (made once per q shape and dtype)
    got = qd.run(q, 1)
    ref = restricted_dense(cache, q.cpu(), [0, 1, 2], 1, qd.block_table.cpu(), qd.seq_lens.cpu())
    err = (got.double().cpu() - ref).norm() / ref.norm()
    assert err < 2e-3 and len(qd._plans) == (ops == "kernels"), f"layer 1: rel err {err:.3g}"


def test_bad_arguments_refused():
    cache, q = decode_cache("torch")
    plain = PagedKVCache(L, H, D, 4, ops="torch")
    plain.add("x", [1, 2], *rand_kv(2))
    cases = [
        (lambda: quest_decode(plain, q[:1], ["x"], 0, page_budget=2), "key_bounds=True"),
        (lambda: quest_decode(cache, q, [0, 1, 2], 0, page_budget=1), "page_budget .* must cover keep_first"),
        (lambda: quest_decode(cache, q, [0, 1, 2], 0, page_budget=0), "page_budget must be an int >= 1"),
        (lambda: quest_decode(cache, q, [0, 1, 2], 0, page_budget=2.0), "page_budget must be an int"),
        (lambda: quest_decode(cache, q[:2], [0, 1, 2], 0, page_budget=3), "q must be"),
        (lambda: quest_decode(cache, q.float(), [0, 1, 2], 0, page_budget=3), "q must have the cache's dtype"),
        (lambda: quest_decode(cache, q, [0, 1, 2], 5, page_budget=3), "layer must be in"),
        (lambda: quest_decode(cache, q, [0, 1, 2], 0, page_budget=3, reduce="mean"), "reduce must be one of"),
        (lambda: quest_decode(cache, q, [0, 1, 2], 0, page_budget=3, keep_first=-1), "keep_first must be"),
        (lambda: quest_decode(cache, q[:2], [0, 9], 0, page_budget=3), "no sequence 9"),
        (lambda: quest_recall(q[0], torch.randn(20, 2, D, device=q.device), 16, 2, reduce="none"),
         "reduce must be one of"),
        (lambda: quest_recall(q[0], torch.randn(20, 2, D, device=q.device), 0, 2), "page_size must be a positive int"),
        (lambda: page_upper_bounds(q[0].float(), torch.randn(3, 2, 2, D + 1, device=q.device)), "head_dim"),
        (lambda: select_pages(torch.zeros(2, 3), torch.tensor([5, 5]), torch.zeros(2, 4, dtype=torch.int32), 2,
                              page_size=16), "scores must be a"),
    ]
    for fn, match in cases:
        with pytest.raises((ValueError, KeyError), match=match):
            fn()
    q16, bounds, table, lens = scores_problem(workbench.device())
    for kw, match in [(dict(reduce="avg"), "reduce must be one of"), (dict(page_size=0), "page_size"),
                      (dict(keep_last=-1), "keep_last")]:
        with pytest.raises(ValueError, match=match):
            quest_page_scores(q16, bounds, table, lens, **{"page_size": PAGE, **kw})
    with pytest.raises(ValueError, match="block_table must be an int32"):
        quest_page_scores(q16, bounds, table.long(), lens, page_size=PAGE)
    with pytest.raises(ValueError, match="bounds must be fp16"):
        quest_page_scores(q16, bounds.float(), table, lens, page_size=PAGE)
    with pytest.raises(ValueError, match="block_p must be a power of two"):
        quest_page_scores(q16, bounds, table, lens, page_size=PAGE, block_p=24)
    s = torch.zeros(table.shape, device=table.device)
    for kw, match in [(dict(block_w=8), "block_w must be a power of two"), (dict(page_budget=0), "page_budget"),
                      (dict(scores=s.double()), "scores must be an fp32"), (dict(scores=s.t()), "scores must be"),
                      (dict(out_table=torch.zeros(4, 2, dtype=torch.int32, device=s.device)), "out_table must be")]:
        with pytest.raises(ValueError, match=match):
            quest_select(**{"scores": s, "block_table": table, "seq_lens": lens, "page_budget": 3, "page_size": PAGE,
                            **kw})


def test_bench_smoke(tmp_path):
    import json

    from workbench.bench import BENCHMARKS
    from workbench.bench import quest as bench

    assert "quest" in BENCHMARKS
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("quest-*.json")
    doc = json.loads(path.read_text())
    assert doc["mode"] == "smoke" and doc["meta"]["commit"]
    timing = [r for r in doc["rows"] if r["section"] == "timing"]
    assert timing and all(r["select_match"] and r["scores_inf_match"] and r["rel_err"] < 2e-2 for r in timing)
    assert any(r.get("err_vs_full") is not None for r in timing)
    assert any(r["section"] == "recall_real" and 0 < r["recall"] <= 1 for r in doc["rows"])
