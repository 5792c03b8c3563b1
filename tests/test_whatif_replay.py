"""The replay validation of the what-if (issue 35): a trace through a runner in (fake) real time, continuous
batching, each request's first token and finish recorded; the prediction of the same replay; their comparison;
and ``bench whatif_replay --smoke`` end to end on the CPU (the real model's plumbing, two layers)."""

import json

import numpy as np
import torch

from workbench.bench import whatif_replay
from workbench.sim.traces import Request, Trace
from workbench.whatif.replay import compare, metrics, predict_replay, replay


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
    assert np.allclose(run["first_token"], [0.010, 0.020, 0.510])
    assert run["finish"][1] == run["first_token"][1]  # one token: done at its prefill
    assert (run["finish"] >= run["first_token"]).all() and metrics(run)["completed"] == 3


def test_the_prediction_mirrors_the_replay_and_is_compared():
    tr = Trace("t", tuple(Request(i, i * 0.05, 20, 8) for i in range(20)))
    pred = predict_replay(tr)
    assert metrics(pred)["completed"] == 20 and "eager_ms" in pred["launch_us"]
    c = compare(pred, pred)
    assert all(abs(e) < 1e-12 for e in c["error"].values())


def test_bench_smoke_writes_a_row(tmp_path):
    assert whatif_replay.main(["--smoke", "--requests", "3", "--out", str(tmp_path)]) == 0
    (f,) = tmp_path.glob("whatif-replay-*.json")
    row = json.loads(f.read_text())["rows"][0]
    assert row["measured_completed"] == row["predicted_completed"] == 3 and "error_throughput_tok_s" in row
