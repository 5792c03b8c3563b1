"""GPU: a trace replayed through the real runner (SmolLM2-135M's shape, random fp16 weights, the paged cache,
continuous batching in real time) against the what-if's prediction of the same replay (issue 35's validation:
throughput and TTFT within 20%).

    python -m workbench bench whatif_replay [--requests 300] [--rate 20] [--out data/results]

The trace is the Alpaca-like one (short prompts and outputs, so a few hundred requests take a minute), re-spaced
as Poisson arrivals at ``--rate``. The prediction's per-layer floor is fitted to the runner's eager step at batch 1
measured on this machine before the replay (``workbench.whatif.replay.calibrate``: an eager step is mostly host
time, which differs between machines); the row also carries the prediction fitted to the committed ``bench
model_decode`` run's eager step (``committed_fit_*``, the way before) and the calibration's prefill against the
model's (``calibration_prefill_ms``, ``predicted_prefill_ms``: a check, not fitted). ``--passes N`` replays the trace
N times after the calibration, a row each: the later passes run with every prompt length and batch size seen once
(what a server's warm-up gives). Each row carries the slowest iterations and the requests' TTFTs, measured and
predicted, to tell a tail of slow iterations from a model's miss. ``--smoke``: two layers on the CPU, a handful of
requests, the plumbing only (no timing claim).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

import workbench
from workbench.bench.command import SMOKE_HELP, BenchParser
from workbench.cache import PagedKVCache
from workbench.core.argtypes import positive_float, positive_int
from workbench.model import SMOLLM2_135M, Llama, PagedKV, Runner, random_weights
from workbench.results import provenance, run_files
from workbench.sim.traces import Trace
from workbench.whatif.replay import calibrate, compare, predict_replay, replay
from workbench.whatif.report import load_trace


def _runner(cfg, device, dtype, max_batch: int, max_len: int, ops: str = "kernels") -> Runner:
    model = Llama(cfg, {k: v.to(dtype) for k, v in random_weights(cfg, seed=0).items()}, dtype=dtype, device=device)
    pages = max_batch * -(-max_len // 16) + 16
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, pages, page_tokens=16,
                         kv_dtype="fp16" if dtype == torch.float16 else "fp32", device=device, prefix_caching=False,
                         ops=ops)
    return Runner(model, PagedKV(cache, dtype))


def ttfts(run: dict) -> list:
    """Each request's time to first token (s, 4 decimals; None where it never got one), in arrival order."""
    return [None if t != t else round(float(t), 4) for t in run["first_token"] - run["arrival"]]


def slowest_iterations(iterations, n: int = 8) -> dict:
    """The iterations' time percentiles and the ``n`` slowest (start, seconds, prompts, prompt tokens, decoded)."""
    it = np.asarray(iterations, dtype=float).reshape(-1, 5)
    dur = it[:, 1] - it[:, 0]
    worst = np.argsort(dur)[::-1][:n]
    return {"iteration_s_p50": float(np.median(dur)) if len(dur) else None,
            "iteration_s_p99": float(np.percentile(dur, 99)) if len(dur) else None,
            "slowest_iterations": [[round(float(it[j, 0]), 3), round(float(dur[j]), 4), *map(int, it[j, 2:])]
                                   for j in worst]}


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser("whatif_replay", __doc__, gpu=True, smoke=SMOKE_HELP)
    ap.add_argument("--requests", type=positive_int, default=None, help="requests replayed (default 300; smoke 6)")
    ap.add_argument("--rate", type=positive_float, default=20.0, help="arrivals a second (default 20)")
    ap.add_argument("--max-batch", type=positive_int, default=64, help="sequences decoded at once at most")
    ap.add_argument("--passes", type=positive_int, default=1, help="replays of the trace, a row each (default 1)")
    args = ap.parse_args(argv)
    out = ap.start(args)
    if out is None:
        return 2
    n = args.requests or (6 if args.smoke else 300)
    trace = load_trace("alpaca", n=n, rate=args.rate, seed=1)
    if args.smoke:  # tiny lengths: the plumbing on a CPU
        trace = Trace(trace.name, tuple(dataclasses.replace(r, prompt=min(r.prompt, 12), output=min(r.output, 4))
                                        for r in trace.requests))
    cfg = SMOLLM2_135M.with_layers(2) if args.smoke else SMOLLM2_135M
    device = workbench.device() if args.smoke else torch.device("cuda")
    dtype = torch.float32 if args.smoke else torch.float16
    max_len = max(r.prompt + r.output for r in trace.requests) + 1
    runner = _runner(cfg, device, dtype, args.max_batch, max_len, "torch" if args.smoke else "kernels")
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    if not args.smoke:  # warm up the kernels (compilation is not serving time)
        replay(Trace("warmup", trace.requests[:4]), runner, sync=sync, max_batch=args.max_batch)
    committed = predict_replay(trace, max_batch=args.max_batch)  # fitted to the committed run instead: the old way
    rows = []
    for p in range(args.passes):
        # this machine's eager runner now: a step of 1 and of 32 sequences and a prefill (the prediction's fitted
        # numbers), before each pass (a runner's host time drifts: 40 -> 27 ms an iteration between two passes)
        cal = calibrate(runner, context=8 if args.smoke else 128, prompt=8 if args.smoke else 64,
                        reps=2 if args.smoke else 8, wide=2 if args.smoke else 32, sync=sync)
        predicted = predict_replay(trace, max_batch=args.max_batch, calibration=cal)
        t0 = time.perf_counter()
        measured = replay(trace, runner, max_batch=args.max_batch, sync=sync)
        wall = time.perf_counter() - t0
        result = compare(measured, predicted)
        print(f"pass {p + 1}: measured {result['measured']}\npredicted {result['predicted']}\nerror {result['error']}")
        rows.append({"section": "replay", "pass": p + 1, "requests": n, "rate": args.rate,
                     "max_batch": args.max_batch, "steps_measured": measured["steps"],
                     "steps_predicted": predicted["steps"], "wall_s": wall,
                     "launch_fit": predicted["launch_us"], "calibration_step_ms": cal["step_ms"],
                     "calibration_step_wide_ms": cal["step_wide_ms"], "calibration_wide": cal["wide"],
                     "calibration_prefill_ms": cal["prefill_ms"], "calibration_prompt": cal["prompt"],
                     "predicted_prefill_ms": predicted["prefill_ms"], "fitted_seq_us": predicted["seq_us"],
                     "fitted_prefill_us": predicted["prefill_us"],
                     "committed_fit": committed["launch_us"],
                     **{f"committed_fit_{k}": v for k, v in compare(measured, committed)["predicted"].items()},
                     **{f"measured_{k}": v for k, v in result["measured"].items()},
                     **{f"predicted_{k}": v for k, v in result["predicted"].items()},
                     **{f"error_{k}": v for k, v in result["error"].items()},
                     **slowest_iterations(measured["iterations"]),
                     "ttft_measured_s": ttfts(measured), "ttft_predicted_s": ttfts(predicted)})
    path = run_files.write_results("whatif-replay", rows, provenance.machine_meta(), out,
                                   extra={"mode": "smoke" if args.smoke else "full",
                                          "weights": "random (timing does not depend on values)"})
    print(f"wrote {path}")
    return 0
