"""The panels of notebook 08: a shared-prefix batch and what each path reads, the measured crossover map, batching
by overlap, and sharing in the serving simulator.

The scenario and forks panels are the controls, computation and figures of their studies
(``workbench.studies.shared_prefix``), which the ``scenario`` and ``forks`` sweeps run too; the others read the
committed H200 runs (``workbench.results.shared_prefix``) or batch by overlap
(``workbench.shared_prefix.scenarios``). ``shared_prefix_figures`` draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as W

from workbench.figures import shared_prefix as spf
from workbench.figures.titles import wrap
from workbench.results import shared_prefix as measured
from workbench.shared_prefix import scenarios
from workbench.shared_prefix.decode import cost_model
from workbench.sim import forks_report
from workbench.studies import shared_prefix as sp
from workbench.ui.controls import controls_for
from workbench.ui.panels import Panel


def scenario_panel(prefix: int = 1024, sharers: int = 8, suffix: int = 128, max_programs: int = 24) -> Panel:
    """Prefix, sharers, suffix, GQA, tile rows, forks and timing (the controls of the ``scenario`` study) -> bytes
    and predicted time of both paths, and the blocks every program reads (the first ``max_programs``)."""

    def compute(prefix, sharers, suffix, gqa, rows_per_tile, groups, timing):
        sc = sp.scenario(prefix, sharers, suffix, gqa, rows_per_tile, groups, cost_model("NVIDIA H200", timing))
        groups = min(groups, sharers)
        nest = f", {groups} fork groups sharing 256 more" if groups > 1 else ""
        return {"sc": sc, "plain": scenarios.program_reads(sc, "plain", max_programs),
                "shared": scenarios.program_reads(sc, "shared", max_programs),
                "model": "CUDA-graph" if timing == "graph" else "eager",
                "title": f"{sharers} sequences over a {prefix}-token prefix{nest}, {suffix} private tokens each, "
                         f"{gqa}"}

    values = {"prefix": prefix, "sharers": sharers, "suffix": suffix}
    return Panel(controls_for(sp.SCENARIO, values), compute, sp.SCENARIO.draw, enabled=sp.SCENARIO.enabled)


def crossover_panel(runs: Sequence[dict] | None = None) -> Panel:
    """GQA, suffix, timing, prefix and run -> the measured crossover map and the times by sharers."""
    runs = list(measured.runs() if runs is None else runs)
    if not runs:
        raise ValueError("no bench shared_prefix runs: run `python -m workbench bench shared_prefix --out "
                         "data/results` on a GPU")
    names = [measured.run_name(r) for r in runs]
    last = runs[-1]
    prefixes = sorted({r["prefix"] for r in last["rows"] if r.get("section") == "map"})
    controls = {
        "gqa": W.Dropdown(options=measured.gqa_ratios(last), value=measured.gqa_ratios(last)[-1], description="heads"),
        "suffix": W.Dropdown(options=measured.suffixes(last), value=measured.suffixes(last)[0],
                             description="suffix"),
        "timing": W.ToggleButtons(options=[("CUDA graph", "graph"), ("eager", "eager")], value="graph",
                                  description="timing"),
        "prefix": W.SelectionSlider(options=prefixes, value=prefixes[-1], description="curves at prefix"),
        "run": W.Dropdown(options=names, value=names[-1], description="run"),
    }

    def compute(gqa, suffix, timing, prefix, run):
        doc = runs[names.index(run)]
        cmap = measured.crossover(doc, gqa, suffix, timing)
        curves = measured.times_by_sharers(doc, gqa, prefix, suffix, timing)
        word = "CUDA-graph replay" if timing == "graph" else "eager launches"
        sub = wrap(f"{run}; framed: the selector takes the cascade (fitted on this run; red dashes would be a wrong "
                   "pick)", spf.SUB_CHARS)
        return {"cmap": cmap, "curves": curves, "prefix": prefix,
                "title": f"Shared-prefix decode on the H200, {gqa} heads, {suffix}-token suffixes ({word})"
                         f"<br><sup>{sub}</sup>"}

    return Panel(controls, compute, lambda r: spf.crossover_figure(r["cmap"], r["curves"], r["prefix"], r["title"]))


def batching_panel(runs: Sequence[dict] | None = None) -> Panel:
    """Prompts, samples, prefix and batch size -> bytes of a step in arrival order and grouped by overlap."""
    runs = list(measured.runs() if runs is None else runs)
    rows = measured.section(runs[-1], "batching") if runs else []
    controls = {
        "prompts": W.IntSlider(value=16, min=2, max=24, description="prompts"),
        "samples": W.IntSlider(value=16, min=1, max=24, description="samples each"),
        "prefix": W.SelectionSlider(options=sp.PREFIXES[:-2], value=2048, description="prompt tokens"),
        "max_batch": W.SelectionSlider(options=(8, 16, 32, 64, 128), value=32, description="batch size"),
    }

    def compute(prompts, samples, prefix, max_batch):
        res = scenarios.batching_study(prompts, samples, prefix, 256, max_batch)
        ratio = res["arrival"] / res["grouped"] if res["grouped"] else 1.0
        return {"res": res, "rows": rows,
                "title": f"{prompts} prompts x {samples} samples ({prefix} + 256 tokens), batches of {max_batch}: "
                         f"grouping reads {ratio:.2f}x less than arrival order"}

    return Panel(controls, compute, lambda r: spf.batching_figure(r["res"], r["rows"], r["title"]))


def forks_panel(requests: int = 200) -> Panel:
    """Trace, mode and the beam model's p_top (the controls of the ``forks`` study) -> memory saved by sharing for
    n = 2, 4, 6 (each bar the sweep's point) against the vLLM paper."""

    def compute(trace, mode, p_top):
        rows = [{"n": n, **sp.FORKS.point(trace=trace, mode=mode, p_top=p_top, n=n, requests=requests)}
                for n in sp.FORKS.param("n").choices]
        paper = forks_report.PAPER.get((trace, mode))
        what = "parallel samples" if mode == "parallel" else f"beam search (p_top {p_top})"
        return {"rows": rows, "paper": paper,
                "title": f"Memory saved by block sharing: {what}, first {requests} requests of the {trace}-like trace"}

    return Panel(controls_for(sp.FORKS), compute, sp.FORKS.draw, enabled=sp.FORKS.enabled)


def growth_panel(runs: Sequence[dict] | None = None) -> Panel:
    """GQA and timing -> each path's measured time against the tokens it must read."""
    runs = list(measured.runs() if runs is None else runs)
    if not runs:
        raise ValueError("no bench shared_prefix runs in data/results")
    last = runs[-1]
    controls = {
        "gqa": W.Dropdown(options=measured.gqa_ratios(last), value=measured.gqa_ratios(last)[-1], description="heads"),
        "timing": W.ToggleButtons(options=[("CUDA graph", "graph"), ("eager", "eager")], value="graph",
                                  description="timing"),
    }

    def compute(gqa, timing):
        return {"points": measured.growth(last, gqa, timing),
                "title": f"Time against the tokens each path reads ({gqa} heads, {measured.run_name(last)})"}

    return Panel(controls, compute, lambda r: spf.growth_figure(r["points"], r["title"]))
