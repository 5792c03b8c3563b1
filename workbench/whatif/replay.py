"""A trace replayed through the real runner, and the what-if's prediction of the same replay (issue 35's second
validation): continuous batching over the paged cache with real arrival times, measured wall clock against the
simulator with the same scheduling.

    cal = calibrate(runner, sync=torch.cuda.synchronize)     # this machine's eager step and prefill
    measured = replay(trace, runner, clock=time.perf_counter, sync=torch.cuda.synchronize)
    predicted = predict_replay(trace, calibration=cal)
    compare(measured, predicted)      # throughput and TTFT p50, and their errors

The runner's scheduling is the simulator's step (:func:`replay`): every request that has arrived is prefilled on
its own (one prompt at a time) while the batch has room, then one decode step of the requests running before;
the iteration's end is the new requests' first token; a request leaves after its ``output`` tokens. No
preemption (the cache is sized for the batch), no chunking. The prediction is the simulator with a
``token_budget`` no step reaches (every arrived prompt prefilled whole) and the runner's host costs fitted to its
own *eager* times, measured by :func:`calibrate` on the machine that replays (an eager step is mostly the host's
launches and Python, and hosts differ ~2x: the H100 machine's replay ran at about half the H200 machine's eager
step): the per-layer floor to a step of one sequence, the host time per sequence to a step of ``wide`` (32)
sequences, the host time per prefill to one prefill of 64 tokens (``step_time.fit_host_to``). Without a
calibration, the floor alone is fitted to ``bench model_decode``'s committed ``eager_ms``. The replay is then the
validation: its batches (1 to 64, changing every step), its prompts (the trace's lengths) and its queueing are
never fitted. Before the per-sequence and per-prefill terms, the prediction missed the H100 replay by +38% in
throughput and -96% in TTFT: the runner's step grows with the batch (25.6 ms at one sequence, ~46 ms at 64) and a
prefill costs 1.4 steps, so the predicted server was never saturated where the real one queued. The replay then read
each sequence's greedy token on its own (a device sync each, ~0.1-0.2 ms): a third of its wall time, that no
calibration saw; it reads the batch's at once now, and the calibration times the same read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from workbench.sim.traces import Trace
from workbench.whatif import models
from workbench.whatif.profile import GpuProfile
from workbench.whatif.serve import Knobs, simulate
from workbench.whatif.step_time import StepModel, fit_host_to, fit_layer_overhead, fit_layer_overhead_to


def replay(trace: Trace, runner, *, max_batch: int = 64, clock: Callable[[], float] = time.perf_counter,
           sync: Callable[[], None] | None = None, vocab: int | None = None, seed: int = 0) -> dict:
    """Run ``trace`` through ``runner`` (a :class:`~workbench.model.runner.Runner`) in real time: arrivals wait
    for the clock, greedy tokens, random prompt ids. Returns ``{arrival, first_token, finish, output}`` arrays
    (seconds from the first arrival), ``steps`` and ``iterations`` (``[start, end, prompts prefilled, their tokens,
    sequences decoded]`` per iteration: where the time went).

    An iteration is the simulator's step (``workbench.whatif.serve``) with prompts never chunked: the requests that
    have arrived when it starts are prefilled, one prompt at a time, while the batch has room; then one decode step
    of the requests that were running before it. Its end is the new requests' first token (their prefill's) and
    the others' next one; a request leaves at the end of the iteration that gives its last token."""
    rng = np.random.default_rng(seed)
    vocab = vocab or runner.model.config.vocab_size
    reqs = list(trace.requests)
    n = len(reqs)
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    t0 = clock()
    nxt, left, running, i, steps, iterations = {}, {}, [], 0, 0, []

    def now() -> float:
        if sync is not None:
            sync()
        return clock() - t0

    while i < n or running:
        if not running and i < n and reqs[i].arrival_s > now():
            time.sleep(max(0.0, reqs[i].arrival_s - now()))
        start, decoding, new = now(), list(running), []
        while i < n and reqs[i].arrival_s <= start and len(running) + len(new) < max_batch:
            r = reqs[i]
            logits, _ = runner.prefill(i, rng.integers(10, vocab, r.prompt).tolist())
            nxt[i], left[i] = int(logits.argmax()), r.output - 1
            new.append(i)
            i += 1
        if decoding:  # the batch's greedy tokens read back at once (one read a step, as a server does)
            toks = runner.step(decoding, [nxt[s] for s in decoding]).argmax(-1).tolist()
            steps += 1
            for s, t in zip(decoding, toks, strict=True):
                nxt[s] = t
                left[s] -= 1
        end = now()
        iterations.append((start, end, len(new), sum(reqs[j].prompt for j in new), len(decoding)))
        first[new] = end
        running += new
        for s in [s for s in running if left[s] == 0]:
            running.remove(s)
            runner.kv.free(s)
            finish[s] = end
    arrival = np.array([r.arrival_s for r in reqs])
    return {"arrival": arrival, "first_token": first, "finish": finish,
            "output": np.array([r.output for r in reqs]), "steps": steps, "iterations": np.array(iterations)}


