"""Prefetch strategies, access traces and the tier replay (workbench.tiers.access / prefetch / replay).

The hand-computed cases use a flat link (1 GB/s host -> device whatever the size, 0.5 GB/s disk reads) and
1 MB blocks, so a block costs 1 ms from the host and 2 ms more from disk; a step computes 1.5 ms.
"""

import dataclasses
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from workbench.tiers import prefetch
from workbench.tiers.access import (
    AccessTrace,
    capture_summary,
    full_trace,
    pattern_traces,
    recall,
    sliding_window_trace,
    topk_trace,
    trace_from_capture,
    trace_rows,
    window_blocks,
)
from workbench.tiers.host import HostPool, contiguous_runs
from workbench.tiers.link import LinkModel, latest_link_model
from workbench.tiers.prefetch import PREFETCH, FutureAccessError, PrefetchContext, PrefetchState, TraceView
from workbench.tiers.replay import DIRECTIONS, compare, compare_traces, replay

MS = 1e-3
FLAT = LinkModel({("dma", "h2d"): ((1, 1.0),), ("dma", "d2h"): ((1, 1.0),),
                  ("disk", "read"): ((1, 0.5),), ("disk", "write"): ((1, 0.5),)}, source="flat test link")
BLOCK = 1_000_000
CFG = dict(block_bytes=BLOCK, compute_s=1.5 * MS, link=FLAT)
ACTIVATIONS = Path(__file__).resolve().parents[1] / "data" / "activations"


def hand(steps, n_blocks, scores=None) -> AccessTrace:
    """A hand-written trace: block size 1, every block of step 0 on the host before the trace."""
    return AccessTrace("hand", 1, steps, (n_blocks,) * len(steps), scores)


SCAN = hand([(0, 1), (2, 3), (4, 5)], 6, scores=[(0, 0, 9, 8, 0, 0), (0, 0, 0, 0, 9, 8), (0,) * 6])


# ---- hand-computed replays -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy, hits, misses, stall_ms, prefetched", [
    ("none", 0, 6, 6.0, 0),
    ("hot_lru", 0, 6, 6.0, 0),
    ("hot_lfu", 0, 6, 6.0, 0),  # every count is 1: LFU falls back to LRU
    # after step 0: prefetch 2, 3 (2 ms, 0.5 ms beyond the compute); after step 1: 4, 5 (again 0.5 ms)
    (prefetch.get("sequential", depth=2), 4, 2, 2.0 + 0.5 + 0.5, 4),
    (prefetch.get("score", depth=2), 4, 2, 2.0 + 0.5 + 0.5, 4),  # step t's scores name step t + 1's blocks
    # one block ahead (1 ms, hidden by the compute): 2 then 4 hit, 3 and 5 miss (1 ms each)
    (prefetch.get("score", depth=1), 2, 4, 2.0 + 1.0 + 1.0, 2),
])
def test_scan_of_six_blocks_on_a_two_block_device(strategy, hits, misses, stall_ms, prefetched):
    r = replay(SCAN, strategy, device_blocks=2, **CFG)
    assert (r.hits, r.misses, r.prefetched, r.prefetch_used, r.prefetch_wasted) == (hits, misses, prefetched,
                                                                                    prefetched, 0)
    assert r.stall_s == pytest.approx(stall_ms * MS)
    assert r.total_s == pytest.approx(3 * 1.5 * MS + stall_ms * MS)
    assert r.bytes_moved == {"h2d": 6 * BLOCK, "d2h": 0, "disk_read": 0, "disk_write": 0}


def test_sequential_scan_per_step_and_timeline():
    r = replay(SCAN, prefetch.get("sequential", depth=2), device_blocks=2, **CFG)
    assert r.column("demand_s") == pytest.approx([2 * MS, 0, 0])
    assert r.column("overhang_s") == pytest.approx([0, 0.5 * MS, 0.5 * MS])
    assert list(r.column("prefetched")) == [2, 2, 0]
    kinds = [(i.step, i.kind, i.blocks) for i in r.timeline]
    assert kinds == [(0, "demand", 2), (0, "compute", 2), (0, "prefetch", 2), (1, "compute", 2),
                     (1, "prefetch", 2), (2, "compute", 2)]
    compute1 = r.timeline[3]
    assert compute1.start_s == pytest.approx(2 * MS + 1.5 * MS + 0.5 * MS)  # waits for the prefetch's tail
    assert r.timeline[2].start_s == pytest.approx(2 * MS)  # the prefetch starts with step 0's compute


