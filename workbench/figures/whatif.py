"""Plotly figures of notebook 10 (serving what-if), built from the plain data of ``workbench.whatif.whatif`` and the
rows of ``workbench.studies.whatif`` (:func:`~workbench.studies.whatif.frontier`) and ``workbench.whatif.why``.

- :func:`frontier_figure`: throughput against TTFT p50 and TPOT p50 as the arrival rate grows, a curve per K/V
  scheme, and each scheme's quality against its throughput at the highest rate;
- :func:`memory_figure`: KV blocks in use over one run against the budget;
- :func:`why_figure`: one decode step (and a prefill) as its parts, each with its source, and the table of them;
- :func:`run_figure`: the run panel's page, memory and the why side by side over the table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.figures.titles import setup_title, wrap
from workbench.whatif.why import files_of, why_table

PALETTE = ("#264653", "#2a9d8f", "#e9c46a", "#e76f51", "#8ab17d", "#6d597a", "#9c6644", "#577590", "#f4a261")
PART_COLORS = {"weights": "#264653", "attention": "#2a9d8f", "write": "#e9c46a", "overhead": "#8d99ae",
               "prefill": "#e76f51"}
QUALITY = {"agreement": "greedy agreement with fp16", "mean_kl": "mean KL against fp16"}
BUDGET = "#d62828"
SOURCE_CHARS = 70  # a source's words a hover line holds
TABLE_ROW_PX = 24  # a table row (one line of 11-px text and its padding)
AXIS_PX = 60  # under a plot: its tick labels and axis title


def scheme_colors(schemes: Sequence[str]) -> dict[str, str]:
    """A colour per scheme, in order (fp16 first when given first)."""
    return {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(dict.fromkeys(schemes))}


def log_ticks(values: Sequence[float]) -> list[float]:
    """1, 2 and 5 times the powers of ten from below the smallest positive value to above the largest: a log
    axis's ticks, a few a decade (plotly labels a short log range with every digit)."""
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    if not pos:
        return []
    lo, hi = math.floor(math.log10(min(pos))), math.ceil(math.log10(max(pos)))
    return [m * 10.0 ** e for e in range(lo, hi + 1) for m in (1, 2, 5)
            if min(pos) / 2 <= m * 10.0 ** e <= max(pos) * 2]


def _hover_source(source: str) -> str:
    return wrap(source, SOURCE_CHARS)


