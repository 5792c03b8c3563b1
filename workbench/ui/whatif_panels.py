"""The panels of notebook 10: one serving what-if (KV memory over the run and the why of a step, with the files each
number came from) and the frontier of several K/V schemes as the arrival rate grows, with their quality.

The run panel is the controls, computation and figure of the ``whatif`` study (``workbench.studies.whatif``), which
the ``whatif`` sweep runs too; the frontier panel's points are that sweep's points over schemes x rates. Both
compute with ``workbench.whatif.whatif`` (``studies.whatif.run`` keeps the runs a panel goes back to);
``whatif_figures`` draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as W

from workbench.figures import whatif as whatif_figures
from workbench.publish.notebook import format_value
from workbench.quant.names import WHATIF_GRID
from workbench.studies import whatif as wi
from workbench.ui.controls import control, controls_for
from workbench.ui.panels import Panel

FRONTIER_SCHEMES = WHATIF_GRID
FRONTIER_RATES = (2.0, 8.0, 32.0, 128.0)
FRONTIER_CONTROLS = ("model", "trace", "block_size", "kv_gib", "preemption", "scheme")


def _kv_words(kv_gib: float) -> str:
    return f"KV {format_value(kv_gib)} GiB" if kv_gib else "KV auto"


def run_setup(out: dict) -> dict:
    """The run panel's title and subtitle (``{"title", "subtitle"}``) of one what-if."""
    c, s, m = out["config"], out["summary"], out["memory"]
    f = format_value
    title = (f"{c['model']}, {c['scheme']} K/V at {f(c['rate'])} requests/s ({wi.trace_label(c['trace'])}): "
             f"{f(s['throughput_tok_s'])} tokens/s, TTFT p50 {f(1e3 * s['ttft_p50_s'])} ms, TPOT p50 "
             f"{f(1e3 * s['tpot_p50_s'])} ms")
    preempt = (f"swap to {f(c['host_gib'])} GiB of host in {c['host_format'] or c['scheme']}"
               if c["preemption"] == "swap" and c["host_gib"] else "recompute" if c["preemption"] == "recompute"
               else "swap, but no host memory: recompute")
    kept = f"{c['policy']} keeps {c['keep']:.0%} of each prompt" if c["keep"] < 1 else "every prompt kept whole"
    words = {"kv_scheme": f"{c['scheme']} K/V", "eviction": "evicted prompts", "host_format": "host copies"}
    quality = "; ".join(f"{words[k]} {f(q['agreement'])} ({', '.join(wi.files_of(q['source'])) or q['source']})"
                        for k, q in out["quality"].items() if q is not None and q["source"] != "no eviction")
    sub = (f"peak {s['peak_blocks']:,} of {m['kv_blocks']:,} blocks of {c['block_size']} tokens "
           f"({f(100 * s['peak_blocks'] / m['kv_blocks'])}%), {s['preemptions']} preemptions, {s['swaps_out']} swaps;"
           f" budget: {m['budget']}<br>on a full cache: {preempt}; {kept}"
           f"<br>greedy agreement with fp16 on SmolLM2-135M: {quality}<br>{whatif_figures.sources_line(out)}")
    return {"title": title, "subtitle": sub}


def run_panel(n: int = 1000, seed: int = 0, **values) -> Panel:
    """Model, GPU profile, trace, arrival rate, block size, K/V scheme, KV GiB, preemption, host GiB and format, the
    share of a prompt kept and the eviction policy (the controls of the ``whatif`` study) -> one what-if of ``n``
    requests: KV memory over the run, one decode step's parts with their sources, and the table of them.

    Args:
        n: requests of the trace (``smoke_size`` in a notebook).
        seed: the trace's seed.
        values: the controls' first values (default the study's), e.g. ``scheme="int4/token"``.
    """

    def compute(**controls):
        out = wi.run(**controls, n=n, seed=seed)
        return {"out": out, "setup": run_setup(out)}

    return Panel(controls_for(wi.WHATIF, values), compute, wi.WHATIF.draw, live=False, enabled=wi.WHATIF.enabled)


def frontier_setup(rows: list[dict], model: str, trace: str, block_size: int, kv_gib: float, preemption: str,
                   rates: Sequence[float]) -> dict:
    top = max(rates)
    best = max(rows, key=lambda r: r["throughput_tok_s"] if r["rate"] == top else -1.0)
    head = (f"{model}, {wi.TRACES[trace]} trace, {block_size}-token blocks, {_kv_words(kv_gib)}, {preemption}: "
            f"a curve per K/V scheme over {', '.join(format_value(r) for r in rates)} requests/s")
    at_top = ", ".join(f"{r['scheme']} {format_value(r['throughput_tok_s'])}" for r in rows if r["rate"] == top)
    sub = (f"tokens/s at {format_value(top)} requests/s: {at_top} (most: {best['scheme']})<br>"
           f"{whatif_figures.quality_line(rows)}")
    return {"title": head, "subtitle": sub}


def frontier_panel(schemes: Sequence[str] = FRONTIER_SCHEMES, rates: Sequence[float] = FRONTIER_RATES,
                   n: int = 1000, seed: int = 0, **values) -> Panel:
    """Model, trace, block size, KV GiB, preemption, the scheme ringed and the quality shown -> the ``whatif``
    sweep's points over ``schemes`` x ``rates`` (the other parameters at the study's defaults): throughput against
    TTFT and TPOT p50 a curve per scheme, and each scheme's quality against its throughput at the highest rate.

    Args:
        schemes: the K/V schemes drawn (each one the H200 profile measured).
        rates: the arrival rates (requests/s) of each curve.
        n: requests of each run.
        seed: the trace's seed.
        values: the controls' first values, e.g. ``kv_gib=4.0``, ``quality="mean_kl"``.
    """
    schemes, rates = tuple(schemes), tuple(float(r) for r in rates)
    for s in schemes:
        wi.WHATIF.param("scheme").check(s)
    for r in rates:
        wi.WHATIF.param("rate").check(r)
    if not schemes or not rates:
        raise ValueError(f"schemes and rates must be non-empty, got {schemes!r} and {rates!r}")
    quality = values.pop("quality", "agreement")
    unknown = sorted(set(values) - set(FRONTIER_CONTROLS))
    if unknown:
        raise ValueError(f"frontier_panel: {unknown} are not its controls ({', '.join(FRONTIER_CONTROLS)}, quality)")
    values.setdefault("scheme", schemes[-1])
    controls = {name: control(wi.WHATIF.param(name), values.get(name),
                              options=schemes if name == "scheme" else None) for name in FRONTIER_CONTROLS}
    controls["scheme"].description = "ringed"
    controls["quality"] = W.ToggleButtons(options=[("agreement", "agreement"), ("mean KL", "mean_kl")],
                                          value=quality, description="quality")
    fixed = {k: v for k, v in wi.WHATIF.defaults().items() if k not in (*FRONTIER_CONTROLS, "rate", "n", "seed")}

    def compute(model, trace, block_size, kv_gib, preemption, scheme, quality):
        rows = wi.frontier(schemes, rates, **fixed, model=model, trace=trace, block_size=block_size, kv_gib=kv_gib,
                           preemption=preemption, n=n, seed=seed)
        return {"rows": rows, "chosen": scheme, "quality": quality,
                "setup": frontier_setup(rows, model, trace, block_size, kv_gib, preemption, rates)}

    return Panel(controls, compute, lambda r: whatif_figures.frontier_figure(r["rows"], r["chosen"], r["setup"],
                                                                             r["quality"]), live=False)