@pytest.mark.parametrize("strategy, hits, misses", [("none", 2, 6), ("hot_lru", 2, 6), ("hot_lfu", 4, 4)])
def test_lfu_keeps_the_hot_blocks_a_cold_pair_would_push_out(strategy, hits, misses):
    # 0 and 1 are read twice, 2 and 3 once in between: LRU drops 0 and 1 for them, LFU drops 2 and 3 after use
    r = replay(hand([(0, 1), (0, 1), (2, 3), (0, 1)], 4), strategy, device_blocks=2, **CFG)
    assert (r.hits, r.misses) == (hits, misses)
    assert r.stall_s == pytest.approx(misses * MS)


def test_sliding_window_contents_exact():
    # 5 prompt tokens, blocks of 2, window 3 tokens, 2 sink tokens; step t holds 6 + t tokens
    tr = sliding_window_trace(5, 3, 2, window_tokens=3, sink_tokens=2)
    assert tr.steps == ((0, 1, 2), (0, 2, 3), (0, 2, 3))  # tokens 3-5 / 4-6 / 5-7 plus sink block 0
    assert tr.num_blocks == (3, 4, 4) and tr.prompt_blocks == 3 and tr.tokens(2) == 8


@pytest.mark.parametrize("strategy, device, hits, misses, prefetched", [
    ("none", 3, 6, 3, 0),  # cold start, then the window fits; block 3 is born on the device at step 1
    ("none", 2, 4, 5, 0),  # step 0 streams 3 blocks and keeps 1, 2; the sink misses at steps 1 and 2
    # the window rule drops block 1 (left the window) at once, so step 1 hits all; it refetches the sink
    # under step 1's compute, at the price of block 2 (step 2's only miss)
    (prefetch.get("window", window_tokens=3, sink_tokens=2), 2, 5, 4, 1),
])
def test_window_strategy_on_a_small_sliding_window(strategy, device, hits, misses, prefetched):
    tr = sliding_window_trace(5, 3, 2, window_tokens=3, sink_tokens=2)
    r = replay(tr, strategy, device_blocks=device, **CFG)
    assert (r.hits, r.misses, r.born, r.prefetched, r.prefetch_used) == (hits, misses, 1, prefetched, prefetched)
    assert r.stall_s == pytest.approx(misses * MS)  # one block a miss, prefetches hidden by the compute
    assert r.bytes_moved["h2d"] == (misses + prefetched) * BLOCK


def test_disk_tier_hand_computed():
    # host holds 2 of the 4 prompt blocks (the newest: 2, 3); 0, 1 are on disk
    tr = hand([(0, 1), (2, 3)], 4)
    r = replay(tr, "none", device_blocks=2, host_blocks=2, **CFG)
    # each step: 2 blocks from disk (2 x 2 ms) then host -> device (2 x 1 ms); landing on the host, 0 and 1 push
    # 2 and 3 to disk (written once), then 2 and 3 come back from disk
    assert r.stall_s == pytest.approx(12 * MS)
    assert r.bytes_moved == {"h2d": 4 * BLOCK, "d2h": 0, "disk_read": 4 * BLOCK, "disk_write": 2 * BLOCK}
    assert list(r.column("disk_blocks")) == [2, 2]
    everything_on_host = replay(tr, "none", device_blocks=2, **CFG)
    assert everything_on_host.stall_s == pytest.approx(4 * MS) and everything_on_host.bytes_moved["disk_read"] == 0


def test_blocks_written_on_the_device_are_written_back_once_evicted():
    # prompt of 2 tokens in blocks of 1: blocks 2, 3, 4 are opened by steps 0, 1, 2 (born on the device)
    tr = AccessTrace("born", 1, [(2,), (3,), (0, 4)], (3, 4, 5), prompt_tokens=2)
    r = replay(tr, "none", device_blocks=1, **CFG)
    assert (r.hits, r.misses, r.born) == (3, 1, 3)  # only block 0 (a prompt block) comes from the host
    assert r.bytes_moved == {"h2d": BLOCK, "d2h": BLOCK, "disk_read": 0, "disk_write": 0}  # block 2 evicted
    assert r.stall_s == pytest.approx(1 * MS)