def frontier_figure(rows: Sequence[Mapping], chosen: str, setup: Mapping, quality: str = "agreement") -> go.Figure:
    """The frontier of each K/V scheme and what it costs in quality.

    Args:
        rows: ``studies.whatif.frontier`` rows (``scheme``, ``rate``, ``throughput_tok_s``, ``ttft_p50_s``,
            ``tpot_p50_s``, ``preemptions``, ``agreement``, ``mean_kl``, ``ppl_change``, ``quality_source``).
        chosen: the scheme drawn thicker and ringed (none is when no row has it).
        setup: ``{"title", "subtitle"}``.
        quality: ``agreement`` or ``mean_kl``, the quality plotted (the other in the hover).

    Returns:
        Top: TTFT p50 (log) and TPOT p50 against throughput, a point a rate, a line a scheme; bottom: each scheme's
        quality against its throughput at the highest rate of the rows.
    """
    if quality not in QUALITY:
        raise ValueError(f"quality must be one of {sorted(QUALITY)}, got {quality!r}")
    if not rows:
        raise ValueError("rows must hold at least one frontier point")
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    colors = scheme_colors(schemes)
    top = max(r["rate"] for r in rows)
    fig = make_subplots(rows=2, cols=2, specs=[[{}, {}], [{"colspan": 2}, None]], row_heights=[0.55, 0.45],
                        vertical_spacing=0.2, horizontal_spacing=0.12, subplot_titles=(
                            "time to first token, p50 (ms)", "time per output token, p50 (ms)",
                            f"quality against throughput at {top:g} requests/s"))
    for s in schemes:
        pts = sorted((r for r in rows if r["scheme"] == s), key=lambda r: r["rate"])
        width = 4 if s == chosen else 2
        hover = [f"{s} at {r['rate']:g} requests/s: {r['throughput_tok_s']:,.0f} tokens/s, TTFT p50 "
                 f"{1e3 * r['ttft_p50_s']:.3g} ms, TPOT p50 {1e3 * r['tpot_p50_s']:.3g} ms, "
                 f"{r['preemptions']} preemptions" for r in pts]
        for col, key in ((1, "ttft_p50_s"), (2, "tpot_p50_s")):
            fig.add_scatter(x=[r["throughput_tok_s"] for r in pts], y=[1e3 * r[key] for r in pts],
                            mode="lines+markers", name=s, legendgroup=s, showlegend=col == 1,
                            line=dict(color=colors[s], width=width), marker=dict(size=7 if s == chosen else 5),
                            hovertext=hover, hoverinfo="text", row=1, col=col)
    fig.update_yaxes(type="log", tickvals=log_ticks([1e3 * r["ttft_p50_s"] for r in rows]), title_text="ms",
                     row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=2)
    for col in (1, 2):
        fig.update_xaxes(title_text="throughput (tokens/s)", row=1, col=col)
    last = sorted((r for r in rows if r["rate"] == top), key=lambda r: r["throughput_tok_s"])
    ys = [r[quality] for r in last]
    fig.add_scatter(x=[r["throughput_tok_s"] for r in last], y=ys, mode="markers+text", showlegend=False,
                    text=[r["scheme"] for r in last], textfont_size=10,  # neighbours' labels above and below
                    textposition=["top center" if i % 2 == 0 else "bottom center" for i in range(len(last))],
                    marker=dict(size=[14 if r["scheme"] == chosen else 10 for r in last],
                                color=[colors[r["scheme"]] for r in last],
                                line=dict(color=["#d62828" if r["scheme"] == chosen else "white" for r in last],
                                          width=2)),
                    hovertext=[f"{r['scheme']}: {r['throughput_tok_s']:,.0f} tokens/s at {top:g} requests/s<br>"
                               f"greedy agreement {r['agreement']:.3g}, mean KL {r['mean_kl']:.3g}, perplexity "
                               f"{r['ppl_change']:+.1%}<br>{_hover_source(r['quality_source'])}" for r in last],
                    hoverinfo="text", row=2, col=1)
    shown = [y for y in ys if isinstance(y, float) and math.isfinite(y)]
    if quality == "mean_kl" and any(y > 0 for y in shown):
        pos = [y for y in shown if y > 0]
        fig.update_yaxes(type="log", range=[math.log10(min(pos)) - 0.5, math.log10(max(pos)) + 0.5], row=2, col=1)
    elif shown:
        fig.update_yaxes(range=[min(0.0, min(shown)) - 0.05, max(1.0, max(shown)) + 0.15], row=2, col=1)
    zero = quality == "mean_kl" and any(y == 0 for y in shown)  # fp16 against itself: no point on a log axis
    fig.update_yaxes(title_text=QUALITY[quality] + (" (0 not drawn)" if zero else ""), row=2, col=1)
    fig.update_xaxes(title_text=f"throughput at {top:g} requests/s (tokens/s)", row=2, col=1)
    head = setup_title(setup, margin_t=110, height=760)
    fig.update_annotations(font_size=13)
    fig.update_layout(height=head["height"], margin=dict(t=head["margin_t"], r=10, l=60, b=50),
                      title=dict(text=head["title"], font_size=14, y=1 - 12 / head["height"], yanchor="top"),
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.1, yanchor="top", font_size=11))
    return fig


def _memory_traces(fig: go.Figure, out: Mapping, row: int | None = None, col: int | None = None) -> None:
    m = out["memory"]
    where = {"row": row, "col": col} if row is not None else {}
    gib = m["block_bytes"] / (1 << 30)
    fig.add_scatter(x=m["time_s"], y=m["blocks"], mode="lines", name="blocks in use", line=dict(color="#264653"),
                    fill="tozeroy", fillcolor="rgba(42,157,143,0.25)",
                    hovertemplate="%{x:.3g} s: %{y:,} blocks<extra></extra>", **where)
    end = m["time_s"][-1] if m["time_s"] else 1.0
    fig.add_scatter(x=[0, end], y=[m["kv_blocks"]] * 2, mode="lines", name="KV budget",
                    line=dict(color=BUDGET, dash="dash", width=1.5),
                    hovertext=wrap(f"budget {m['kv_blocks']:,} blocks ({m['kv_blocks'] * gib:.3g} GiB): "
                                   f"{m['budget']}", SOURCE_CHARS), hoverinfo="text", **where)
    fig.update_yaxes(title_text="KV blocks", range=[0, 1.08 * max(m["kv_blocks"], max(m["blocks"], default=0))],
                     **where)
    fig.update_xaxes(title_text="time since the first arrival (s)", **where)


def _why_traces(fig: go.Figure, out: Mapping, row: int | None = None, col: int | None = None) -> None:
    where = {"row": row, "col": col} if row is not None else {}
    at = out["why"]["decode_at"]
    steps = {"decode": f"decode step<br>({at['batch']} x {at['context_per_sequence']} tokens)",
             "prefill": "prefill<br>(mean prompt)"}
    shown = set()
    for step, label in steps.items():
        for p in why_table(out, step):
            fig.add_bar(y=[label], x=[p["ms"]], orientation="h", name=p["part"], legendgroup=p["part"],
                        showlegend=p["part"] not in shown, marker_color=PART_COLORS.get(p["part"], "#a8b8c0"),
                        hovertext=[f"{p['part']}: {p['ms']:.3g} ms ({p['share']:.0%}), {p['kind']}<br>"
                                   f"{_hover_source(p['source'])}"], hoverinfo="text", **where)
            shown.add(p["part"])
    fig.update_xaxes(title_text="ms", **where)
    fig.update_yaxes(autorange="reversed", **where)


