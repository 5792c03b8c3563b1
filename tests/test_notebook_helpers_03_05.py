"""The pure helpers notebooks 03 (dtypes and quantization) and 05 (prefetch and tiers) call instead of computing or
formatting tables in their cells: quant.error_study's tables, the committed decode and tiers runs as rows, the prefetch
patterns and strategies, the swap-or-recompute curves and the tiered cache's stats line."""

import pytest
import torch

from workbench.cache import PagedKVCache
from workbench.quant import error_study, synthetic
from workbench.results import tiers as measured
from workbench.sim import preemption_cost as pc
from workbench.tiers import TieredCache, access, prefetch
from workbench.tiers.link import LinkModel
from workbench.tiers.replay import compare, compare_traces
from workbench.tiers.tiered import describe_stats, move_rows
from workbench.tiers.transfer import block_bytes
from workbench.ui import quant_panels

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)


# ---- notebook 03 ------------------------------------------------------------------------------------------------
def test_bytes_table_and_ratios():
    rows = {r["scheme"]: r for r in error_study.bytes_table(3, 64, context=512)}
    assert rows["fp32"] == {"scheme": "fp32", "bits": 32, "granularity": "none", "bytes_per_token": 1536,
                            "vs_fp32": 1.0, "at_context": 1536}
    assert rows["fp8_e4m3/token"]["bytes_per_token"] == 408 and isinstance(rows["int4/kivi"]["bytes_per_token"], int)
    assert (rows["int4/kivi"]["bytes_per_token"], rows["int4/kivi"]["at_context"]) == (240, 372)  # fp16 residual
    chosen = error_study.bytes_table(3, 64, schemes=["fp16", "int2/token"])
    assert [r["scheme"] for r in chosen] == ["fp16", "int2/token"]
    r = error_study.byte_ratios(3, 64)
    assert r["fp16_vs_fp32"] == 0.5 and r["fp8_vs_fp16"] == 0.5 and r["token_scale_cost"] == pytest.approx(0.0625)


def test_study_tables_on_small_data():
    k_pre, v = synthetic.synthetic_kv(2, 64, 1, 32, seed=0)
    k = synthetic.apply_rope(k_pre)
    q = synthetic.synthetic_queries(k, 4, 1, seed=1)
    stats = error_study.data_stats_rows(q, {"pre": k_pre, "post": k}, v)
    assert [s["keys"] for s in stats] == ["pre", "post"] and stats[1]["sink_mass"] == error_study.data_stats(q, k, v)[
        "sink_mass"]
    table = error_study.summarize(error_study.evaluate_all(["fp16", "fp8_e4m3/tensor", "fp8_e5m2/tensor",
                                                            "fp8_e4m3/token", "fp8_e5m2/token"], q, k, v))
    assert all(isinstance(r["bytes_per_token"], int) for r in error_study.whole_bytes(table))
    assert error_study.whole_bytes([{"x": 1.6}], "x") == [{"x": 2}]
    assert error_study.whole_bytes([{"y": 1.5}]) == [{"y": 1.5}]
    ratios = error_study.error_ratios(table, granularities=("tensor", "token"))
    by = {r["scheme"]: r for r in table}
    assert [r["granularity"] for r in ratios] == ["tensor", "token"]
    assert ratios[0]["attn_err"] == by["fp8_e5m2/tensor"]["attn_err"] / by["fp8_e4m3/tensor"]["attn_err"]
    with pytest.raises(ValueError, match="fp8_e5m2/head"):
        error_study.error_ratios(table)
    front = [{"scheme": "int4/token", "bytes_per_token": 240.0, "attn_err": 0.1543}, {"scheme": "fp16",
                                                                                     "bytes_per_token": 768.0,
                                                                                     "attn_err": 7.55e-4}]
    assert error_study.describe_front(front) == "int4/token (240 B, 0.154), fp16 (768 B, 0.000755)"


