"""One what-if as plain data: a model, a GPU profile, a trace and the knobs in; capacity, latency, throughput,
memory over time, quality and the "why" of a step out, every number with its source.

    out = whatif("llama-3.1-8b", scheme="int4/token", trace="sharegpt", rate=8.0, knobs=Knobs(block_size=16))
    out["summary"]["throughput_tok_s"], out["why"], out["quality"]["kv_scheme"]["source"]
    sensitivity("llama-3.1-8b", ...)   # which measured input moves each output most

The profile is the newest committed H200 runs (``GpuProfile.from_results``) with its per-layer floor fitted to the
real model's measured step (``fit_layer_overhead``), unless one is given.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np

from workbench.sim import traces
from workbench.whatif import models
from workbench.whatif.profile import GpuProfile, Measured
from workbench.whatif.quality import quality_column
from workbench.whatif.serve import Knobs, kv_blocks, simulate
from workbench.whatif.step_time import StepModel, fit_layer_overhead

TIMELINE_POINTS = 200  # memory-over-time samples kept in a report


@lru_cache(maxsize=4)
def default_profile(name: str = "h200") -> GpuProfile:
    """The committed runs of GPU ``name``, the per-layer floor fitted to SmolLM2-135M's measured step at batch 1."""
    return fit_layer_overhead(GpuProfile.from_results(name=name), models.PRESETS["smollm2-135m"])


def load_trace(trace: str | traces.Trace = "sharegpt", n: int | None = 1000, rate: float | None = None,
               seed: int = 0) -> traces.Trace:
    """A trace by preset name (``sharegpt``, ``alpaca``: generated with ``n``, ``rate``, ``seed``), a JSONL path
    (its first ``n`` requests; ``rate`` re-spaces the arrivals as Poisson at that rate), or a Trace."""
    if isinstance(trace, traces.Trace):
        return trace
    if trace in traces.PRESETS:
        return traces.generate(trace, n=n or traces.DEFAULT_N, seed=seed, rate=rate)
    t = traces.load(trace)
    reqs = t.requests[:n] if n else t.requests
    if rate is not None:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(reqs))
        at = np.concatenate(([0.0], np.cumsum(gaps[1:])))
        reqs = tuple(dataclasses.replace(r, arrival_s=float(a)) for r, a in zip(reqs, at, strict=True))
    return traces.Trace(t.name, tuple(reqs), t.meta)


def whatif(model: str = "smollm2-135m", *, scheme: str = "fp16", trace: str | traces.Trace = "sharegpt",
           n: int | None = 1000, rate: float | None = None, seed: int = 0, knobs: Knobs | None = None,
           profile: GpuProfile | None = None, frac: str = "median") -> dict:
    """See the module docstring. Returns ``{"config", "summary", "why", "quality", "memory", "sources"}``."""
    knobs = knobs if knobs is not None else Knobs()
    name, cfg = models.get(model)
    prof = profile or default_profile()
    sm = StepModel(prof, cfg, scheme, frac=frac)
    tr = load_trace(trace, n, rate, seed)
    res = simulate(tr, sm, knobs)
    summary = res.summary()
    blocks, block_bytes, budget_note = kv_blocks(sm, knobs)
    # the "why": one decode step at the run's mean batch and context, and a prefill of its mean prompt
    batch = max(1, round(summary["max_concurrency"] / 2))
    mean_ctx = int(np.mean([knobs.shared_prefix + r.prompt + r.output / 2 for r in tr.requests]))
    why = {"decode": [dataclasses.asdict(p) for p in sm.decode(batch, batch * mean_ctx)],
           "decode_at": {"batch": batch, "context_per_sequence": mean_ctx},
           "prefill": [dataclasses.asdict(p) for p in sm.prefill(max(1, int(np.mean([r.prompt for r in
                                                                                     tr.requests]))))]}
    t, used = res.timeline
    pick = np.linspace(0, len(t) - 1, min(len(t), TIMELINE_POINTS)).astype(int)
    memory = {"time_s": (t[pick] - t[0]).tolist(), "blocks": used[pick].tolist(), "kv_blocks": blocks,
              "block_bytes": block_bytes, "budget": budget_note}
    return {
        "config": {"model": name, "gpu": prof.name, "scheme": scheme, "trace": tr.name, "requests": len(tr),
                   "rate": rate, "frac": frac, **dataclasses.asdict(knobs)},
        "summary": summary, "why": why, "memory": memory,
        "quality": quality_column(scheme, keep=knobs.keep, policy=knobs.policy, host_format=knobs.host_format),
        "sources": {"files": list(prof.files), **{k: v.source for k, v in _measured(prof).items()}},
    }


def _measured(prof: GpuProfile) -> dict[str, Measured]:
    return {f.name: getattr(prof, f.name) for f in dataclasses.fields(prof)
            if isinstance(getattr(prof, f.name), Measured)}


# each measured input, varied by its run-to-run spread (a decode fraction: its workloads' min and max)
SPREAD = {"copy_gbps": 0.03, "launch_us": 0.10, "gemv_frac": 0.10, "peak_tflops": 0.10, "prefill_mfu": 0.20}
OUTPUTS = ("throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "max_concurrency")


def sensitivity(model: str = "smollm2-135m", *, outputs=OUTPUTS, **kw) -> list[dict]:
    """For each input (the decode fraction's min and max over the measured workloads, each other profile number
    +- its :data:`SPREAD`), the relative change of each output: rows ``{input, low, high, <output>_low,
    <output>_high}``, the largest effect first."""
    prof = kw.pop("profile", None) or default_profile()
    base = whatif(model, profile=prof, **kw)["summary"]
    rows = []

    def rel(s, key):
        return s[key] / base[key] - 1 if base[key] else float("nan")

    lo, hi = (whatif(model, profile=prof, frac=f, **kw)["summary"] for f in ("min", "max"))
    rows.append({"input": "decode_frac", "low": "min of W1-W5", "high": "max of W1-W5",
                 **{f"{o}_low": rel(lo, o) for o in outputs}, **{f"{o}_high": rel(hi, o) for o in outputs}})
    for name, spread in SPREAD.items():
        m = getattr(prof, name)
        out = {}
        for side, factor in (("low", 1 - spread), ("high", 1 + spread)):
            p = dataclasses.replace(prof, **{name: Measured(m.value * factor, m.source)})
            s = whatif(model, profile=p, **kw)["summary"]
            out.update({f"{o}_{side}": rel(s, o) for o in outputs})
        rows.append({"input": name, "low": f"-{spread:.0%}", "high": f"+{spread:.0%}", **out})
    rows.sort(key=lambda r: -max(abs(r[f"{o}_{s}"]) for o in outputs for s in ("low", "high")
                                 if r[f"{o}_{s}"] == r[f"{o}_{s}"]))
    return rows
