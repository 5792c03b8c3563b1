"""Preemption time in the simulator: swap over the host link vs recompute by prefill (workbench.sim.preemption_cost)."""

import math

import numpy as np
import pytest

from workbench.sim import engine
from workbench.sim import preemption_cost as pc
from workbench.sim import traces as tr
from workbench.sim.budget import kv_budget, slots_budget
from workbench.tiers.link import LinkModel

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def flat(d2h_gbps=1.0, h2d_gbps=1.0) -> LinkModel:
    """Every transfer at a fixed bandwidth: seconds = bytes / (GB/s * 1e9)."""
    return LinkModel({("dma", "d2h"): ((1, d2h_gbps),), ("dma", "h2d"): ((1, h2d_gbps),)}, source="flat")


def per_copy() -> LinkModel:
    """GB/s = bytes / 1000 between 1 KB and 1 MB (log-log linear), so every copy in that range takes 1 us."""
    pts = ((1000, 1.0), (1_000_000, 1000.0))
    return LinkModel({("dma", "d2h"): pts, ("dma", "h2d"): pts}, source="1 us a copy")


@pytest.fixture(scope="module")
def small():
    return tr.load("sharegpt").head(250)


@pytest.fixture(scope="module")
def runs(small):
    budget = slots_budget(4096, bytes_per_token=2)  # tight: many preemptions
    return {m: engine.run(small, "vllm", budget, preemption=m) for m in ("swap", "recompute")}


# ---------------------------------------------------------------------------------------------- models


def test_prefill_model_hand_values_and_defaults():
    p = pc.PrefillModel(tokens_per_s=1000.0, fixed_s=0.5)
    assert p.seconds(250) == 0.75 and p.seconds(0) == 0.0
    assert pc.recompute_seconds(250, p) == 0.75 and pc.recompute_seconds(0, p) == 0.0
    d = pc.PrefillModel()
    assert 10_000 <= d.tokens_per_s <= 20_000 and d.fixed_s >= 0
    seven = pc.PrefillModel.for_model("llama-7b")
    assert (seven.tokens_per_s, seven.fixed_s) == (d.tokens_per_s, d.fixed_s)
    big = pc.PrefillModel.for_model("llama-13b")
    assert big.tokens_per_s == pytest.approx(d.tokens_per_s * 6.74 / 13.02)
    assert big.fixed_s == pytest.approx(d.fixed_s * 13.02 / 6.74)


def test_model_shapes():
    assert pc.model_bytes_per_token("llama-7b") == 2 * 32 * 4096 * 2 == 512 * 1024
    assert pc.model_bytes_per_token("llama-13b") == 800 * 1024
    assert pc.per_layer_transfers("llama-7b") == 64


def test_swap_seconds_hand_values_flat_link():
    # 10 tokens in blocks of 4: 3 blocks of 400 B (the last one partly filled moves whole) = 1200 B each way
    link = flat()
    for batched in (True, False):
        assert pc.swap_seconds(10, 100, 4, link, batched=batched) == pytest.approx(2 * 1200 / 1e9, rel=1e-12)
    # different directions: 1000 B out at 1 GB/s, in at 2 GB/s
    assert pc.swap_seconds(8, 125, 8, flat(1.0, 2.0)) == pytest.approx(1e-6 + 0.5e-6, rel=1e-12)
    assert pc.swap_seconds(0, 100, 4, link) == 0.0


def test_swap_seconds_hand_values_per_copy_link():
    # 10 tokens, 1000 B a token, blocks of 4: 3 blocks of 4000 B; every copy in [1 KB, 1 MB] costs 1 us
    link = per_copy()
    assert pc.swap_seconds(10, 1000, 4, link, batched=False) == pytest.approx(2 * 3e-6, rel=1e-9)
    assert pc.swap_seconds(10, 1000, 4, link, batched=True) == pytest.approx(2 * 1e-6, rel=1e-9)  # one 12 KB copy
    # each block as 2 copies of 2000 B: 6 copies a direction
    assert pc.swap_seconds(10, 1000, 4, link, batched=False, transfers_per_block=2) == pytest.approx(12e-6, rel=1e-9)
    assert pc.swap_seconds(10, 1000, 4, link, batched=True, transfers_per_block=2) == pytest.approx(2e-6, rel=1e-9)


def test_block_size_curve_hand_values():
    rows = pc.block_size_curve([1, 4], 8, 1000, per_copy(), pc.PrefillModel(1000.0, 0.0))
    assert [r["blocks"] for r in rows] == [8, 2] and [r["block_bytes"] for r in rows] == [1000, 4000]
    assert rows[0]["swap_per_block_s"] == pytest.approx(16e-6, rel=1e-9)
    assert rows[1]["swap_per_block_s"] == pytest.approx(4e-6, rel=1e-9)
    assert all(r["swap_batched_s"] == pytest.approx(2e-6, rel=1e-9) for r in rows)
    assert all(r["recompute_s"] == 0.008 and r["faster"] == "swap" for r in rows)


