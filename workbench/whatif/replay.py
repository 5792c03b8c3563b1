"""A trace replayed through the real runner, and the what-if's prediction of the same replay (issue 35's second
validation): continuous batching over the paged cache with real arrival times, measured wall clock against the
simulator with the same scheduling.

    cal = calibrate(runner, sync=torch.cuda.synchronize)     # this machine's eager step and prefill
    measured = replay(trace, runner, clock=time.perf_counter, sync=torch.cuda.synchronize)
    predicted = predict_replay(trace, calibration=cal)
    compare(measured, predicted)      # throughput and TTFT p50, and their errors

The runner's scheduling, which the prediction mirrors: between decode steps, every request that has arrived is
prefilled on its own (one prompt at a time, its first token from the prefill) while the batch has room; then one
decode step of every running request; a request leaves after its ``output`` tokens. No preemption (the cache is
sized for the batch), no chunking. The prediction is the simulator with ``token_budget`` large enough for any
prompt and the per-layer floor fitted to the runner's measured *eager* step at batch 1: measured by
:func:`calibrate` on the machine that replays (an eager step is mostly the host's launches, and hosts differ ~2x:
the H100 machine's replay ran at about half the H200 machine's eager step), else ``bench model_decode``'s
committed ``eager_ms``. The replay is then the validation, its batches above 1 never fitted; the calibration's
prefill is a check of the model's prefill, not fitted either.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from workbench.sim.traces import Trace
from workbench.whatif import models
from workbench.whatif.profile import GpuProfile
from workbench.whatif.serve import Knobs, simulate
from workbench.whatif.step_time import StepModel, fit_layer_overhead, fit_layer_overhead_to


def replay(trace: Trace, runner, *, max_batch: int = 64, clock: Callable[[], float] = time.perf_counter,
           sync: Callable[[], None] | None = None, vocab: int | None = None, seed: int = 0) -> dict:
    """Run ``trace`` through ``runner`` (a :class:`~workbench.model.runner.Runner`) in real time: arrivals wait
    for the clock, greedy tokens, random prompt ids. Returns ``{arrival, first_token, finish, output}`` arrays
    (seconds from the first arrival) and ``steps``."""
    rng = np.random.default_rng(seed)
    vocab = vocab or runner.model.config.vocab_size
    reqs = list(trace.requests)
    n = len(reqs)
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    t0 = clock()
    nxt, left, running, i, steps = {}, {}, [], 0, 0

    def now() -> float:
        if sync is not None:
            sync()
        return clock() - t0

    while i < n or running:
        if not running and i < n and reqs[i].arrival_s > now():
            time.sleep(max(0.0, reqs[i].arrival_s - now()))
        while i < n and reqs[i].arrival_s <= now() and len(running) < max_batch:
            r = reqs[i]
            logits, _ = runner.prefill(i, rng.integers(10, vocab, r.prompt).tolist())
            nxt[i], left[i] = int(logits.argmax()), r.output - 1
            first[i] = now()
            running.append(i)
            i += 1
        for s in [s for s in running if left[s] == 0]:
            running.remove(s)
            runner.kv.free(s)
            finish[s] = now()
        if not running:
            continue
        logits = runner.step(running, [nxt[s] for s in running])
        steps += 1
        for b, s in enumerate(running):
            nxt[s] = int(logits[b].argmax())
            left[s] -= 1
    arrival = np.array([r.arrival_s for r in reqs])
    return {"arrival": arrival, "first_token": first, "finish": finish,
            "output": np.array([r.output for r in reqs]), "steps": steps}


def calibrate(runner, *, context: int = 128, prompt: int = 64, reps: int = 8,
              clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
              vocab: int | None = None, seed: int = 0) -> dict:
    """The runner's own eager times on this machine, as :func:`replay` runs it: ``step_ms``, the median decode step
    of one sequence after a ``context``-token prompt, and ``prefill_ms``, the median prefill of a ``prompt``-token
    one (``reps`` of each; the sequences are freed after). Returns those with ``context`` (tokens the step's sequence
    holds, mid-way through its steps) and ``prompt``."""
    for name, v in (("context", context), ("prompt", prompt), ("reps", reps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    rng = np.random.default_rng(seed)
    vocab = vocab or runner.model.config.vocab_size

    def timed(fn) -> float:
        if sync is not None:
            sync()
        t0 = clock()
        fn()
        if sync is not None:
            sync()
        return (clock() - t0) * 1e3

    prefills = []
    for r in range(reps):
        ids = rng.integers(10, vocab, prompt).tolist()
        prefills.append(timed(lambda ids=ids, r=r: runner.prefill(f"calibrate-prefill-{r}", ids)))
        runner.kv.free(f"calibrate-prefill-{r}")
    seq = "calibrate-step"
    logits, _ = runner.prefill(seq, rng.integers(10, vocab, context).tolist())
    token = int(logits.argmax())
    steps = [timed(lambda: runner.step([seq], [token])) for _ in range(reps)]
    runner.kv.free(seq)
    return {"step_ms": float(np.median(steps)), "prefill_ms": float(np.median(prefills)),
            "context": context + reps // 2, "prompt": prompt}


def predict_replay(trace: Trace, *, profile: GpuProfile | None = None, column: str = "eager_ms",
                   max_batch: int = 64, calibration: dict | None = None) -> dict:
    """The simulator's prediction of :func:`replay` for SmolLM2-135M (fp16 K/V, the runner's batch limit, the
    per-layer floor fitted to the runner's eager step at batch 1: ``calibration``'s (:func:`calibrate` on the
    replaying machine) if given, else ``column`` of the committed ``bench model_decode`` run), in :func:`replay`'s
    form, with ``launch_us`` (the fit's source) and ``prefill_ms`` (the model's prefill of ``calibration``'s prompt,
    beside its measured one; None without a calibration)."""
    cfg = models.PRESETS["smollm2-135m"]
    base = profile or GpuProfile.from_results()
    if calibration is None:
        prof = fit_layer_overhead(base, cfg, column=column)
    else:
        missing = {"step_ms", "context", "prompt"} - set(calibration)
        if missing:
            raise ValueError(f"calibration must hold step_ms, context and prompt (calibrate's), missing "
                             f"{sorted(missing)}")
        prof = fit_layer_overhead_to(base, cfg, calibration["step_ms"], 1, int(calibration["context"]),
                                     "this machine's eager step at batch 1")
    longest = max(r.prompt for r in trace.requests)
    knobs = Knobs(max_batch=max_batch, token_budget=longest + max_batch, kv_gib=8.0, watermark=0.0)
    model = StepModel(prof, cfg, "fp16")
    res = simulate(trace, model, knobs)
    t0 = res.arrival.min()
    return {"arrival": res.arrival - t0, "first_token": res.first_token - t0, "finish": res.finish - t0,
            "output": res.output, "steps": res.counters["steps"], "launch_us": prof.launch_us.source,
            "prefill_ms": model.prefill_seconds(int(calibration["prompt"])) * 1e3 if calibration else None}


def metrics(run: dict) -> dict:
    """Throughput (output tokens/s over the run) and TTFT percentiles of a replay or a prediction."""
    done = ~np.isnan(run["finish"])
    span = float(np.nanmax(run["finish"]) - run["arrival"].min())
    ttft = (run["first_token"] - run["arrival"])[done]
    return {"throughput_tok_s": float(run["output"][done].sum() / span), "ttft_p50_s": float(np.median(ttft)),
            "ttft_p90_s": float(np.percentile(ttft, 90)), "completed": int(done.sum())}


def compare(measured: dict, predicted: dict) -> dict:
    """Both runs' :func:`metrics` and the prediction's relative error on each."""
    m, p = metrics(measured), metrics(predicted)
    return {"measured": m, "predicted": p,
            "error": {k: p[k] / m[k] - 1 for k in ("throughput_tok_s", "ttft_p50_s", "ttft_p90_s") if m[k]}}
