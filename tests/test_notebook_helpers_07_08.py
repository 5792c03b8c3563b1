"""The package functions notebooks 07 (compression) and 08 (shared prefix) call instead of computing in a cell."""

from types import SimpleNamespace

import pytest
import torch

from workbench.compress import evict, observation, recall_study, sparsity_study
from workbench.publish import notebook
from workbench.results import compress as cm
from workbench.results import run_files
from workbench.results import shared_prefix as spm
from workbench.shared_prefix import cut, find_shared_runs
from workbench.shared_prefix.decode import random_batch
from workbench.sim import forks_report


# ---- notebook 07 ---------------------------------------------------------------------------------------------------
def fake_capture(name: str, tokens: int = 96, start: int = 0, seed: int = 0, layers: int = 2):
    """What the helpers read of a ``capture.Capture``: K/V ``[L, T, Hkv, D]``, the last queries, tokens, name."""
    obs = observation.synthetic_observation(num_layers=layers, num_tokens=tokens, num_queries=4, seed=seed)
    return SimpleNamespace(name=name, tokens=list(range(start, start + tokens)), k=obs.k, v=obs.v, q_last=obs.q,
                           sm_scale=obs.sm_scale, layers=list(range(layers)))


def test_capture_named_and_described():
    caps = [fake_capture("a", 32), fake_capture("b", 48)]
    assert sparsity_study.capture_named(caps, "b") is caps[1]
    with pytest.raises(ValueError, match=r"name: expected one of \['a', 'b'\], got 'c'"):
        sparsity_study.capture_named(caps, "c")
    assert sparsity_study.describe_captures(caps) == "2 prompts (a 32, b 48 tokens), layers [0, 1]"


def test_score_settings_scores_as_the_panel_and_adds_memory():
    obs = [observation.synthetic_observation(num_tokens=64, num_queries=8)]
    names, budgets = ["streaming", "h2o", "threshold"], [0.25, 0.5]
    rows = sparsity_study.score_settings(obs, names, budgets, 16, 4, 8, held_out=4)
    direct = sparsity_study.score_policies(obs, names, budgets, 16, ["keep", "compact"], held_out=4,
                                  thresholds=[sparsity_study.threshold_of(b) for b in budgets],
                                  options={n: sparsity_study.policy_options(n, 16, 4, 8) for n in names})
    assert [r["error"] for r in rows] == [r["error"] for r in direct]
    assert all(r["memory"] == r["blocks_kept"] / r["blocks_full"] for r in rows)
    table = sparsity_study.policy_table(sparsity_study.summarize(rows), names, budgets)
    assert [(t["policy"], t["budget"]) for t in table] == [
        ("streaming", "25%"), ("streaming", "50%"), ("h2o", "25%"), ("h2o", "50%"),
        ("threshold", "p>=0.025"), ("threshold", "p>=0.05")]
    assert set(table[0]) == {"policy", "budget", *sparsity_study.POLICY_TABLE_HEADERS}
    mean = run_files.pick(sparsity_study.summarize(rows), policy="h2o", budget=0.5, partial="compact")
    assert table[3]["mem_compact"] == mean["memory"] and table[3]["err_compact"] == mean["error"]


def test_format_recall_curves_is_a_grid():
    curves = [{"page_size": ps, "share": s, "read": s + 0.01, "recall": 0.5 + s} for ps in (8, 16) for s in (0.1, 0.5)]
    assert recall_study.format_recall_curves(curves).splitlines() == [
        " pages of          10%          50%",
        "        8  0.11 0.600  0.51 1.000",
        "       16  0.11 0.600  0.51 1.000"]


def test_pool_study_frees_blocks_only_when_compacting():
    # 96 tokens in 6 blocks of 16; keep tokens 0-3, 40 and 90-95: 3 blocks touched, 11 tokens packed into 1 block
    cap, beside, newcomer = fake_capture("a"), fake_capture("b", start=1000, seed=3), fake_capture("c", start=2000)
    keep = torch.zeros(96, dtype=torch.bool)
    keep[:4] = keep[40] = keep[90:] = True
    rows = evict.pool_study(cap, beside, newcomer, keep, pool_blocks=13, block_size=16, newcomer_tokens=80)
    kept, packed = (run_files.pick(rows, partial=p) for p in ("keep", "compact"))
    assert kept["free_before"] == packed["free_before"] == 1
    assert (kept["report"].blocks_after, kept["free_after"], kept["stored_tokens"]) == (3, 4, 48)
    assert (packed["report"].blocks_after, packed["free_after"], packed["stored_tokens"]) == (1, 6, 11)
    assert packed["report"].pool_blocks_returned == 5 and packed["report"].tokens_moved > 0
    assert kept["newcomer_after"].startswith("refused") and packed["newcomer_after"] == "placed, 1 blocks left"
    assert max(kept["decode_error"], packed["decode_error"]) < 2e-3  # fp16 storage, the same attention
    assert 0 < kept["error_vs_full"] < packed["error_vs_full"]
    text = evict.format_pool_study(rows, chosen_by="the mask")
    assert text.startswith("the mask keeps 11 of 96 tokens of 'a', spread over 3 of 6 blocks")
    assert "partial='compact': 11 tokens stored in 1 blocks (was 6)" in text
    assert "a new 80-token request (5 blocks): before, refused" in text
    # fp16 rounding is shown as the bound it meets: its digits differ between CPUs (issue 30: 5.8e-04 vs 5.9e-04)
    assert all(isinstance(r["decode_error"], notebook.Bound) for r in rows)
    for r in (kept, packed):
        assert f"max rel. error {r['decode_error']} (fp16 storage)" in text