def calibrate(runner, *, context: int = 128, prompt: int = 64, reps: int = 8, wide: int = 32,
              clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None,
              vocab: int | None = None, seed: int = 0) -> dict:
    """The runner's own eager times on this machine, as :func:`replay` runs it: ``step_ms``, the median decode step
    of one sequence after a ``context``-token prompt, ``step_wide_ms``, the same step of ``wide`` such sequences at
    once, and ``prefill_ms``, the median prefill of a ``prompt``-token one (``reps`` of each; the sequences are freed
    after). Returns those with ``context`` (tokens each step's sequence holds, mid-way through its steps), ``wide``
    and ``prompt``."""
    for name, v, lo in (("context", context, 1), ("prompt", prompt, 1), ("reps", reps, 1), ("wide", wide, 2)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
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
    seqs = [f"calibrate-step-{i}" for i in range(wide)]
    tokens = []
    for s in seqs:
        logits, _ = runner.prefill(s, rng.integers(10, vocab, context).tolist())
        tokens.append(int(logits.argmax()))
    try:  # a step as the replay runs it: the step, then its greedy tokens read back
        steps = [timed(lambda: runner.step(seqs[:1], tokens[:1]).argmax(-1).tolist()) for _ in range(reps)]
        wides = [timed(lambda: runner.step(seqs, tokens).argmax(-1).tolist()) for _ in range(reps)]
    finally:
        for s in seqs:
            runner.kv.free(s)
    return {"step_ms": float(np.median(steps)), "step_wide_ms": float(np.median(wides)),
            "prefill_ms": float(np.median(prefills)), "context": context + reps // 2, "wide": wide, "prompt": prompt}


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
    elif "step_wide_ms" in calibration:
        prof = fit_host_to(base, cfg, calibration, "this machine's eager runner")
    else:  # a calibration of before the step at `wide` sequences: the per-layer floor alone
        missing = {"step_ms", "context", "prompt"} - set(calibration)
        if missing:
            raise ValueError(f"calibration must hold step_ms, context and prompt (calibrate's), missing "
                             f"{sorted(missing)}")
        prof = fit_layer_overhead_to(base, cfg, calibration["step_ms"], 1, int(calibration["context"]),
                                     "this machine's eager step at batch 1")
    # a budget no step reaches: every arrived prompt is prefilled whole in one step, as the replay does
    budget = sum(r.prompt for r in trace.requests) + max_batch
    knobs = Knobs(max_batch=max_batch, token_budget=budget, kv_gib=8.0, watermark=0.0)
    model = StepModel(prof, cfg, "fp16")
    res = simulate(trace, model, knobs)
    t0 = res.arrival.min()
    return {"arrival": res.arrival - t0, "first_token": res.first_token - t0, "finish": res.finish - t0,
            "output": res.output, "steps": res.counters["steps"], "launch_us": prof.launch_us.source,
            "seq_us": prof.seq_us.value, "prefill_us": prof.prefill_us.value,
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