def test_prefetched_but_unused_blocks_are_waste():
    r = replay(hand([(0,), (5,)], 6), prefetch.get("sequential", depth=2), device_blocks=4, **CFG)
    assert (r.prefetched, r.prefetch_used, r.prefetch_wasted) == (2, 0, 2)  # 1, 2 never read: waste at the end
    assert r.stall_s == pytest.approx((1 + 0.5 + 1) * MS)
    # evicted before use: block 1 (prefetched after step 0) goes when step 1 brings in 3
    r = replay(hand([(0,), (3,), (1,)], 4), prefetch.get("sequential", depth=1), device_blocks=1, **CFG)
    assert (r.misses, r.prefetched, r.prefetch_wasted) == (3, 1, 1)
    assert list(r.column("prefetch_wasted")) == [0, 1, 0]


# ---- accounting identities, determinism, speed ---------------------------------------------------------------------
TRACES = {
    "topk": lambda: topk_trace(200, 120, 16, 4, drift=0.2, seed=3),
    "window": lambda: sliding_window_trace(100, 120, 16, window_tokens=64),
    "full": lambda: full_trace(150, 60, 16),
}
CONFIGS = [dict(device_blocks=6), dict(device_blocks=12, host_blocks=5), dict(device_blocks=3, batched=False),
           dict(device_blocks=8, path="sm", compute_s=0.0)]


@pytest.mark.parametrize("trace_name", sorted(TRACES))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_accounting_identities(trace_name, config):
    tr = TRACES[trace_name]()
    config = {"block_bytes": 256 << 10, "compute_s": 30e-6, **config}
    names = [n for n in PREFETCH if n != "score" or tr.scores is not None]
    for name in names:
        r = replay(tr, name, **config)
        bb = config["block_bytes"]
        assert r.hits + r.misses == r.reads == tr.total_reads
        assert r.prefetched == r.prefetch_used + r.prefetch_wasted
        assert r.bytes_moved["h2d"] == (r.misses + r.prefetched) * bb
        assert r.bytes_moved["disk_read"] == r.column("disk_blocks").sum() * bb
        assert set(r.bytes_moved) == set(DIRECTIONS) and all(v % bb == 0 for v in r.bytes_moved.values())
        if config.get("host_blocks") is None:
            assert r.bytes_moved["disk_read"] == r.bytes_moved["disk_write"] == 0
        for col, total in (("hits", r.hits), ("misses", r.misses), ("born", r.born), ("prefetched", r.prefetched),
                           ("prefetch_wasted", r.prefetch_wasted)):
            assert r.column(col).sum() == total, col
        assert r.total_s == pytest.approx(len(tr) * config["compute_s"] + r.stall_s)
        assert r.stall_s == pytest.approx(r.column("stall_s").sum())
        computes = [i for i in r.timeline if i.kind == "compute"]
        assert len(computes) == len(tr) and computes[-1].end_s == pytest.approx(r.total_s)
        assert all(a.end_s <= b.start_s + 1e-15 for a, b in pairwise(computes))
        assert 0.0 <= r.hit_rate <= 1.0 and r.row()["strategy"] == name


def test_replay_is_deterministic_and_generators_are_seeded():
    tr = topk_trace(300, 80, 16, 4, seed=7)
    assert tr == topk_trace(300, 80, 16, 4, seed=7) and tr != topk_trace(300, 80, 16, 4, seed=8)
    for name in PREFETCH:
        kw = dict(device_blocks=7, host_blocks=10, block_bytes=64 << 10, compute_s=25e-6)
        assert replay(tr, name, **kw) == replay(tr, name, **kw)


def test_batching_transfers_cuts_the_stall():
    tr = full_trace(256, 40, 16)  # small blocks (16 KiB): one copy each is far below the link's speed
    kw = dict(device_blocks=4, block_bytes=16 << 10, compute_s=20e-6, link=LinkModel.default())
    batched, single = replay(tr, "none", **kw), replay(tr, "none", batched=False, **kw)
    assert batched.misses == single.misses and batched.stall_s < single.stall_s / 5


def test_a_2000_step_trace_of_256_blocks_replays_fast():
    tr = topk_trace(4096 - 2000, 2000, 16, 16, drift=0.2)
    assert tr.num_blocks[-1] == 256
    for name in ("none", "score"):
        start = time.perf_counter()
        replay(tr, name, device_blocks=32, block_bytes=64 << 10, compute_s=20e-6)
        assert time.perf_counter() - start < 2.0, name  # ~0.05-0.35 s here; loose for a busy 2-core machine