# ---------------------------------------------------------------------------------------------- monotonicity


@pytest.mark.parametrize("k", [1, 64])
def test_block_size_curve_monotone_on_h200_link(k):
    link, bpt = LinkModel.default(), pc.model_bytes_per_token("llama-7b")
    rows = pc.block_size_curve(SIZES, 1024, bpt, link, pc.PrefillModel(), transfers_per_block=k)
    per = [r["swap_per_block_s"] for r in rows]
    assert all(a >= b for a, b in zip(per[:-1], per[1:], strict=True)), per  # falls as blocks grow (flat once clamped)
    assert per[0] > per[-1]
    bat = {r["swap_batched_s"] for r in rows}
    assert len(bat) == 1  # 1024 tokens fill every block size exactly: one transfer of the same bytes
    assert len({r["recompute_s"] for r in rows}) == 1
    assert all(r["swap_batched_s"] <= r["swap_per_block_s"] * (1 + 1e-12) for r in rows)


def test_batched_swap_depends_on_block_size_only_through_the_last_block():
    link, bpt, t = LinkModel.default(), pc.model_bytes_per_token("llama-7b"), 1000
    for b in SIZES:
        moved = -(-t // b) * b * bpt
        want = link.seconds(moved, "dma", "d2h") + link.seconds(moved, "dma", "h2d")
        assert pc.swap_seconds(t, bpt, b, link) == pytest.approx(want, rel=1e-12)
    exact = pc.swap_seconds(t, bpt, 1, link)
    assert all(exact <= pc.swap_seconds(t, bpt, b, link) <= exact * (t + b) / t for b in SIZES)


def test_vllm_layout_reproduces_figure_19a_crossover():
    """Per-layer K/V copies (64 of 8 KiB a token of block): recompute wins for tiny blocks, swap for large."""
    rows = pc.block_size_curve(SIZES, 1024, pc.model_bytes_per_token("llama-7b"), LinkModel.default(),
                               pc.PrefillModel(), transfers_per_block=pc.per_layer_transfers("llama-7b"))
    assert rows[0]["faster"] == "recompute" and rows[-1]["faster"] == "swap"
    faster = [r["faster"] for r in rows]
    assert faster == sorted(faster, key=lambda f: f == "swap")  # one crossover


# ---------------------------------------------------------------------------------------------- simulator


def test_engine_records_preemption_events(runs):
    for mode, res in runs.items():
        assert res.preemption == mode and res.block_size == 16 and res.preemptions > 0
        assert res.preempted_tokens.size == res.preemptions
        assert 0 < res.resumed_tokens.size <= res.preemptions
        assert (res.preempted_tokens > 0).all()
    assert runs["recompute"].recomputed_tokens == runs["recompute"].resumed_tokens.sum()
    sw = runs["swap"]
    assert sw.swapped_bytes == (sw.preempted_tokens.sum() + sw.resumed_tokens.sum()) * sw.budget.bytes_per_token
    # memory (and so the events) does not depend on the mode
    assert np.array_equal(runs["swap"].preempted_tokens, runs["recompute"].preempted_tokens)
    assert np.array_equal(runs["swap"].resumed_tokens, runs["recompute"].resumed_tokens)


def test_preemption_overhead_matches_the_run_counters(runs):
    link, pf = flat(), pc.PrefillModel(1000.0, 0.25)
    ov = {m: pc.preemption_overhead(r, link, pf) for m, r in runs.items()}
    sw, rc = ov["swap"], ov["recompute"]
    res = runs["swap"]
    assert sw["swap_token_bytes"] == res.swapped_bytes
    assert rc["recompute_tokens"] == runs["recompute"].recomputed_tokens
    assert sw["swap_outs"] == sw["preemptions"] == res.preemptions and sw["swap_ins"] == res.resumed_tokens.size
    blocks = int((-(-res.preempted_tokens // 16)).sum() + (-(-res.resumed_tokens // 16)).sum())
    assert sw["swap_blocks"] == blocks and sw["swap_bytes"] == blocks * 16 * 2 >= sw["swap_token_bytes"]
    assert sw["swap_s"] == pytest.approx(sw["swap_bytes"] / 1e9, rel=1e-9)  # flat 1 GB/s, batched
    assert sw["swap_s"] == pytest.approx(sw["swap_out_s"] + sw["swap_in_s"])
    assert rc["recompute_s"] == pytest.approx(0.25 * rc["recomputes"] + rc["recompute_tokens"] / 1000.0)
    for key in ("swap_s", "recompute_s", "swap_bytes", "recompute_tokens"):
        assert sw[key] == rc[key]  # one run prices both ways
    assert sw["actual_s"] == sw["swap_s"] and rc["actual_s"] == rc["recompute_s"]
    # per event, the sum of swap_seconds over the events
    one = sum(pc.swap_seconds(int(t), 2, 16, link) / 2 for t in res.preempted_tokens)
    assert sw["swap_out_s"] == pytest.approx(one, rel=1e-9)


def test_preemption_overhead_block_size_for_contiguous(small):
    res = engine.run(small.head(100), "orca-max", slots_budget(8192, 2), preemption="swap")
    assert res.block_size is None
    with pytest.raises(ValueError, match="block_size"):
        pc.preemption_overhead(res, flat())
    ov = pc.preemption_overhead(res, flat(), block_size=2048)
    assert ov["preemptions"] == res.preemptions


def test_compare_preemption_on_a_small_trace(small):
    link, pf = flat(), pc.PrefillModel(1000.0, 0.25)
    out = pc.compare_preemption(small, "vllm", slots_budget(4096, 2), link, pf, step_s=0.01)
    sw, rc = out["swap"], out["recompute"]
    assert sw["steps"] == rc["steps"] and sw["preemptions"] == rc["preemptions"] > 0
    assert sw["swapped_bytes"] > 0 and sw["recomputed_tokens"] == 0
    assert rc["recomputed_tokens"] > 0 and rc["swapped_bytes"] == 0
    for row in (sw, rc):
        assert row["decode_s"] == pytest.approx(row["steps"] * 0.01)
        assert row["total_s"] == pytest.approx(row["decode_s"] + row["preemption_s"])
        assert 0 < row["overhead_pct"] < 100
    assert out["faster"] == ("swap" if sw["total_s"] < rc["total_s"] else "recompute")
    assert out["recompute_over_swap"] == pytest.approx(rc["total_s"] / sw["total_s"])
    assert out["assumptions"]["step_s"] == 0.01 and out["assumptions"]["link"] == "flat"


def test_compare_preemption_defaults_scale_prefill_to_the_budget_model(small):
    out = pc.compare_preemption(small.head(60), "vllm", kv_budget("llama-13b", kv_gib=1), LinkModel.default(),
                                max_steps=500)
    assert out["assumptions"]["prefill"]["tokens_per_s"] == pytest.approx(pc.PrefillModel.for_model("llama-13b")
                                                                          .tokens_per_s)
    assert out["swap"]["steps"] == out["recompute"]["steps"] == 500


# ---------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("kwargs, name", [
    ({"tokens": -1}, "tokens"), ({"tokens": 1.5}, "tokens"), ({"tokens": True}, "tokens"),
    ({"bytes_per_token": 0}, "bytes_per_token"), ({"block_size": 0}, "block_size"),
    ({"link": "h200"}, "link"), ({"path": "nvlink"}, "path"), ({"batched": "yes"}, "batched"),
    ({"transfers_per_block": 0}, "transfers_per_block"), ({"transfers_per_block": 3}, "transfers_per_block"),
])
def test_swap_seconds_bad_arguments(kwargs, name):
    args = {"tokens": 10, "bytes_per_token": 100, "block_size": 4, "link": flat()} | kwargs
    with pytest.raises(ValueError, match=name):
        pc.swap_seconds(**args)


def test_other_bad_arguments(runs, small):
    with pytest.raises(ValueError, match="path"):  # no sm curve in this link
        pc.swap_seconds(10, 100, 4, flat(), path="sm")
    for kw, name in [({"tokens_per_s": 0}, "tokens_per_s"), ({"tokens_per_s": math.inf}, "tokens_per_s"),
                     ({"tokens_per_s": "fast"}, "tokens_per_s"), ({"fixed_s": -1.0}, "fixed_s"),
                     ({"fixed_s": math.nan}, "fixed_s")]:
        with pytest.raises(ValueError, match=name):
            pc.PrefillModel(**kw)
    with pytest.raises(ValueError, match="n_tokens"):
        pc.PrefillModel().seconds(-1)
    with pytest.raises(ValueError, match="model"):
        pc.PrefillModel.for_model("gpt-5")
    with pytest.raises(ValueError, match="tokens"):
        pc.recompute_seconds(-3)
    with pytest.raises(ValueError, match="prefill"):
        pc.recompute_seconds(3, "fast")
    for sizes in ([], [0], [4, -1], "16"):
        with pytest.raises(ValueError, match="block_sizes"):
            pc.block_size_curve(sizes, 16, 100, flat())
    with pytest.raises(ValueError, match="tokens"):
        pc.block_size_curve([16], 0, 100, flat())
    with pytest.raises(ValueError, match="result"):
        pc.preemption_overhead({"preemptions": 3}, flat())
    with pytest.raises(ValueError, match="bytes_per_token"):
        pc.preemption_overhead(runs["swap"], flat(), bytes_per_token=0)
    with pytest.raises(ValueError, match="step_s"):
        pc.compare_preemption(small, "vllm", slots_budget(4096, 2), flat(), step_s=0)
    with pytest.raises(ValueError, match="timed_arrivals"):
        pc.compare_preemption(small, "vllm", slots_budget(4096, 2), flat(), timed_arrivals="no")
