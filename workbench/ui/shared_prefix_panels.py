"""The panels of notebook 08: a shared-prefix batch and what each path reads, the measured crossover map, batching
by overlap, and sharing in the serving simulator.

Like ``workbench.ui.panels``, they hold no logic: ``workbench.shared_prefix.study`` builds the batches and asks the
selector, ``workbench.bench.shared_prefix_results`` reads the committed H200 runs, ``workbench.sim.forks`` runs the
parallel-sampling and beam-search groups, ``shared_prefix_figures`` draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as W

from workbench.bench import shared_prefix_results as measured
from workbench.shared_prefix import study
from workbench.shared_prefix.decode import cost_model
from workbench.sim import forks
from workbench.ui import shared_prefix_figures as spf
from workbench.ui.figures import wrap
from workbench.ui.panels import Panel

PREFIXES = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
SHARERS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SUFFIXES = (16, 64, 128, 256, 512, 1024, 2048)
GQAS = {"32 q / 8 kv heads": (32, 8), "32 q / 32 kv (MHA)": (32, 32), "32 q / 4 kv": (32, 4)}


def scenario_panel(prefix: int = 1024, sharers: int = 8, suffix: int = 128, max_programs: int = 24) -> Panel:
    """Prefix, sharers, suffix, GQA, tile rows, forks and timing -> bytes and predicted time of both paths, and the
    blocks every program reads."""
    controls = {
        "prefix": W.SelectionSlider(options=PREFIXES, value=prefix, description="shared prefix"),
        "sharers": W.SelectionSlider(options=SHARERS, value=sharers, description="sharers"),
        "suffix": W.SelectionSlider(options=SUFFIXES, value=suffix, description="private suffix"),
        "gqa": W.Dropdown(options=list(GQAS), value="32 q / 8 kv heads", description="heads"),
        "rows_per_tile": W.SelectionSlider(options=(16, 32, 64, 128), value=64, description="tile rows"),
        "groups": W.SelectionSlider(options=(1, 2, 4, 8), value=1, description="fork groups"),
        "timing": W.ToggleButtons(options=[("CUDA graph", "graph"), ("eager", "eager")], value="graph",
                                  description="model"),
    }

    def compute(prefix, sharers, suffix, gqa, rows_per_tile, groups, timing):
        hq, hkv = GQAS[gqa]
        groups = min(groups, sharers)
        fork = 256 if groups > 1 else 0  # each fork group shares 256 more tokens (a nested tree)
        sc = study.scenario(prefix, sharers, suffix, num_q_heads=hq, num_kv_heads=hkv, rows_per_tile=rows_per_tile,
                            groups=groups, fork=fork, model=cost_model("NVIDIA H200", timing))
        nest = f", {groups} fork groups sharing 256 more" if groups > 1 else ""
        return {"sc": sc, "plain": study.program_reads(sc, "plain", max_programs),
                "shared": study.program_reads(sc, "shared", max_programs),
                "model": "CUDA-graph" if timing == "graph" else "eager",
                "title": f"{sharers} sequences over a {prefix}-token prefix{nest}, {suffix} private tokens each, "
                         f"{gqa}"}

    return Panel(controls, compute, lambda r: spf.scenario_figure(r["sc"], r["plain"], r["shared"], r["title"],
                                                                  r["model"]),
                 enabled={"groups": lambda sharers, **_: sharers > 1})


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
        "prefix": W.SelectionSlider(options=PREFIXES[:-2], value=2048, description="prompt tokens"),
        "max_batch": W.SelectionSlider(options=(8, 16, 32, 64, 128), value=32, description="batch size"),
    }

    def compute(prompts, samples, prefix, max_batch):
        res = study.batching_study(prompts, samples, prefix, 256, max_batch)
        ratio = res["arrival"] / res["grouped"] if res["grouped"] else 1.0
        return {"res": res, "rows": rows,
                "title": f"{prompts} prompts x {samples} samples ({prefix} + 256 tokens), batches of {max_batch}: "
                         f"grouping reads {ratio:.2f}x less than arrival order"}

    return Panel(controls, compute, lambda r: spf.batching_figure(r["res"], r["rows"], r["title"]))


def forks_panel(requests: int = 200) -> Panel:
    """Trace, mode and the beam model's p_top -> memory saved by sharing for n = 2, 4, 6 against the vLLM paper."""
    controls = {
        "trace": W.Dropdown(options=[("Alpaca-like", "alpaca"), ("ShareGPT-like", "sharegpt")], value="alpaca",
                            description="trace"),
        "mode": W.ToggleButtons(options=[("parallel sampling", "parallel"), ("beam search", "beam")],
                                value="parallel", description="mode"),
        "p_top": W.SelectionSlider(options=(0.0, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0), value=forks.DEFAULT_P_TOP,
                                   description="beam p_top"),
    }

    def compute(trace, mode, p_top):
        rows = [{"n": n, "saving_pct": 100 * forks.lifetime_saving(trace, mode, n, p_top=p_top, requests=requests)}
                for n in (2, 4, 6)]
        paper = forks.PAPER.get((trace, mode))
        what = "parallel samples" if mode == "parallel" else f"beam search (p_top {p_top})"
        return {"rows": rows, "paper": paper,
                "title": f"Memory saved by block sharing: {what}, first {requests} requests of the {trace}-like trace"}

    return Panel(controls, compute, lambda r: spf.forks_figure(r["rows"], r["paper"], r["title"]),
                 enabled={"p_top": lambda mode, **_: mode == "beam"})


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
