"""The replay validation of the what-if (issue 35): a trace through a runner in (fake) real time, continuous
batching, each request's first token and finish recorded; the prediction of the same replay; their comparison;
and ``bench whatif_replay --smoke`` end to end on the CPU (the real model's plumbing, two layers)."""

import json

import numpy as np
import pytest
import torch

from workbench.bench import whatif_replay
from workbench.sim.traces import Request, Trace
from workbench.whatif import PRESETS, GpuProfile
from workbench.whatif.replay import calibrate, compare, metrics, predict_replay, replay
from workbench.whatif.step_time import StepModel, fit_layer_overhead_to, step_seconds


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _FakeRunner:
    """Prefill 10 ms, a decode step 1 ms + 0.1 ms a sequence, on a fake clock; greedy token = 7."""

    def __init__(self, clock):
        self.clock, self.live, self.steps = clock, set(), []
        self.kv = self
        self.model = type("M", (), {"config": type("C", (), {"vocab_size": 100})()})()

    def prefill(self, seq, tokens):
        self.clock.t += 0.010
        self.live.add(seq)
        return torch.full((100,), -1.0).index_fill_(0, torch.tensor([7]), 1.0), 0

    def step(self, seqs, tokens):
        assert set(seqs) <= self.live and all(t == 7 for t in tokens)
        self.steps.append(len(seqs))
        self.clock.t += 0.001 + 0.0001 * len(seqs)
        return torch.zeros(len(seqs), 100).index_fill_(1, torch.tensor([7]), 1.0)

    def free(self, seq):
        self.live.remove(seq)