# ---- generators --------------------------------------------------------------------------------------------------
def test_full_trace_reads_every_block():
    tr = full_trace(30, 5, 8)
    assert tr.num_blocks == (4, 4, 5, 5, 5) and tr.steps[2] == (0, 1, 2, 3, 4) and tr.pattern == "full"


def test_sliding_window_invariants():
    tr = sliding_window_trace(1000, 50, 16, window_tokens=100, sink_tokens=20)
    for t, (reads, n) in enumerate(zip(tr.steps, tr.num_blocks, strict=True)):
        assert list(reads) == sorted(set(reads)) and reads[-1] == n - 1
        assert {0, 1} <= set(reads)  # 20 sink tokens: blocks 0 and 1
        first = (1000 + t + 1 - 100) // 16
        assert set(reads) == {0, 1} | set(range(first, n))


def test_topk_invariants_and_locality():
    k, recent = 5, 2
    tr = topk_trace(400, 60, 16, k, recent=recent, drift=0.05, seed=1)
    for reads, n, scores in zip(tr.steps, tr.num_blocks, tr.scores, strict=True):
        assert list(reads) == sorted(set(reads)) and 0 <= reads[0] and reads[-1] < n and len(scores) == n
        forced = {0} | set(range(n - recent, n))
        assert forced <= set(reads) and len(reads) <= k + len(forced)
        chosen = set(reads) - forced
        others = [s for b, s in enumerate(scores) if b not in forced and b not in chosen]
        assert len(chosen) == k and min(scores[b] for b in chosen) >= max(others)  # the top-k by the bound

    def overlap(trace):
        return np.mean([len(set(a) & set(b)) / len(set(a) | set(b)) for a, b in pairwise(trace.steps)])

    assert overlap(tr) > 0.8 > 0.5 > overlap(topk_trace(400, 60, 16, k, recent=recent, drift=1.0, seed=1))
    bare = topk_trace(400, 10, 16, k, sink=False, recent=0)
    assert all(len(s) == k for s in bare.steps)


# ---- no future leakage -------------------------------------------------------------------------------------------
def test_the_view_refuses_what_is_not_known_yet():
    tr = topk_trace(64, 6, 8, 2)
    view = TraceView(tr, 2)
    assert view.reads(2) == tr.steps[2] and view.scores(0) == tr.scores[0] and view.num_blocks(3) == tr.num_blocks[3]
    for ask in (lambda: view.reads(3), lambda: view.scores(3), lambda: view.num_blocks(4), lambda: view.tokens(4),
                lambda: view.reads(-1)):
        with pytest.raises(FutureAccessError):
            ask()

    class Cheat(PrefetchState):
        def plan(self, step, view):
            return list(view.reads(step + 1))

    with pytest.raises(FutureAccessError, match="not known after step 0"):
        replay(tr, Cheat(), device_blocks=2, **CFG)


class Recorder(PrefetchState):
    """Wraps a built strategy and records its plans."""

    def __init__(self, inner):
        self.inner, self.plans = inner, []

    def observe(self, step, reads):
        self.inner.observe(step, reads)

    def plan(self, step, view):
        self.plans.append(list(self.inner.plan(step, view)))
        return self.plans[-1]

    def eviction_order(self, resident, view):
        return self.inner.eviction_order(resident, view)


@pytest.mark.parametrize("name", ["none", "sequential", "score"])
def test_plans_up_to_a_step_do_not_depend_on_later_steps(name):
    base = topk_trace(120, 10, 8, 3, drift=0.3, seed=5)
    # the same through step 3; afterwards every step reads everything and the scores are reversed
    later = tuple(tuple(range(n)) for n in base.num_blocks[4:])
    other = dataclasses.replace(base, steps=base.steps[:4] + later,
                                scores=base.scores[:4] + tuple(s[::-1] for s in base.scores[4:]))
    plans, results = [], []
    for tr in (base, other):
        cfg = prefetch.get(name)
        rec = Recorder(cfg.build(PrefetchContext(tr.block_size, 4, True)))
        results.append(replay(tr, rec, device_blocks=4, **CFG))
        plans.append(rec.plans)
    assert plans[0][:4] == plans[1][:4]  # plan(t) is made after step t: steps 0-3 agree
    assert results[0].per_step[:4] == results[1].per_step[:4]
    if name == "score":
        assert plans[0][4:] != plans[1][4:]  # the test has teeth: later plans follow the later scores


