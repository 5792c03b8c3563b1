"""Simulator runs shaped for plots: one run as a dict of shares and series, and block-size sweeps.

Thin wrappers over :func:`workbench.sim.run` for the fragmentation notebook's panel and sweep.
"""

from __future__ import annotations

import numpy as np

from workbench.sim.budget import kv_budget
from workbench.sim.engine import run
from workbench.sim.strategies import Paged, PagedAdaptive
from workbench.sim.strategies import get as strategy_config
from workbench.sim.traces import load as load_trace

SIM_STRATEGIES = ("paged", "paged-prealloc", "paged-adaptive", "orca-max", "orca-pow2", "orca-oracle")
BLOCK_STRATEGIES = ("paged", "paged-prealloc", "paged-adaptive")  # the ones a block size applies to
COMPACTING_STRATEGIES = ("paged-adaptive",)  # the ones compact_every applies to


def sim_strategy(strategy: str = "paged", block_size: int = 16, compact_every: int = 0):
    """A simulator config: ``paged`` (vLLM), ``paged-prealloc``, ``paged-adaptive`` (blocks of
    ``block_size`` then ``4 * block_size`` from ``8 * block_size`` tokens, compaction every
    ``compact_every`` steps, 0 = never) or the contiguous ``orca-*`` (block size ignored)."""
    if strategy not in SIM_STRATEGIES:
        raise ValueError(f"strategy must be one of {SIM_STRATEGIES}, got {strategy!r}")
    if not isinstance(compact_every, int) or compact_every < 0:
        raise ValueError(f"compact_every must be an int >= 0, got {compact_every!r}")
    if strategy == "paged":
        return Paged(block_size)
    if strategy == "paged-prealloc":
        return Paged(block_size, prealloc=True)
    if strategy == "paged-adaptive":
        return PagedAdaptive(block_size, 4 * block_size, 8 * block_size, compact_every or None)
    return strategy_config(strategy)


def simulate(trace: str = "sharegpt", strategy: str = "paged", block_size: int = 16, kv_gib: float = 12.0,
             compact_every: int = 0, n: int | None = None, model: str = "llama-13b") -> dict:
    """One simulator run (all requests queued at step 0), averaged over the steps with requests waiting.

    Returns:
        ``{"label", "shares" (the paper's four bars, %), "detail" (six parts, %), "mean_batch",
        "throughput" (requests per step), "preemptions", "copied_tokens", "steps", "series"
        ({"step", "token", "free"}: per-step shares of the pool)}``.
    """
    tr = load_trace(trace)
    tr = tr.head(n) if n is not None and n < len(tr) else tr
    budget = kv_budget(model, kv_gib=kv_gib)
    res = run(tr, sim_strategy(strategy, block_size, compact_every), budget)
    avg = res.average(saturated=True)
    step = np.arange(res.steps)
    return {"label": res.strategy, "trace": trace, "requests": len(tr), "slots": budget.slots,
            "shares": {k: round(v, 2) for k, v in avg.paper().items()},
            "detail": {k: round(100 * v, 2) for k, v in avg.shares().items()},
            "mean_batch": round(res.mean_batch(saturated=True), 2),
            "throughput": res.completed / res.steps if res.steps else 0.0,
            "preemptions": res.preemptions, "copied_tokens": res.copied_tokens, "steps": res.steps,
            "series": {"step": step, "token": res.series("token") / budget.slots,
                       "free": res.series("free") / budget.slots}}


def block_size_sweep(traces=("sharegpt", "alpaca"), sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                     n: int | None = None, kv_gib: float = 12.0) -> dict[str, dict[int, dict]]:
    """Paged (vLLM) runs over block sizes: ``{trace: {block_size: {token_states, reservation, internal,
    external, mean_batch, throughput}}}`` (saturated averages, percent)."""
    out: dict[str, dict[int, dict]] = {}
    for t in traces:
        out[t] = {}
        for bs in sizes:
            r = simulate(t, "paged", bs, kv_gib, 0, n)
            out[t][bs] = r["shares"] | {"mean_batch": r["mean_batch"], "throughput": r["throughput"]}
    return out


def format_run(r: dict) -> str:
    """One line of a :func:`simulate` result: its label, the paper's four bars (%), the mean batch and the tokens
    compaction copied."""
    shares = " ".join(f"{k} {v:5.1f}" for k, v in r["shares"].items())
    return f"{r['label']:34s} {shares} | batch {r['mean_batch']:5.1f}, copied {r['copied_tokens']} tokens"


def format_block_size_sweep(sweep: dict[str, dict[int, dict]], column: str = "token_states") -> str:
    """:func:`block_size_sweep`'s result as a table: a row per trace, a column per block size, ``column`` (%)."""
    sizes = list(next(iter(sweep.values()), {}))
    lines = [f"{column.replace('_', ' ')} (%) by block size", f"{'':10s}" + "".join(f"{bs:>7d}" for bs in sizes)]
    lines += [f"{trace:10s}" + "".join(f"{r[column]:7.1f}" for r in rows.values()) for trace, rows in sweep.items()]
    return "\n".join(lines)