def why_table_trace(out: Mapping) -> go.Table:
    """The parts of the decode step and the prefill as a plotly Table: step, part, ms, share, kind, files."""
    rows = [{"step": step, **p} for step in ("decode", "prefill") for p in why_table(out, step)]
    return go.Table(columnwidth=[0.08, 0.1, 0.07, 0.07, 0.2, 0.48],
                    header=dict(values=[f"<b>{h}</b>" for h in ("step", "part", "ms", "share", "kind", "from")],
                                fill_color="#eeeeee", align="left", font=dict(size=12), height=TABLE_ROW_PX),
                    cells=dict(values=[[r["step"] for r in rows], [r["part"] for r in rows],
                                       [f"{r['ms']:.3g}" for r in rows], [f"{r['share']:.0%}" for r in rows],
                                       [r["kind"] for r in rows], [r["files"] for r in rows]],
                               align="left", font=dict(size=11), height=TABLE_ROW_PX, fill_color="white",
                               line_color="#dddddd"))


def _table_px(out: Mapping) -> int:
    """The why table's height: its header and one row a part of the decode step and the prefill, and a margin."""
    return TABLE_ROW_PX * (1 + len(out["why"]["decode"]) + len(out["why"]["prefill"])) + 12


def _layout(fig: go.Figure, setup: Mapping, margin_t: int, plot_px: int, legend_y: float = -0.12) -> go.Figure:
    """Title (wrapped, :func:`setup_title`) over ``plot_px`` of plots, the legend at ``legend_y`` (paper)."""
    head = setup_title(setup, margin_t=margin_t, height=margin_t + plot_px + 50)
    fig.update_annotations(font_size=13)
    fig.update_layout(height=head["height"], barmode="stack", margin=dict(t=head["margin_t"], r=10, l=60, b=50),
                      title=dict(text=head["title"], font_size=14, y=1 - 12 / head["height"], yanchor="top"),
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=legend_y, yanchor="top", font_size=11))
    return fig


def _over_table(top_px: int, table_px: int, gap_px: int) -> dict:
    """``make_subplots`` arguments of plots ``top_px`` high over a table ``table_px`` high, ``gap_px`` apart (the
    plots' axes and the legend in the gap), and where the legend goes: ``(kwargs, plot_px, legend_y)``."""
    plot_px = top_px + gap_px + table_px
    return ({"row_heights": [top_px, table_px], "vertical_spacing": gap_px / plot_px}, plot_px,
            (table_px + gap_px - AXIS_PX) / plot_px)


def memory_figure(out: Mapping, setup: Mapping) -> go.Figure:
    """KV blocks in use over one run (``whatif()``'s ``memory``: a sampled timeline) against its budget (dashed)."""
    fig = go.Figure()
    _memory_traces(fig, out)
    return _layout(fig, setup, margin_t=90, plot_px=330, legend_y=-0.25)


def why_figure(out: Mapping, setup: Mapping) -> go.Figure:
    """One decode step at the run's mean batch and context, and a prefill of its mean prompt, as stacked parts
    (weights, attention, write, overhead; prefill, overhead), each part's source in its hover; the table of the
    parts and the files they came from below."""
    grid, plot_px, legend_y = _over_table(220, _table_px(out), 110)
    fig = make_subplots(rows=2, cols=1, specs=[[{"type": "xy"}], [{"type": "table"}]], **grid)
    _why_traces(fig, out, 1, 1)
    fig.add_trace(why_table_trace(out), row=2, col=1)
    return _layout(fig, setup, margin_t=90, plot_px=plot_px, legend_y=legend_y)


def run_figure(out: Mapping, setup: Mapping) -> go.Figure:
    """The run panel's page: memory over time (left) and the why of a step (right) over the table of the step's
    parts and their files."""
    grid, plot_px, legend_y = _over_table(300, _table_px(out), 120)
    fig = make_subplots(rows=2, cols=2, specs=[[{"type": "xy"}, {"type": "xy"}],
                                               [{"type": "table", "colspan": 2}, None]],
                        column_widths=[0.52, 0.48], horizontal_spacing=0.2, **grid,
                        subplot_titles=("KV memory over the run", "the why: a step's parts (ms)", ""))
    _memory_traces(fig, out, 1, 1)
    _why_traces(fig, out, 1, 2)
    fig.add_trace(why_table_trace(out), row=2, col=1)
    return _layout(fig, setup, margin_t=110, plot_px=plot_px, legend_y=legend_y)


def sources_line(out: Mapping) -> str:
    """The profile's files, in words, for a subtitle."""
    return "profile: " + ", ".join(out["sources"]["files"])


def quality_line(rows: Sequence[Mapping]) -> str:
    """Where the quality column came from, once per file, for a subtitle."""
    files = dict.fromkeys(f for r in rows for f in files_of(r["quality_source"]))
    return "quality: SmolLM2-135M on real text, " + (", ".join(files) or "none measured")