# ---- the capture-based trace (real SmolLM2 attention) --------------------------------------------------------------
needs_captures = pytest.mark.skipif(not sorted(ACTIVATIONS.glob("*.npz")),
                                    reason=f"no SmolLM2 captures in {ACTIVATIONS} (python -m workbench capture)")


@needs_captures
def test_quest_bound_on_real_attention_covers_what_attention_needs():
    from workbench.model.capture import load

    caps = load(ACTIVATIONS)
    covered, share, set_recall = [], [], []
    for cap in caps:
        for layer in (6, 18, 29):
            tr = trace_from_capture(cap, layer, block_size=8, k=4)
            assert len(tr) == 16 and tr.prompt_tokens == len(cap.tokens) - 16 and tr.pattern == "capture"
            assert all(n for n in tr.needed) and all(max(s) == 0.0 for s in tr.scores)  # a head's best block: 0
            covered.append(np.mean(tr.covered))
            share.append(np.mean([len(s) / n for s, n in zip(tr.steps, tr.num_blocks, strict=True)]))
            set_recall.append(recall(tr).mean())
    covered, share, set_recall = map(np.asarray, (covered, share, set_recall))
    # a random choice of as many blocks covers `share` of the attention on average; the bound covers far more
    assert covered.mean() > 0.75 and covered.mean() > share.mean() + 0.3 and (covered > share + 0.05).all()
    assert set_recall.mean() > share.mean() + 0.1


@needs_captures
def test_capture_trace_by_name_and_replayable():
    from workbench.model.capture import find

    tr = trace_from_capture(find("code", ACTIVATIONS), 18, 16, 2)
    assert tr.name.startswith("code L18")
    r = replay(tr, "score", device_blocks=4, **CFG)
    assert r.hits + r.misses == tr.total_reads


def test_capture_trace_without_files_says_so(tmp_path):
    from workbench.model.capture import find

    with pytest.raises(FileNotFoundError, match="no SmolLM2 captures"):
        find(0, tmp_path)
    with pytest.raises(ValueError, match="capture must be a workbench.model.capture.Capture"):
        trace_from_capture("code", 6, 16, 4)  # a name: the caller finds the capture (the tiers read no model files)


# ---- registry, compare, bad arguments ----------------------------------------------------------------------------
def test_registry_names_and_overrides():
    assert sorted(PREFETCH) == ["hot_lfu", "hot_lru", "none", "score", "sequential", "window"]
    for name, cfg in PREFETCH.items():
        assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen and hash(cfg) is not None
        assert prefetch.get(name) is cfg and isinstance(cfg.label, str) and cfg.label
    assert prefetch.get("window", window_tokens=64).window_tokens == 64
    assert prefetch.get("sequential", depth=8) == prefetch.Sequential(8)


def test_compare_one_row_per_strategy():
    tr = sliding_window_trace(200, 30, 16, window_tokens=64)
    rows = compare(tr, ["none", prefetch.get("window", window_tokens=64)], device_blocks=4, **CFG)
    assert [r["strategy"] for r in rows] == ["none", "window (64 + 4 sinks)"]
    assert [r["strategy"] for r in compare(tr, None, device_blocks=4, **CFG)] == [n for n in PREFETCH if n != "score"]
    assert rows[0]["total_s"] == pytest.approx(30 * CFG["compute_s"] + rows[0]["stall_s"])


SMALL = hand([(0, 1), (1, 2)], 3)


class BadPlan(PrefetchState):
    def plan(self, step, view):
        return [99]


class BadOrder(PrefetchState):
    def eviction_order(self, resident, view):
        return resident[:1]


