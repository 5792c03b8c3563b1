"""The multi-program Quest select (``kernels/quest/select_split.py``) gives the one-program kernel's table, which is
``select_pages``' bit for bit: ties, NaN, both zeros, infinities, the forced pages, ragged rows (empty, one page, past
the table's end), budgets past the row, one and several programs a row, one and several tiles of the row and of
the candidates; outputs poisoned first; the scratch left zero for the next launch; the plan path and the function
path, and the rule that picks between the two kernels. Small tiles keep the interpreter's programs few and short."""

import pytest
import torch
from test_quest import PAGE, scores_problem, select_problem
from workbench.kernels.quest import QuestPlan, quest_page_scores, quest_select
from workbench.kernels.quest.select_split import split_select

import workbench
from workbench.compress.page_selection import select_pages

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

POISON = 12345


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def select_both(sc, table, lens, budget, **kw):
    """The multi-program table into poisoned buffers, checked entry by entry against ``select_pages`` and the
    one-program kernel's."""
    B, W = sc.shape
    k = min(budget, W)
    out_t = torch.full((B, k), POISON, dtype=torch.int32, device=sc.device)
    out_n = torch.full((B,), POISON, dtype=torch.int32, device=sc.device)
    got_t, got_n = quest_select(sc, table, lens, budget, page_size=PAGE, out_table=out_t, out_lens=out_n, split=True,
                                **kw)
    assert got_t is out_t and got_n is out_n
    ref_t, ref_n = select_pages(sc, lens, table, budget, page_size=PAGE, keep_first=0, keep_last=0)
    one_t, one_n = quest_select(sc, table, lens, budget, page_size=PAGE, split=False)
    assert torch.equal(one_t, ref_t) and torch.equal(one_n, ref_n)
    bad = [b for b in range(B) if not (torch.equal(got_t[b], ref_t[b]) and got_n[b] == ref_n[b])]
    assert not bad, "\n".join(f"budget {budget} row {b} (len {int(lens[b])}): got {got_t[b].tolist()} len "
                              f"{int(got_n[b])}, expected {ref_t[b].tolist()} len {int(ref_n[b])}" for b in bad[:3])
    return got_t, got_n


@pytest.mark.parametrize("W, block_s, block_w", [(37, 16, None), (37, 16, 16), (16, 16, None), (150, 32, 64)],
                         ids=["w37-3progs-one-tile", "w37-3progs-tiles16", "w16-1prog", "w150-5progs-tiles64"])