@pytest.fixture(scope="module")
def quest_runs():
    runs = cm.runs("quest")
    assert runs, "the committed H200 Quest runs are in data/results"
    return runs


def test_quest_formatters_read_the_committed_runs(quest_runs):
    newest = cm.latest_quest_recall(quest_runs)
    with_recall = [r for r in quest_runs if cm.quest_recall_real(r)]
    assert newest == cm.quest_recall_real(with_recall[-1]) and cm.latest_quest_recall([]) == []
    check = cm.format_recall_check(newest, newest).splitlines()
    assert check[0].startswith("16-token pages") and len(check) == 1 + len(newest)
    assert f"shared {newest[0]['recall']:.3f} | {newest[0]['recall']:.3f}" in check[1]
    timings = cm.format_quest_timings(quest_runs).splitlines()
    assert len(timings) == sum(len(cm.quest_batches(r)) * len(cm.quest_page_sizes(r)) for r in quest_runs)
    best = cm.quest_speedups(quest_runs[-1], 8, 16)[0]
    assert f"{best['budget_tokens']}: {best['time_us_graph']:.0f} ({best['speedup_graph']:.2f}x)" in timings[-4]
    parts = cm.format_quest_parts(quest_runs[-1], batch=8, budget_tokens=2048).splitlines()
    assert len(parts) == len(cm.quest_page_sizes(quest_runs[-1])) and all("scores" in p and "attend" in p
                                                                          for p in parts)


def test_delta_formatters_read_the_committed_run():
    run = cm.latest("delta")
    line = cm.format_ratio_by_layer(run, "fp16", "shuffle")
    by_layer = cm.ratio_by_layer(run, "fp16", "shuffle")
    assert line.startswith("fp16, byte shuffle + zstd, per layer") and line.count("/") == 2 + 2 * len(by_layer)
    text = cm.format_break_even(run)
    assert text.count("wins on:") == len(cm.delta_chunks(run))
    disk = run_files.pick(cm.break_even(run, "block16/30layers"), link="disk_write")
    assert f"disk_write {disk['link_gbps']:.3g} GB/s needs {disk['needed_serial']:.3g}" in text


# ---- notebook 08 ---------------------------------------------------------------------------------------------------
def test_random_batch_is_the_notebooks_batch():
    tables, lens = [[0, 1, 2, 3, 10], [0, 1, 5, 13], [7, 8, 15]], [19, 14, 10]
    q, k, v, table, seq_lens = random_batch(tables, lens, 4, 2, 8, 32, seed=0)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(k, torch.randn(16, 4, 2, 32, generator=g).half())
    assert torch.equal(v, torch.randn(16, 4, 2, 32, generator=g).half())
    assert torch.equal(q, torch.randn(3, 8, 32, generator=g).half())
    assert table.tolist() == [[0, 1, 2, 3, 10], [0, 1, 5, 13, 0], [7, 8, 15, 0, 0]] and table.dtype == torch.int32
    assert seq_lens.tolist() == lens and seq_lens.dtype == torch.int32
    runs = find_shared_runs(table, seq_lens, 4)
    assert cut(runs, range(len(runs)), 3)[0] == [(0, 2, (0, 1))]
    with pytest.raises(ValueError, match="one table per length"):
        random_batch(tables, lens[:2], 4, 2, 8, 32)


@pytest.fixture(scope="module")
def prefix_run():
    runs = spm.runs()
    assert runs, "the committed H200 shared-prefix runs are in data/results"
    return runs[-1]


def test_selector_picks_and_the_formatters(prefix_run):
    picks = spm.selector_picks(prefix_run, "32/8")
    assert picks["points"] >= picks["picked"] > 0 and picks["wrong"] == 0 and picks["slowest"] > 1
    lines = spm.format_selector([prefix_run]).splitlines()
    assert len(lines) == 2 * len(spm.gqa_ratios(prefix_run)) and max(map(len, lines)) <= 105  # fits the output
    assert f"took the cascade at {picks['picked']} of {picks['points']} points, wrong at 0" in lines[-1]
    sections = spm.format_sections(prefix_run)
    assert "nested" in sections and "batching  grouped" in sections and "batching  arrival" in sections


def test_format_against_paper():
    rows = [{"trace": "alpaca_synth", "mode": "beam", "n": 2, "saving_pct": 39.04, "paper_pct": 37.6, "gap_pp": 1.44},
            {"trace": "alpaca_synth", "mode": "beam", "n": 4, "saving_pct": 58.6, "paper_pct": None, "gap_pp": None}]
    assert forks_report.format_against_paper(rows).splitlines() == [
        "  alpaca_synth     beam n=2: saves  39.0%  paper 37.6% (gap +1.4)",
        "  alpaca_synth     beam n=4: saves  58.6%  paper: not given"]