def test_replay_batches_requests_as_they_arrive(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("workbench.whatif.replay.time.sleep", lambda s: setattr(clock, "t", clock.t + s))
    tr = Trace("t", (Request(0, 0.0, 5, 3), Request(1, 0.0, 5, 1), Request(2, 0.5, 5, 2)))
    run = replay(tr, _FakeRunner(clock), clock=clock, max_batch=2)
    assert run["steps"] == 3  # request 0 needs two steps after its prefill's token, request 2 one
    assert np.allclose(run["first_token"], [0.020, 0.020, 0.510])  # the end of the iteration of their prefills
    assert run["finish"][1] == run["first_token"][1]  # one token: done at its prefill
    assert (run["finish"] >= run["first_token"]).all() and metrics(run)["completed"] == 3


def test_the_prediction_mirrors_the_replay_and_is_compared():
    tr = Trace("t", tuple(Request(i, i * 0.05, 20, 8) for i in range(20)))
    pred = predict_replay(tr)
    assert metrics(pred)["completed"] == 20 and "eager_ms" in pred["launch_us"]
    c = compare(pred, pred)
    assert all(abs(e) < 1e-12 for e in c["error"].values())


def test_bench_smoke_writes_a_row(tmp_path):
    assert whatif_replay.main(["--smoke", "--requests", "3", "--passes", "2", "--out", str(tmp_path)]) == 0
    (f,) = tmp_path.glob("whatif-replay-*.json")
    rows = json.loads(f.read_text())["rows"]
    assert [r["pass"] for r in rows] == [1, 2]
    row = rows[0]
    assert len(row["ttft_measured_s"]) == len(row["ttft_predicted_s"]) == 3
    assert 1 <= len(row["slowest_iterations"]) <= 8 and row["iteration_s_p99"] >= row["iteration_s_p50"] > 0
    assert row["measured_completed"] == row["predicted_completed"] == 3 and "error_throughput_tok_s" in row
    assert row["calibration_step_ms"] > 0 and "this machine" in row["launch_fit"] and "eager_ms" in row["committed_fit"]
    assert row["committed_fit_completed"] == 3 and row["predicted_prefill_ms"] > 0


def test_calibrate_times_the_runners_own_step_and_prefill():
    clock = _Clock()
    runner = _FakeRunner(clock)
    cal = calibrate(runner, context=20, prompt=12, reps=3, clock=clock)
    assert cal["step_ms"] == pytest.approx(1.1) and cal["prefill_ms"] == pytest.approx(10.0)
    assert cal["step_wide_ms"] == pytest.approx(1.0 + 0.1 * 32) and cal["wide"] == 32
    assert (cal["context"], cal["prompt"]) == (21, 12) and runner.live == set()  # every sequence freed
    for bad in (dict(context=0), dict(prompt=-1), dict(reps=True), dict(wide=1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            calibrate(runner, clock=clock, **bad)


def test_the_fit_explains_the_measured_step_and_a_slower_host_predicts_a_slower_replay():
    cfg, base = PRESETS["smollm2-135m"], GpuProfile.from_results()
    for step_ms in (12.0, 27.7, 55.0):
        prof = fit_layer_overhead_to(base, cfg, step_ms, 1, 130, "a test's step")
        model_ms = step_seconds(StepModel(prof, cfg, "fp16").decode(1, 130)) * 1e3
        assert model_ms == pytest.approx(step_ms, rel=1e-9) and "a test's step" in prof.launch_us.source
    tr = Trace("t", tuple(Request(i, i * 0.05, 20, 8) for i in range(40)))
    fast, slow = (predict_replay(tr, calibration={"step_ms": ms, "context": 130, "prompt": 20})
                  for ms in (12.0, 55.0))
    assert "this machine" in fast["launch_us"] and fast["prefill_ms"] < slow["prefill_ms"]
    assert metrics(slow)["throughput_tok_s"] < metrics(fast)["throughput_tok_s"]
    assert metrics(slow)["ttft_p50_s"] > metrics(fast)["ttft_p50_s"]
    with pytest.raises(ValueError, match="calibration must hold"):
        predict_replay(tr, calibration={"step_ms": 12.0})
    with pytest.raises(ValueError, match="step_ms"):
        fit_layer_overhead_to(base, cfg, 0.0, 1, 130, "x")


def test_the_host_fit_explains_the_calibration_and_predicts_a_replay_of_that_runner(monkeypatch):
    """The fake runner's step grows 0.1 ms a sequence and its prefill is 10 ms: fitted to its calibration, the model
    gives back each calibrated time, and predicts a replay it was not fitted to (other batches, queueing) within 5%;
    the floor alone (the way before) misses it."""
    from workbench.whatif.step_time import fit_host_to

    cfg, base = PRESETS["smollm2-135m"], GpuProfile.from_results()
    clock = _Clock()
    monkeypatch.setattr("workbench.whatif.replay.time.sleep", lambda s: setattr(clock, "t", clock.t + s))
    runner = _FakeRunner(clock)
    cal = calibrate(runner, context=20, prompt=12, reps=3, clock=clock)
    prof = fit_host_to(base, cfg, cal, "the fake runner")
    model = StepModel(prof, cfg, "fp16")
    assert step_seconds(model.decode(1, cal["context"])) * 1e3 == pytest.approx(cal["step_ms"], rel=1e-9)
    assert step_seconds(model.decode(32, 32 * cal["context"])) * 1e3 == pytest.approx(cal["step_wide_ms"], rel=1e-9)
    assert model.decode_seconds(32, 32 * cal["context"]) == pytest.approx(step_seconds(model.decode(32, 640)),
                                                                          rel=1e-3)
    assert step_seconds(model.prefill(12)) * 1e3 == pytest.approx(cal["prefill_ms"], rel=1e-9)
    assert prof.seq_us.value == pytest.approx(100.0, rel=0.02) and "fake runner" in prof.seq_us.source
    tr = Trace("t", tuple(Request(i, i * 0.004, 12, 30) for i in range(120)))  # arrivals faster than it serves
    measured = replay(tr, runner, clock=clock, max_batch=16)
    got = compare(measured, predict_replay(tr, calibration=cal, max_batch=16))["error"]
    assert abs(got["throughput_tok_s"]) < 0.05 and abs(got["ttft_p50_s"]) < 0.05, got
    floor_only = {k: cal[k] for k in ("step_ms", "context", "prompt")}
    old = compare(measured, predict_replay(tr, calibration=floor_only, max_batch=16))["error"]
    assert abs(old["ttft_p50_s"]) > 0.2, old
    with pytest.raises(ValueError, match="calibration must hold"):
        fit_host_to(base, cfg, floor_only, "x")
