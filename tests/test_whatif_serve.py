"""The what-if's serving simulator (issue 35): conservation (every request finishes once, its tokens all
generated), memory never above the budget, the knobs move the outputs the right way (more memory or fewer bytes
a token: more concurrency; swap instead of recompute: nothing recomputed; a shared prefix: hits), bad knobs
refused, and a 1,000-request trace in under 2 s."""

import time

import numpy as np
import pytest

from workbench.sim.traces import Request, Trace, generate
from workbench.whatif import models
from workbench.whatif.profile import GpuProfile
from workbench.whatif.serve import Knobs, kv_blocks, simulate
from workbench.whatif.step_time import StepModel, fit_layer_overhead

CFG = models.PRESETS["llama-3.1-8b"]


@pytest.fixture(scope="module")
def profile():
    return fit_layer_overhead(GpuProfile.from_results(), models.PRESETS["smollm2-135m"])


@pytest.fixture(scope="module")
def busy():
    return generate("sharegpt", n=300, seed=3, rate=500.0)  # arrivals far faster than service: memory-bound


def _check(res, trace):
    s = res.summary()
    assert s["completed"] + s["rejected"] == len(trace)
    done = ~np.isnan(res.finish)
    assert (res.first_token[done] >= res.arrival[done]).all() and (res.finish[done] >= res.first_token[done]).all()
    assert res.timeline[1].max() <= res.kv_blocks and (np.diff(res.timeline[0]) >= 0).all()
    return s


def test_a_light_trace_runs_without_preemption_and_matches_its_tokens(profile):
    tr = generate("alpaca", n=200, seed=1, rate=5.0)
    s = _check(simulate(tr, StepModel(profile, CFG), Knobs()), tr)
    assert s["completed"] == 200 and s["preemptions"] == 0
    assert s["ttft_p50_s"] < 0.1 and 0 < s["tpot_p50_s"] < 0.05


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_memory_bound_trace_preempts_and_still_finishes(profile, busy, preemption):
    kn = Knobs(kv_gib=1.0, preemption=preemption, host_gib=16.0)
    s = _check(simulate(busy, StepModel(profile, CFG), kn), busy)
    assert s["completed"] == len(busy) and s["preemptions"] > 0 and s["peak_blocks"] == s["kv_blocks"]
    if preemption == "swap":
        assert s["swaps_out"] == s["swaps_in"] > 0 and s["swap_seconds"] > 0
    else:
        assert s["swaps_out"] == 0 and s["recomputed_tokens"] > 0


def test_fewer_bytes_a_token_hold_more_sequences(profile, busy):
    kn = Knobs(kv_gib=1.0)
    fp16 = simulate(busy, StepModel(profile, CFG, "fp16"), kn).summary()
    int4 = simulate(busy, StepModel(profile, CFG, "int4/token"), kn).summary()
    assert int4["kv_blocks"] > 3 * fp16["kv_blocks"] and int4["max_concurrency"] > fp16["max_concurrency"]
    assert int4["preemptions"] < fp16["preemptions"]


def test_a_host_format_makes_swaps_cheaper_on_the_link(profile, busy):
    base = Knobs(kv_gib=1.0, preemption="swap", host_gib=16.0)
    plain = simulate(busy, StepModel(profile, CFG), base).summary()
    int4 = simulate(busy, StepModel(profile, CFG), Knobs(**{**base.__dict__, "host_format": "int4/token"})).summary()
    assert int4["swap_seconds"] < plain["swap_seconds"] / 2.5


def test_a_shared_prefix_is_a_hit_and_held_once(profile):
    tr = Trace("t", tuple(Request(i, i * 0.01, 40, 20) for i in range(50)))
    on = simulate(tr, StepModel(profile, CFG), Knobs(shared_prefix=256)).summary()
    off = simulate(tr, StepModel(profile, CFG), Knobs(shared_prefix=256, prefix_caching=False)).summary()
    assert on["prefix_hits"] == 50 and off["prefix_hits"] == 0
    assert on["ttft_p50_s"] < off["ttft_p50_s"]


def test_a_request_that_cannot_fit_alone_is_rejected(profile):
    sm = StepModel(profile, CFG)
    blocks, _, _ = kv_blocks(sm, Knobs(kv_gib=0.05))
    tr = Trace("t", (Request(0, 0.0, 10, 10), Request(1, 0.0, blocks * 16 + 1, 5)))
    s = simulate(tr, sm, Knobs(kv_gib=0.05)).summary()
    assert s["rejected"] == 1 and s["completed"] == 1


@pytest.mark.parametrize("bad, match", [(dict(block_size=0), "block_size"), (dict(preemption="drop"), "preemption"),
                                        (dict(keep=0.0), "keep"), (dict(host_format="int3"), "scheme"),
                                        (dict(kv_gib=-1.0), "kv_gib"), (dict(watermark=1.0), "watermark")])
def test_bad_knobs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        Knobs(**bad)


def test_a_thousand_requests_take_under_two_seconds(profile):
    tr = generate("sharegpt", n=1000, seed=2, rate=20.0)
    t0 = time.perf_counter()
    simulate(tr, StepModel(profile, CFG), Knobs())
    assert time.perf_counter() - t0 < 2.0
