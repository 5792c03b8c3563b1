"""Serving simulator (pure Python): request traces, allocation strategies, the step loop, memory metrics.

    from workbench import sim
    trace = sim.load_trace("sharegpt")                       # 10k requests fitted to the vLLM paper
    res = sim.run(trace, "orca-pow2", sim.kv_budget("llama-13b", kv_gib=12))
    res.summary(); res.series("batch"); res.average(saturated=True).paper()
    sim.fig2.breakdown()                                     # the paper's Figure 2, four systems
    sim.serve_forks("alpaca", "beam", 4).saving()            # blocks saved by sharing (paper section 6.3)

Memory parts and their formulas: ``workbench.sim.metrics`` and ``docs/fragmentation.md``.
"""

from workbench.sim import fig2, forks, forks_report, forks_serving, metrics, seed_table, sweeps
from workbench.sim.budget import Budget, kv_budget, slots_budget
from workbench.sim.engine import Result, run
from workbench.sim.forks import GroupCurve, RefPool, lifetime_saving, simulate_group
from workbench.sim.forks_report import table as forks_table
from workbench.sim.forks_serving import ForkResult
from workbench.sim.forks_serving import serve as serve_forks
from workbench.sim.metrics import Breakdown
from workbench.sim.strategies import STRATEGIES, Contiguous, Paged, PagedAdaptive
from workbench.sim.strategies import get as strategy
from workbench.sim.traces import Request, Trace
from workbench.sim.traces import generate as generate_trace
from workbench.sim.traces import load as load_trace

__all__ = ["Breakdown", "Budget", "Contiguous", "ForkResult", "GroupCurve", "Paged", "PagedAdaptive", "RefPool",
           "Request", "Result", "STRATEGIES", "Trace", "fig2", "forks", "forks_report", "forks_serving",
           "forks_table", "generate_trace", "kv_budget", "lifetime_saving", "load_trace", "metrics", "run",
           "seed_table", "serve_forks", "simulate_group", "slots_budget", "strategy", "sweeps"]
