"""Make the synthetic request traces of this folder: ``python data/traces/make_traces.py``.

Writes ``sharegpt_synth.jsonl`` and ``alpaca_synth.jsonl`` (10k requests each, seed 0): lognormal prompt and
output lengths fitted to the vLLM paper's means after vLLM's benchmark filter, Poisson arrivals at 2 and 30
requests per second. The generator and the reasons for its spreads live in ``workbench/sim/traces.py``; the
files are a cache of it (``workbench.sim.load_trace`` regenerates them when missing).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # run from a checkout without installing

from workbench.sim import traces  # noqa: E402


def main() -> int:
    for name in traces.PRESETS:
        trace = traces.generate(name, traces.DEFAULT_N, traces.DEFAULT_SEED)
        path = HERE / f"{name}_synth.jsonl"
        traces.save(trace, path)
        s = trace.stats()
        print(f"{path.name}: {s['requests']} requests, prompt mean {s['prompt_mean']:.2f} (CV {s['prompt_cv']:.2f}),"
              f" output mean {s['output_mean']:.2f} (CV {s['output_cv']:.2f}), max total {s['max_total']},"
              f" {s['rate_per_s']:.2f} req/s, {path.stat().st_size / 1024:.0f} KiB")
        fit = trace.meta
        print(f"  lognormal prompt mu={fit['prompt']['mu']:.4f} sigma={fit['prompt']['sigma']:.4f}, "
              f"output mu={fit['output']['mu']:.4f} sigma={fit['output']['sigma']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
