"""Serving simulator: traces, allocators, the step loop's invariants, Figure 2, the seed's table, the CLI."""

import json
import random
from dataclasses import dataclass, field

import numpy as np
import pytest

from workbench.commands import sim as sim_command
from workbench.sim import allocators, engine, fig2, metrics, seed_table
from workbench.sim import strategies as st
from workbench.sim import traces as tr
from workbench.sim.budget import kv_budget, slots_budget

ALL = list(st.STRATEGIES)


@pytest.fixture(scope="module")
def sharegpt():
    return tr.load("sharegpt")


@pytest.fixture(scope="module")
def small(sharegpt):
    return sharegpt.head(250)


# ---------------------------------------------------------------------------------------------- traces


@pytest.mark.parametrize("name, p_mean, o_mean", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45)])
def test_stored_traces_match_the_paper_means(name, p_mean, o_mean):
    t = tr.load(name)
    s = t.stats()
    assert len(t) == 10_000
    assert abs(s["prompt_mean"] - p_mean) < 0.01 and abs(s["output_mean"] - o_mean) < 0.01, s
    assert s["max_total"] <= 2048
    assert (tr.TRACE_DIR / f"{name}_synth.jsonl").stat().st_size < 1_000_000
    again = tr.generate(name)  # the file is the generator's output
    assert again.requests[:500] == t.requests[:500]


def test_generator_is_seeded_and_checks_input():
    a, b = tr.generate("alpaca", n=300, seed=3), tr.generate("alpaca", n=300, seed=3)
    assert a.requests == b.requests and a.requests != tr.generate("alpaca", n=300, seed=4).requests
    assert abs(tr.generate("sharegpt", n=2000, output_cv=0.7).stats()["output_cv"] - 0.7) < 1e-3
    with pytest.raises(ValueError, match="name"):
        tr.generate("lmsys")
    with pytest.raises(ValueError, match="output_cv"):
        tr.generate("sharegpt", output_cv=0)
    with pytest.raises(ValueError, match="trace must be"):
        tr.load("/no/such/trace.jsonl")


def test_load_reports_a_bad_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival_s": 0, "prompt": 3, "output": 4}\n{"arrival_s": 1, "prompt": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        tr.load(p)


def test_load_parses_a_file_once_until_it_changes(tmp_path):
    p = tmp_path / "t.jsonl"
    tr.save(tr.generate("alpaca", n=200, seed=5), p)
    a, b = tr.load(p), tr.load(str(p))
    assert a.requests is b.requests and a == b and len(a) == 200  # parsed once
    a.meta["note"] = 1
    assert "note" not in b.meta and b.meta == {"path": str(p)}  # each caller its own trace
    tr.save(tr.generate("alpaca", n=150, seed=6), p)  # rewritten: another size
    c = tr.load(p)
    assert len(c) == 150 and c.requests == tr.generate("alpaca", n=150, seed=6).requests


# ---------------------------------------------------------------------------------------------- allocators


@pytest.mark.parametrize("cls", [allocators.BuddyAllocator, allocators.FirstFitAllocator])
@pytest.mark.parametrize("total", [15728, 1000, 1 << 12])
def test_allocators_conserve_and_coalesce(cls, total):
    rng = random.Random(total)
    alloc = cls(total)
    live, used = [], 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            h = live.pop(rng.randrange(len(live)))
            used -= alloc.block_slots(h)
            alloc.release(h)
        else:
            h = alloc.alloc(rng.randint(1, 700))
            if h is not None:
                live.append(h)
                used += alloc.block_slots(h)
        assert alloc.count_free() + used == total == alloc.free_total + used
    spans = sorted((h[0], h[0] + alloc.block_slots(h)) for h in live)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "overlapping allocations"
    for h in live:
        alloc.release(h)
    assert alloc.count_free() == total
    assert alloc.alloc(total if cls is allocators.FirstFitAllocator else 1 << alloc.top) is not None  # fully merged


def test_buddy_splits_the_paper_pool_and_rounds_up():
    b = allocators.BuddyAllocator(15728)
    assert b.chunk_orders == [13, 12, 11, 10, 8, 6, 5, 4]
    handles = [b.alloc(2048) for _ in range(8)]
    assert sum(h is not None for h in handles) == 7  # Orca (Max) fits 7 requests in 15.7K slots
    assert b.unusable(2048) == 15728 - 7 * 2048
    b2 = allocators.BuddyAllocator(4096)
    assert b2.block_slots(b2.alloc(673)) == 1024  # 161 + 512 -> a 1024-slot block