def test_split_select_is_the_reference_choice(device, W, block_s, block_w):
    """Ties (quarter steps), NaN, both zeros, +-inf, ragged rows (empty, one token, full, past the table's end);
    budgets of one page, a few, half, the whole row and past it; the row's programs and the last one's tiles."""
    sc, table, lens = select_problem(device, 5, W, seed=W + 1)
    for budget in sorted({1, 2, W // 2, W + 3}):
        select_both(sc, table, lens, budget, block_s=block_s, block_w=block_w)


def test_split_select_refines_crowded_buckets(device):
    """Scores a hair apart (500 +- 0.01: the bench's random keys give such rows), so one 16-bit bucket holds most of
    a row and the passes below it decide: several candidate tiles (16 keys each), exact ties among them, a row of one
    repeated value, a row of -inf, one of a single page."""
    g = torch.Generator().manual_seed(11)
    B, W = 6, 96
    sc = 500.0 + torch.randn(B, W, generator=g) * 0.01
    sc[1, ::3] = sc[1, 0]  # a third of the row ties
    sc[2] = -1.5  # one value
    sc[3] = float("-inf")
    sc[4, 7] = float("inf")  # a forced page
    lens = torch.tensor([W * PAGE, W * PAGE - 3, 50 * PAGE, 40 * PAGE + 1, 70 * PAGE, 1], dtype=torch.int32)
    table = torch.randperm(4 * B * W, generator=g)[:B * W].reshape(B, W).to(torch.int32)
    sc, table, lens = sc.to(device), table.to(device), lens.to(device)
    for budget in (1, 9, 48, 95):
        select_both(sc, table, lens, budget, block_s=32, block_w=16)


@pytest.mark.parametrize("budget, keep_first, keep_last", [(1, 1, 0), (2, 1, 1), (3, 0, 1)])
def test_split_select_keeps_the_forced_pages(device, budget, keep_first, keep_last):
    """The scores kernel's forced pages (+inf) with small budgets, as the one-program kernel keeps them."""
    q, bounds, table, lens = scores_problem(device, seed=5)
    s = quest_page_scores(q, bounds, table, lens, page_size=PAGE, keep_first=keep_first, keep_last=keep_last)
    t, n = quest_select(s, table, lens, budget, page_size=PAGE, split=True, block_s=16)
    t_ref, n_ref = select_pages(s, lens, table, budget, page_size=PAGE, keep_first=keep_first, keep_last=keep_last)
    assert torch.equal(t, t_ref) and torch.equal(n, n_ref), (t, t_ref, n, n_ref)


def test_split_plan_runs_again_and_leaves_its_scratch_zero(device):
    """The plan's path, twice per layer (the second launch reads the scratch the first one left): the tables of the
    one-program plan, and the histograms and tickets zero after every run; the rule's choice and overrides."""
    q, bounds, table, lens = scores_problem(device, seed=2)
    kw = dict(page_size=PAGE, num_q_heads=q.shape[1], num_kv_heads=bounds.shape[1], head_dim=q.shape[2],
              q_dtype=q.dtype, keep_first=1, keep_last=1)
    split = QuestPlan(table, lens, 3, select_split=True, select_block_s=16, **kw)
    one = QuestPlan(table, lens, 3, select_split=False, **kw)
    assert split.split and not one.split
    assert not QuestPlan(table, lens, 3, **kw).split  # the rule: rows of 5 pages (and no SMs here) take one program
    scratch = split._select_args[5:8]
    for layer_bounds in (bounds, bounds.flip(0).contiguous()):
        want = tuple(t.clone() for t in one.run(q, layer_bounds))
        for _ in range(2):
            split.block_table_out.fill_(POISON)
            split.seq_lens_out.fill_(POISON)
            t, n = split.run(q, layer_bounds)
            assert torch.equal(split.scores, one.scores) and torch.equal(t, want[0]) and torch.equal(n, want[1])
            assert all(not s.any() for s in scratch), "the split select left its scratch dirty"


def test_split_rule():
    """Multi-program for rows of 1024+ pages up to 1024 pages a SM in all (the H100's measured crossover), one
    program per row otherwise."""
    assert split_select(8, 2048, 132) and split_select(1, 8192, 132) and split_select(33, 4096, 132)
    assert not split_select(34, 4096, 132) and not split_select(32, 8192, 132)  # past 1024 pages a SM
    assert not split_select(8, 1023, 132)  # short rows: the one-program search is short
    assert not split_select(1, 4096, 0)  # no SM count (the interpreter)


def test_split_select_bad_arguments_refused():
    dev = workbench.device()
    q, bounds, table, lens = scores_problem(dev)
    s = torch.ones(table.shape, device=dev)
    base = {"scores": s, "block_table": table, "seq_lens": lens, "page_budget": 3, "page_size": PAGE}
    for kw, match in [(dict(split=1), "split must be True, False or None"),
                      (dict(split=False, block_s=16), "block_s is the multi-program kernel's"),
                      (dict(split=True, block_s=24), "block_s must be a power of two"),
                      (dict(split=True, block_s=8), "block_s must be a power of two"),
                      (dict(split=True, block_w=48), "block_w must be a power of two"),
                      (dict(split=True, page_budget=0), "page_budget"),
                      (dict(split=True, scores=s.double()), "scores must be an fp32")]:
        with pytest.raises(ValueError, match=match):
            quest_select(**{**base, **kw})
    kw = dict(page_size=PAGE, num_q_heads=q.shape[1], num_kv_heads=bounds.shape[1], head_dim=q.shape[2],
              q_dtype=q.dtype)
    for extra, match in [(dict(select_split="yes"), "select_split must be True, False or None"),
                         (dict(select_split=False, select_block_s=16), "select_block_s is the multi-program"),
                         (dict(select_split=True, select_block_s=100), "select_block_s must be a power of two"),
                         (dict(select_split=True, select_warps=3), "select_warps must be"),
                         (dict(select_split=True, select_radix=3), "select_radix must be 2 or 4")]:
        with pytest.raises(ValueError, match=match):
            QuestPlan(table, lens, 3, **kw, **extra)


@pytest.mark.parametrize("kind", ["normal", "clustered", "small-ints", "huge"])
def test_split_select_on_score_distributions(device, kind):
    """Spreads the two histograms see differently: unit normals (many 16-bit buckets), 1000 +- 1e-3 (one bucket,
    the passes below decide), a few integers (ties only), +-1e30 (the exponent's top bits)."""
    g = torch.Generator().manual_seed(len(kind))
    B, W = 3, 70
    base = torch.randn(B, W, generator=g)
    ints = torch.randint(-3, 3, (B, W), generator=g).float()
    sc = {"normal": base, "clustered": 1000 + base * 1e-3, "small-ints": ints, "huge": base * 1e30}[kind]
    lens = torch.tensor([W * PAGE, 33 * PAGE + 5, 2 * PAGE], dtype=torch.int32)
    table = torch.randperm(4 * B * W, generator=g)[:B * W].reshape(B, W).to(torch.int32)
    for budget in (5, 40):
        select_both(sc.to(device), table.to(device), lens.to(device), budget, block_s=32, block_w=32)