@pytest.mark.parametrize("call, argument", [
    (lambda: full_trace(-1, 3, 16), "prompt_tokens"),
    (lambda: full_trace(0, 0, 16), "steps"),
    (lambda: full_trace(0, 3, 0), "block_size"),
    (lambda: sliding_window_trace(10, 3, 4, 0), "window_tokens"),
    (lambda: sliding_window_trace(10, 3, 4, 8, sink_tokens=-1), "sink_tokens"),
    (lambda: topk_trace(10, 3, 4, 0), "k"),
    (lambda: topk_trace(10, 3, 4, 2, drift=1.5), "drift"),
    (lambda: topk_trace(10, 3, 4, 2, recent=-1), "recent"),
    (lambda: topk_trace(10, 3, 4, 2, sink="yes"), "sink"),
    (lambda: AccessTrace("x", 1, [(1, 0)], (2,)), "steps"),
    (lambda: AccessTrace("x", 1, [(0,), (0,)], (2,)), "num_blocks"),
    (lambda: AccessTrace("x", 1, [(0,)], (2,), scores=[(1.0,)]), "scores"),
    (lambda: replay(SMALL, "none", device_blocks=0, **CFG), "device_blocks"),
    (lambda: replay(SMALL, "none", device_blocks=2, block_bytes=0, compute_s=0.0), "block_bytes"),
    (lambda: replay(SMALL, "none", device_blocks=2, block_bytes=1, compute_s=-1.0), "compute_s"),
    (lambda: replay(SMALL, "none", device_blocks=2, host_blocks=-1, **CFG), "host_blocks"),
    (lambda: replay(SMALL, "none", device_blocks=2, host_blocks=2, disk=False, **CFG), "host_blocks"),
    (lambda: replay(SMALL, "none", device_blocks=2, path="pcie", **CFG), "path"),
    (lambda: replay(SMALL, "none", device_blocks=2, batched="yes", **CFG), "batched"),
    (lambda: replay(SMALL.steps, "none", device_blocks=2, **CFG), "trace"),
    (lambda: replay(SMALL, "none", device_blocks=2, block_bytes=1, compute_s=0.0, link="fast"), "link"),
    (lambda: replay(SMALL, "nope", device_blocks=2, **CFG), "prefetch must be one of"),
    (lambda: replay(SMALL, "score", device_blocks=2, **CFG), "score"),  # no scores in the trace
    (lambda: replay(SMALL, BadPlan(), device_blocks=2, **CFG), "plan"),
    (lambda: replay(SMALL, BadOrder(), device_blocks=1, **CFG), "eviction_order"),
    (lambda: prefetch.get("sequential", depth=0), "depth"),
    (lambda: prefetch.get("window", window_tokens=0), "window_tokens"),
    (lambda: prefetch.HotSet("mru"), "policy"),
    (lambda: prefetch.get("sequential", nope=1), "no option"),
    # issue 30 item 4: every public argument of workbench.tiers named in its error
    (lambda: FLAT.seconds("1 MB"), "nbytes"),
    (lambda: FLAT.gbps(-1), "nbytes"),
    (lambda: FLAT.batch_seconds(0, 3), "block_bytes"),
    (lambda: FLAT.batch_seconds(10, -1), "blocks"),
    (lambda: FLAT.batch_seconds(10, 2, batched="no"), "batched"),
    (lambda: latest_link_model(3), "results_dir"),
    (lambda: window_blocks(-1, 4, 8, 0), "tokens"),
    (lambda: window_blocks(10, 0, 8, 0), "block_size"),
    (lambda: window_blocks(10, 4, 0, 0), "window_tokens"),
    (lambda: window_blocks(10, 4, 8, -2), "sink_tokens"),
    (lambda: pattern_traces(10, 3, topk=0, capture=None), "topk"),
    (lambda: pattern_traces(10, 3, capture_topk=0), "capture_topk"),
    (lambda: SMALL.tokens(len(SMALL)), "step"),
    (lambda: recall(3), "trace"),
    (lambda: trace_rows([SMALL]), "traces"),
    (lambda: capture_summary("trace"), "trace"),
    (lambda: compare(SMALL, 3, device_blocks=2, **CFG), "strategies"),
    (lambda: compare_traces({"a": SMALL}, {"none": "none"}, token_bytes=0, device_blocks=2), "token_bytes"),
    (lambda: compare_traces([SMALL], {"none": "none"}, token_bytes=1, device_blocks=2), "traces"),
    (lambda: HostPool(640, 64, pin=False).allocate("ab"), "sizes"),
    (lambda: HostPool(640, 64, pin=False).view(9, 2), "start and units"),
    (lambda: contiguous_runs([0, 1], [1, 1, 1]), "sizes"),
])
def test_bad_arguments_name_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


@needs_captures
def test_a_saved_capture_is_found_by_name_or_index_and_bad_ones_are_refused():
    from workbench.model.capture import find, load

    caps = load(ACTIVATIONS)
    by_name = find(caps[1].name, ACTIVATIONS)
    assert by_name.name == caps[1].name and find(-1, ACTIVATIONS).name == caps[-1].name
    assert find(by_name) is by_name  # a Capture passes through
    for bad in ("no-such-prompt", len(caps), True, 1.0):
        with pytest.raises(ValueError, match="capture must be"):
            find(bad, ACTIVATIONS)