# ---------------------------------------------------------------------------------------------- engine


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("name", ALL)
def test_invariants_every_step_under_memory_pressure(small, name, preemption):
    budget = slots_budget(4096, bytes_per_token=2)
    res = engine.run(small, name, budget, preemption=preemption, check=True)
    assert res.completed + res.rejected == len(small) and res.rejected == 0
    parts = np.stack([res.series(k) for k in metrics.PARTS])  # [6, steps]
    assert (parts.sum(axis=0) == budget.slots).all(), "memory not conserved"
    assert (parts >= 0).all()
    # every request generates exactly `output` tokens: a preempted step produces no token
    assert res.series("batch").sum() == sum(r.output for r in small.requests)
    assert (res.finish_step >= 0).all()
    cfg = st.get(name)
    if isinstance(cfg, st.Paged) and not cfg.prealloc:  # on demand: waste < one block per request
        waste = res.series("reservation") + res.series("internal")
        assert (waste < np.maximum(res.series("batch"), 1) * cfg.block_size).all()
    if preemption == "swap" and res.preemptions:
        assert res.swapped_bytes > 0 and res.recomputed_tokens == 0
    if preemption == "recompute" and res.preemptions:
        assert res.recomputed_tokens > 0 and res.swapped_bytes == 0


@pytest.mark.parametrize("name", ALL)
def test_all_strategies_complete_everything_given_enough_memory(small, name):
    res = engine.run(small, name, kv_budget("llama-13b", kv_gib=400), check=True)
    assert res.completed == len(small) and res.preemptions == 0
    # all 250 start at step 0, so the run lasts as long as the longest output
    assert res.steps == max(r.output for r in small.requests)
    capped = engine.run(small, name, kv_budget("llama-13b", kv_gib=4), max_steps=300)
    assert capped.steps == 300 and capped.summary()["completion_rate"] < 1


def test_orca_max_holds_seven_requests_in_the_paper_pool(sharegpt):
    res = engine.run(sharegpt.head(300), "orca-max", fig2.paper_budget())
    assert res.mean_batch(saturated=True) == 7.0
    avg = res.average(saturated=True)
    assert avg.external == 15728 - 7 * 2048 and avg.slack == 0


def test_time_average_equals_the_mean_of_the_per_step_series(small):
    res = engine.run(small, "orca-pow2", slots_budget(6000))
    avg = res.average()
    for k in metrics.PARTS:
        assert getattr(avg, k) == pytest.approx(res.series(k).mean(), rel=1e-12, abs=1e-9)
    assert avg.residual() == pytest.approx(0, abs=1e-6)