def test_h200_decode_run_is_what_the_rows_come_from():
    run = quant_panels.h200_decode_run()
    assert run is not None and run["path"].name.startswith("quant-decode-h200-")
    # the full run's rows, those a later --schemes run re-measured replaced by its (tests/test_quant_study.py)
    base = {(r["workload"], r["scheme"]): r for r in quant_panels.best_decode_rows(run["rows"])}
    later = {(r["workload"], r["scheme"]): r for u in quant_panels.h200_decode_updates()
             for r in quant_panels.best_decode_rows(u["rows"]) if r["scheme"] != "fp16"}
    rows = quant_panels.h200_decode_rows()
    assert [(r["workload"], r["scheme"]) for r in rows] == list(base)
    assert all(r == later.get(key, base[key]) for key, r in zip(base, rows, strict=True))
    assert quant_panels.h200_decode_run(where={"gpu": "no such GPU"}) is None
    assert quant_panels.h200_decode_rows(where={"gpu": "no such GPU"}) == []


# ---- notebook 05: the committed tiers runs ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs():
    found = measured.runs()
    assert len(found) >= 2, "the committed H200 tiers runs"
    return found


def test_run_tables(runs):
    new = runs[-1]
    assert measured.run_stamp(new) == measured.run_name(new)[len("tiers-h200-"):-len(".json")]
    pinned = measured.pinned_rows(runs)
    assert [r["run"] for r in pinned] == [measured.run_name(r) for r in runs]
    assert pinned[-1]["h2d"] == measured.pinned(new)["h2d"] and pinned[-1]["gpu"] == "NVIDIA H200"
    batching = measured.batching_rows(runs, 32 << 10, (64, 256))
    assert len(batching) == 2 * len(runs) and batching[0]["run"] == measured.run_stamp(runs[0])
    assert batching[-1]["dma_256"] == measured.batching_summary(new)[batching[-1]["dir"]]["dma"][256]
    single = measured.single_copy_rows(new)
    assert [r["kib"] for r in single] == [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert single[3]["h2d"] == measured.link_value(new, "dma_per_block", "h2d", 32 << 10, 1)
    eager = {r["path"]: r for r in measured.eager_rows(new)}
    assert set(eager) == set(measured.PATHS)
    assert eager["sm"]["frac_eager"] == measured.link_value(new, "sm", "h2d", 32 << 10, 64, "frac_eager")
    beside = measured.by_run(runs, measured.beside_rows)
    assert len(beside) == sum(len(measured.beside_rows(r)) for r in runs)
    assert beside[-1] == {"run": measured.run_stamp(new), **measured.beside_rows(new)[-1]}
    b, o, names = measured.beside_overlap_series(runs)
    assert b[-1] == measured.beside_rows(new) and o[0] == measured.overlap_rows(runs[0])
    assert names == [measured.run_name(r) for r in runs]


# ---- notebook 05: prefetch ------------------------------------------------------------------------------------
def test_pattern_traces_and_their_rows():
    traces = access.pattern_traces(64, 8, 16, window_tokens=32, topk=2, capture=None)
    assert list(traces) == ["full", "sliding window", "top-k"]
    assert traces["top-k"].scores is not None and traces["full"].scores is None
    rows = access.trace_rows(traces)
    assert rows[0] == {"pattern": "full", "trace": traces["full"].name, "steps": 8,
                       "reads_per_step": traces["full"].total_reads / 8, "blocks": 5, "block_size": 16}
    with pytest.raises(ValueError, match="true attention"):
        access.capture_summary(traces["full"])


def test_capture_summary():
    from workbench.model.capture import find

    tr = access.trace_from_capture(find("code"), 18, block_size=8, k=4)
    s = access.capture_summary(tr)
    assert s["covered"] == pytest.approx(sum(tr.covered) / len(tr)) and 0 < s["block_share"] < s["covered"] <= 1
    assert s["recall"] == pytest.approx(float(access.recall(tr).mean()))


def test_strategies_and_compare_traces():
    configs = prefetch.strategies(depth=8, window_tokens=64)
    assert list(configs) == list(prefetch.PREFETCH)
    assert configs["score"].depth == 8 and configs["sequential"].depth == 8 and configs["window"].window_tokens == 64
    assert prefetch.needs_scores("score") and prefetch.needs_scores(configs["score"])
    assert not any(prefetch.needs_scores(configs[n]) for n in ("none", "sequential", "window", "hot_lru", "hot_lfu"))
    traces = access.pattern_traces(64, 8, 16, window_tokens=32, topk=2, capture=None)
    link = LinkModel.default()
    rows = compare_traces(traces, configs, token_bytes=1024, device_blocks=3, compute_s=1e-4, link=link)
    assert [r["strategy"] for r in rows if r["pattern"] == "full"] == ["none", "sequential", "window", "hot_lru",
                                                                       "hot_lfu"]  # score: no scores on full
    top = [r for r in rows if r["pattern"] == "top-k"]
    assert [r["strategy"] for r in top] == list(configs)
    want = compare(traces["top-k"], configs.values(), block_bytes=16 * 1024, device_blocks=3, compute_s=1e-4,
                   link=link)
    for r, w in zip(top, want, strict=True):  # the same replays, keyed by the strategy's name
        assert {k: r[k] for k in w if k != "strategy"} == {k: v for k, v in w.items() if k != "strategy"}
    assert all(r["stall_ms"] == 1e3 * r["stall_s"] for r in rows)


# ---- notebook 05: swap or recompute ------------------------------------------------------------------------------
def test_swap_recompute_curves_table_and_crossover():
    link = LinkModel.default()
    rows = pc.swap_recompute_curves(["llama-7b"], 1024, link, (1, 16, 256))
    assert [(r["copies"], r["block_size"]) for r in rows] == [("layer", 1), ("layer", 16), ("layer", 256),
                                                              ("block", 1), ("block", 16), ("block", 256)]
    bpt = pc.model_bytes_per_token("llama-7b")
    k = pc.per_layer_transfers("llama-7b")
    want = pc.block_size_curve([16], 1024, bpt, link, pc.PrefillModel.for_model("llama-7b"), transfers_per_block=k)
    assert {key: rows[1][key] for key in want[0]} == want[0] and rows[1]["transfers_per_block"] == k
    table = pc.curve_table(rows)
    assert [(r["copies"], r["time"]) for r in table[:4]] == [
        (f"{k} x 8 KiB", "swap, copy by copy"), (f"{k} x 8 KiB", "swap, batched"), (f"{k} x 8 KiB", "recompute"),
        (f"{k} x 8 KiB", "faster")]
    assert table[4]["copies"] == "whole block" and table[2]["16"] == 1e3 * rows[1]["recompute_s"]
    assert table[3]["1"] in ("swap", "reco") and set(table[3]) == {"model", "copies", "time", "1", "16", "256"}
    curve = [{"model": "m", "copies": "layer", "block_size": b, "faster": f}
             for b, f in ((4, "swap"), (1, "recompute"), (2, "recompute"))]
    assert pc.crossover(curve, "m") == 4  # sorted by block size first
    assert pc.crossover([{**r, "faster": "swap"} for r in curve], "m") is None
    with pytest.raises(ValueError, match="no curve"):
        pc.crossover(curve, "m", "block")


# ---- notebook 05: the tiered cache ------------------------------------------------------------------------------
def test_tiered_cache_stats_line_and_moves():
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=8, num_pages=4, page_tokens=16, kv_dtype="fp16")
    tiers = TieredCache(cache, host_bytes=8 * block_bytes(cache, 16))
    assert describe_stats(tiers.stats()) == ("device:   0 slots in use, 0 cached blocks | host: 0 blocks | demoted 0, "
                                             "promoted from host 0")
    assert move_rows(tiers.stats()) == []
    k = torch.randn(1, 32, 1, 8, generator=torch.Generator().manual_seed(0)).half()
    tiers.add("a", list(range(32)), k, k)
    tiers.free("a")
    assert tiers.evict() == 2
    s = tiers.stats()
    assert describe_stats(s).endswith(f"host: {s['host']['blocks']} blocks | demoted 2, promoted from host 0")
    moves = move_rows(s)
    assert moves == [{"direction": "device->host", "bytes": s["moves"]["device->host"]["bytes"], "blocks": 2,
                      "batches": 1}]
    tiers.close()