def test_timed_arrivals_start_no_request_early(small):
    step_s = 0.05
    res = engine.run(small, "vllm", slots_budget(20000), step_s=step_s)
    arrive = np.array([int(r.arrival_s // step_s) for r in small.requests])
    out = np.array([r.output for r in small.requests])
    assert (res.finish_step >= arrive + out - 1).all()


def test_compaction_and_preallocation_change_memory_as_described(small):
    budget = slots_budget(6000)
    adaptive = engine.run(small, "paged-adaptive", budget, check=True)
    compact = engine.run(small, "paged-compact", budget, check=True)
    assert compact.copied_tokens > 0 and adaptive.copied_tokens == 0
    on_demand = engine.run(small, "paged", budget).average()
    pre = engine.run(small, "paged-prealloc", budget, check=True).average()
    assert pre.reservation + pre.internal > on_demand.reservation + on_demand.internal


@dataclass(frozen=True)
class _Spy(st.PagedAdaptive):
    """Adaptive blocks that keep the managers they build, to read their conversion counts."""

    built: list = field(default_factory=list, compare=False, repr=False)

    def build(self, slots):
        mgr = super().build(slots)
        self.built.append(mgr)
        return mgr


def test_a_rehomed_request_grows_in_small_blocks_and_is_converted_once():
    # one request: 16-slot blocks to 128 tokens, a 64-slot block at token 129 (step 118); compaction at step 128
    # finds 11 tokens in it (< 32) and moves them to one 16-slot block; it then grows in 16-slot blocks
    t = tr.Trace("one", (tr.Request(0, 0.0, 10, 600),))
    cfg = _Spy(compact_every=16)
    res = engine.run(t, cfg, slots_budget(4096), check=True)
    assert cfg.built[0].conversions == 1 and res.copied_tokens == 11
    waste = (res.series("reservation") + res.series("internal"))[128:]  # [steps - 128]
    assert res.completed == 1 and waste.max() < 16, waste.max()


@pytest.mark.parametrize("slots", [4096, 6000])
def test_periodic_compaction_converts_each_request_at_most_once_and_never_lowers_the_token_share(small, slots):
    budget = slots_budget(slots)
    none = engine.run(small, st.PagedAdaptive(), budget).average(saturated=True).token
    for every in (16, 32, 64):
        cfg = _Spy(compact_every=every)
        res = engine.run(small, cfg, budget, check=every == 32)
        conversions = cfg.built[0].conversions
        token = res.average(saturated=True).token
        assert conversions <= len(small), (every, conversions)
        assert token >= none, f"compact every {every}: token share {token / slots:.4f} < {none / slots:.4f} without"
        assert res.completed == len(small)


def test_run_rejects_bad_input(small):
    with pytest.raises(ValueError, match="strategy"):
        engine.run(small, "lru")
    with pytest.raises(ValueError, match="preemption"):
        engine.run(small, "vllm", preemption="drop")
    with pytest.raises(ValueError, match="max_batch"):
        engine.run(small, "vllm", max_batch=0)
    with pytest.raises(ValueError, match="block_size"):
        st.Paged(block_size=0)
    with pytest.raises(ValueError, match="allocator"):
        st.Contiguous("max", "slab")
    with pytest.raises(ValueError, match="kv_gib"):
        kv_budget("llama-7b", kv_gib=-1)
    with pytest.raises(ValueError, match="model"):
        kv_budget("gpt-5", 80)


def test_requests_that_can_never_fit_are_rejected_not_looped():
    t = tr.Trace("t", (tr.Request(0, 0.0, 100, 3000), tr.Request(1, 0.0, 10, 10)))
    res = engine.run(t, "vllm", slots_budget(64), check=True)
    assert res.rejected == 1 and res.completed == 1  # 3100 > max_len 2048
    res = engine.run(tr.uniform(2, 100, 100), "orca-oracle", slots_budget(150))
    assert res.rejected == 2 and res.completed == 0  # 200 slots never fit in 150


# ---------------------------------------------------------------------------------------------- fig2 / seed table / CLI


def test_fig2_is_within_five_points_of_the_paper():
    d = fig2.breakdown()
    assert d["within_5pp"], fig2.format_table(d)
    assert d["systems"]["Orca (Max)"]["mean_batch"] == 7.0


def test_fig2_cli_json_shape(capsys):
    assert sim_command.main(["fig2", "--json", "--requests", "300"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) >= {"setup", "systems", "max_abs_diff_pp", "within_5pp"}
    assert list(d["systems"]) == ["Orca (Max)", "Orca (Pow2)", "Orca (Oracle)", "vLLM"]
    for v in d["systems"].values():
        assert set(v) >= {"token_states", "reservation", "internal", "external", "detail", "mean_batch", "paper",
                          "diff_pp"}
        assert sum(v[k] for k in fig2.KEYS) == pytest.approx(100, abs=0.05)
        assert sum(v["detail"].values()) == pytest.approx(100, abs=0.05)


def test_seed_table(capsys):
    d = seed_table.table(16)
    r512, r1024, r2048 = d["rows"]
    assert r512["paged_gb"] == pytest.approx(16 * 512 * 512 * 1024 / 1e9, abs=0.01)
    assert not r1024["contiguous_reserve_max_oom"] and not r2048["contiguous_reserve_max_oom"]
    assert r512["sim"]["paged"]["peak_gb"] == r512["paged_gb"]
    assert r512["sim"]["contiguous_reserve_max"]["peak_gb"] == r512["contiguous_reserve_max_gb"]
    assert len(d["verdicts"]) == 4
    assert sim_command.main(["seed-table", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["model"] == "llama-7b"


@pytest.mark.parametrize("argv, needle", [
    ([], "command"),
    (["plot"], "invalid choice"),
    (["fig2", "--requests", "0"], "--requests"),
    (["fig2", "--allocator", "slab"], "--allocator"),
    (["fig2", "--trace", "/no/such.jsonl"], "trace must be"),
    (["seed-table", "--batch", "many"], "--batch"),
    (["run", "--strategy", "lru"], "strategy must be"),
    (["run", "--kv-gib", "-2"], "--kv-gib"),
    (["run", "--kv-gib", "2", "--gpu-gib", "80"], "not both"),
    (["run", "--strategy", "orca-max", "--block-size", "8"], "no option"),
])
def test_cli_bad_input_returns_2_with_a_message(capsys, argv, needle):
    assert sim_command.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_cli_run_prints_a_summary(capsys):
    argv = ["run", "--strategy", "paged-prealloc", "--trace", "alpaca", "--requests", "300", "--json"]
    assert sim_command.main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["completed"] == 300 and 0 < s["throughput_req_per_step"] and s["completion_rate"] == 1.0


def test_a_10k_trace_runs_in_seconds(sharegpt):
    import time

    t0 = time.perf_counter()
    res = engine.run(sharegpt, "paged-compact")
    assert res.completed == 10_000
    assert time.perf_counter() - t0 < 20  # ~1 s here; generous for slow CI machines
