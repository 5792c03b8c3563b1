"""Plotly figures of notebook 05 (tiers and prefetch), built from the plain tables of ``workbench.results.tiers``,
``workbench.tiers.replay`` and ``workbench.sim.preemption_cost``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.figures.titles import setup_title
from workbench.results.tiers import DIRECTIONS, PATHS

PATH_COLORS = {"dma": "#2a9d8f", "dma_per_block": "#e76f51", "sm": "#264653"}
PATH_SHORT = {"dma": "gathered batch (DMA)", "dma_per_block": "one copy per block", "sm": "SM copy kernel"}
TIMELINE_COLORS = {"compute": "#8d99ae", "demand": "#e76f51", "prefetch": "#2a9d8f"}
TIMELINE_NAMES = {"compute": "compute", "demand": "demand fetch (stall)", "prefetch": "prefetch (beside compute)"}
CHOSEN, OTHER = "#264653", "#a8b8c0"


def size_label(nbytes: int) -> str:
    """4096 -> '4 KiB', 2097152 -> '2 MiB', 23040 -> '22.5 KiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def bandwidth_overview(grid, curves: Mapping[str, Sequence[tuple[int, float]]], block_bytes: int,
                       timing: str) -> go.Figure:
    """The measured host link on one page.

    Args:
        grid: a :class:`workbench.results.tiers.BandwidthMap` (fractions of the pinned bandwidth).
        curves: :func:`workbench.results.tiers.batch_curves` at ``block_bytes``, same direction and value.
        block_bytes: the block size framed on the map and drawn on the right.
        timing: words for the value (``"device time, CUDA graph"``).

    Returns:
        Left, the map block size x blocks per batch of ``grid``'s path; right, every path by batch size at
        ``block_bytes``.
    """
    xs = [size_label(b) for b in grid.block_bytes]
    ys = [str(n) for n in grid.blocks]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.2, subplot_titles=(
        f"{PATH_SHORT[grid.path]}", f"{size_label(block_bytes)} blocks, every path"))
    hover = [[(f"{n} x {x} ({size_label(n * b)}): {v:.3f} of pinned, {g:.1f} GB/s" if v is not None else "")
              for x, b, v, g in zip(xs, grid.block_bytes, zrow, grow, strict=True)]
             for n, zrow, grow in zip(grid.blocks, grid.z, grid.gbps, strict=True)]
    fig.add_heatmap(z=[list(r) for r in grid.z], x=xs, y=ys, zmin=0, zmax=1, colorscale="Viridis",
                    text=[[f"{v:.2f}" if v is not None else "" for v in r] for r in grid.z], texttemplate="%{text}",
                    hovertext=hover, hoverinfo="text", xgap=1, ygap=1,
                    colorbar=dict(title=dict(text="of pinned", side="top"), x=0.49, xanchor="left", len=0.95,
                                  thickness=12),
                    row=1, col=1)
    j = grid.block_bytes.index(block_bytes)
    fig.add_shape(type="rect", x0=j - 0.5, x1=j + 0.5, y0=-0.5, y1=len(ys) - 0.5, line=dict(color="#d62828", width=3),
                  row=1, col=1)
    fig.update_xaxes(title_text="block size", type="category", tickangle=-40, tickfont_size=10, row=1, col=1)
    fig.update_yaxes(title_text="blocks per batch", type="category", row=1, col=1)
    for path, pts in curves.items():
        chosen = path == grid.path
        fig.add_scatter(x=[n for n, _ in pts], y=[v for _, v in pts], mode="lines+markers", name=PATH_SHORT[path],
                        line=dict(color=PATH_COLORS[path], width=4 if chosen else 2,
                                  dash="dot" if path == "dma_per_block" else "solid"),
                        marker=dict(size=9 if chosen else 6),
                        hovertemplate=f"{PATH_SHORT[path]}: %{{x}} blocks, %{{y:.3f}} of pinned<extra></extra>",
                        row=1, col=2)
    fig.update_xaxes(title_text="blocks per batch", type="log", tickvals=list(grid.blocks), row=1, col=2)
    fig.update_yaxes(title_text="fraction of pinned bandwidth", range=[0, 1.05], row=1, col=2)
    fig.update_layout(
        height=470, margin=dict(t=105, r=10, b=50), title_font_size=14,
        legend=dict(orientation="h", x=1.0, xanchor="right", y=-0.16, yanchor="top", font_size=11),
        title=f"{PATHS[grid.path]}, {DIRECTIONS[grid.direction]}<br><sup>fraction of the pinned "
              f"{grid.pinned_gbps:.1f} GB/s of the same run ({timing}); {grid.source}</sup>")
    return fig


def beside_overlap(beside: Sequence[Sequence[dict]], overlap: Sequence[Sequence[dict]],
                   names: Sequence[str]) -> go.Figure:
    """A transfer beside compute, from several runs: left, the decode's slowdown with transfers running beside it,
    per path and SM grid cap; right, a prefetch beside 20 decode steps: the share of it hidden and the decode's
    slowdown. Bars: the last run; markers: the others (run-to-run spread)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.1, subplot_titles=(
        "decode slowdown with transfers beside it", "a prefetch beside 20 decode steps"))
    last, others = beside[-1], beside[:-1]
    labels = [r["label"] for r in last]
    colors = [PATH_COLORS["dma"] if r["path"] == "dma" else PATH_COLORS["sm"] for r in last]
    fig.add_bar(x=labels, y=[100 * r["slowdown"] for r in last], marker_color=colors, name="decode slowdown",
                text=[f"{100 * r['slowdown']:.0f}%<br>{r['transfer_gbps']:.0f} GB/s" for r in last],
                textposition="outside", showlegend=False,
                hovertemplate="%{x}: decode %{y:.1f}% slower<extra></extra>", row=1, col=1)
    for rows, name in zip(others, names[:-1], strict=True):
        fig.add_scatter(x=[r["label"] for r in rows], y=[100 * r["slowdown"] for r in rows], mode="markers",
                        name=f"other run ({name})", marker=dict(color="#111", symbol="diamond", size=8),
                        legendgroup="other", hovertemplate="%{x}: %{y:.1f}% (" + name + ")<extra></extra>",
                        row=1, col=1)
    top = max(100 * r["slowdown"] for rows in beside for r in rows)
    fig.update_yaxes(title_text="decode time beside transfers (% over alone)", range=[0, top * 1.3], row=1, col=1)
    fig.update_xaxes(tickangle=-30, tickfont_size=10, row=1, col=1)

    last_o, others_o = overlap[-1], overlap[:-1]
    labels = [r["label"] for r in last_o]
    for key, name, color in (("hidden", "share of the prefetch hidden", "#2a9d8f"),
                             ("decode_slowdown", "decode slowdown", "#e76f51")):
        fig.add_bar(x=labels, y=[100 * r[key] for r in last_o], name=name, marker_color=color, offsetgroup=key,
                    text=[f"{100 * r[key]:.0f}%" for r in last_o], textposition="outside",
                    hovertemplate="%{x}: " + name + " %{y:.1f}%<extra></extra>", row=1, col=2)
        for rows, run in zip(others_o, names[:-1], strict=True):
            fig.add_scatter(x=[r["label"] for r in rows], y=[100 * r[key] for r in rows], mode="markers",
                            offsetgroup=key, marker=dict(color="#111", symbol="diamond", size=8), showlegend=False,
                            legendgroup="other", hovertemplate="%{x}: %{y:.1f}% (" + run + ")<extra></extra>",
                            row=1, col=2)
    fig.update_yaxes(title_text="% (of the transfer time / of decode alone)", range=[0, 110], row=1, col=2)
    fig.update_xaxes(tickangle=-30, tickfont_size=10, row=1, col=2)
    fig.update_layout(height=540, barmode="group", margin=dict(t=125, r=10, b=40), title_font_size=14,
                      scattermode="group",
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.33, yanchor="top", font_size=11),
                      title=f"The cost of a transfer beside compute (H200; bars: {names[-1]})<br><sup>left: a W1 "
                            "decode (64 x 4k tokens) with 16 MiB transfers on a side stream (labels: GB/s they kept)"
                            "<br>right: 192 MiB of 64 KiB blocks swapped in beside 20 decode steps</sup>")
    return fig


def prefetch_overview(rows: Sequence[dict], chosen: str, timeline: Sequence, setup: Mapping) -> go.Figure:
    """Every strategy on one trace and tier configuration, and the chosen one's transfers against compute.

    Args:
        rows: :func:`workbench.tiers.replay.compare` rows (``strategy``, ``label``, ``hit_rate``, ``hits``,
            ``misses``, ``demand_stall_s``, ``prefetch_stall_s``, ``slowdown``, ``prefetched``, ``prefetch_wasted``;
            ``name``, optional: a short name for the axis, default ``label``).
        chosen: the ``strategy`` chosen (ringed in the bars; none is when no row has it: a strategy the trace
            cannot run).
        timeline: its :class:`workbench.tiers.replay.Interval` list, the first steps.
        setup: ``{"title", "subtitle", "timeline_title"}``: the trace, the tiers and the timeline, in words.

    Returns:
        Top, hit rate and stall (demand fetches, waiting for a prefetch) per strategy; bottom, the timeline.
    """
    fig = make_subplots(rows=2, cols=2, specs=[[{}, {}], [{"colspan": 2}, None]], row_heights=[0.52, 0.48],
                        vertical_spacing=0.16, horizontal_spacing=0.1, subplot_titles=(
                            "hit rate", "stall (ms); labels: run time / compute", setup["timeline_title"]))
    names = [r.get("name", r["label"]) for r in rows]
    ring = ["#d62828" if r["strategy"] == chosen else "rgba(0,0,0,0)" for r in rows]
    hover = [f"{r['label']}: {r['hits']} hits, {r['misses']} misses; prefetched {r['prefetched']} "
             f"({r['prefetch_wasted']} never read)" for r in rows]
    fig.add_bar(x=names, y=[r["hit_rate"] for r in rows], showlegend=False, name="hit rate",
                marker=dict(color=[CHOSEN if r["strategy"] == chosen else OTHER for r in rows],
                            line=dict(color=ring, width=3)),
                text=[f"{r['hit_rate']:.3f}" for r in rows], textposition="outside", hovertext=hover,
                hoverinfo="text", row=1, col=1)
    fig.update_yaxes(title_text="reads found on the device", range=[0, 1.18], row=1, col=1)
    demand = [1e3 * r["demand_stall_s"] for r in rows]
    wait = [1e3 * r["prefetch_stall_s"] for r in rows]
    fig.add_bar(x=names, y=demand, name=TIMELINE_NAMES["demand"], marker=dict(color=TIMELINE_COLORS["demand"],
                line=dict(color=ring, width=3)), legendgroup="demand", legendrank=2, hovertext=hover,
                hovertemplate="%{x}: demand fetches %{y:.3f} ms<extra></extra>", row=1, col=2)
    # stacked by hand (the figure is in overlay mode for the timeline's bars, which sit at their start times)
    fig.add_bar(x=names, y=wait, base=demand, name="waiting for a prefetch (stall)", marker_color="#f4a261",
                legendrank=3, hovertemplate="%{x}: waiting for a prefetch %{y:.3f} ms<extra></extra>", row=1, col=2)
    stall = [d + w for d, w in zip(demand, wait, strict=True)]
    fig.add_scatter(x=names, y=stall, mode="text", showlegend=False, hoverinfo="skip",
                    text=[f"x{r['slowdown']:.2f}" for r in rows], textposition="top center", textfont_size=11,
                    row=1, col=2)
    fig.update_yaxes(title_text="stall (ms)", range=[0, max(stall + [1e-3]) * 1.3], row=1, col=2)
    for c in (1, 2):
        fig.update_xaxes(tickfont_size=10, row=1, col=c)

    for kind in ("compute", "demand", "prefetch"):
        bars = [i for i in timeline if i.kind == kind]
        fig.add_bar(y=[TIMELINE_NAMES[kind].split(" (")[0]] * len(bars), x=[1e3 * (i.end_s - i.start_s) for i in bars],
                    base=[1e3 * i.start_s for i in bars], orientation="h", name=TIMELINE_NAMES[kind],
                    marker=dict(color=TIMELINE_COLORS[kind], line=dict(color="white", width=0.5)),
                    legendgroup=kind, showlegend=kind != "demand", legendrank={"compute": 1, "prefetch": 4}.get(kind),
                    hovertext=[f"step {i.step}: {kind}, {i.blocks} blocks, {1e6 * (i.end_s - i.start_s):.1f} us "
                               f"({1e3 * i.start_s:.3f} - {1e3 * i.end_s:.3f} ms)" for i in bars], hoverinfo="text",
                    row=2, col=1)
    fig.update_yaxes(type="category", categoryorder="array", autorange="reversed",
                     categoryarray=[TIMELINE_NAMES[k].split(" (")[0] for k in ("compute", "demand", "prefetch")],
                     row=2, col=1)
    fig.update_xaxes(title_text="time (ms)", title_standoff=4, row=2, col=1)
    top = setup_title(setup, margin_t=130, height=640)  # wrapped to fit
    fig.update_layout(
        height=top["height"], barmode="overlay", margin=dict(t=top["margin_t"], r=10, l=60, b=50), title_font_size=14,
        legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.13, yanchor="top", font_size=11),
        title=top["title"])
    return fig


def preemption_curve(rows: Sequence[dict], setup: Mapping) -> go.Figure:
    """Swap (one copy per block, or batched) against recompute by block size, the vLLM paper's Figure 19(a).

    Args:
        rows: :func:`workbench.sim.preemption_cost.block_size_curve` rows.
        setup: ``{"title", "subtitle"}``.
    """
    x = [r["block_size"] for r in rows]
    fig = go.Figure()
    for key, name, color, dash in (("swap_per_block_s", "swap, block by block", "#e76f51", "solid"),
                                   ("swap_batched_s", "swap, batched (one transfer each way)", "#2a9d8f", "solid"),
                                   ("recompute_s", "recompute (prefill again)", "#264653", "dash")):
        fig.add_scatter(x=x, y=[1e3 * r[key] for r in rows], mode="lines+markers", name=name,
                        line=dict(color=color, dash=dash, width=3), marker=dict(size=7),
                        hovertemplate=f"{name}: block %{{x}} tokens, %{{y:.2f}} ms<extra></extra>")
    cross = next((a for a, b in zip(rows, rows[1:], strict=False) if a["faster"] != b["faster"]), None)
    if cross is not None:
        i = rows.index(cross)
        fig.add_vrect(x0=x[i], x1=x[i + 1], fillcolor="#e9c46a", opacity=0.25, line_width=0)
    ys = [1e3 * r[k] for r in rows for k in ("swap_per_block_s", "swap_batched_s", "recompute_s")]
    fig.update_xaxes(title_text="block size (tokens)", type="log", tickvals=x, ticktext=[str(b) for b in x])
    lo, hi = min(ys) / 1.5, max(ys) * 1.5
    ticks = [m * 10**e for e in range(-3, 5) for m in (1, 2, 3, 5) if lo <= m * 10**e <= hi]
    fig.update_yaxes(title_text="swap out + in, or recompute (ms)", type="log", tickvals=ticks,
                     ticktext=[f"{t:g}" for t in ticks], range=[math.log10(lo), math.log10(hi)])
    top = setup_title(setup, margin_t=115, height=470)  # wrapped to fit
    fig.update_layout(height=top["height"], margin=dict(t=top["margin_t"], r=10, b=40), title_font_size=14,
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.2, yanchor="top"),
                      title=top["title"])
    return fig


FORMAT_COLORS = {"down": "#2a9d8f", "up": "#264653", "copy": "#8d99ae", "transcode": "#e76f51", "kl": "#e9c46a"}


def format_overview(rows: Sequence[dict], chosen: str, setup: Mapping) -> go.Figure:
    """What a storage format per tier buys and costs, one bar per format.

    Args:
        rows: ``workbench.studies.tiers.formats_table`` rows (``format``, ``transcodes``, ``bytes_per_token``,
            ``down_`` / ``up_tokens_per_s``, ``_speedup``, ``_copy_s``, ``_transcode_s``, ``_hidden``, ``mean_kl``,
            ``agreement``, ``ppl_change``), the device's own format (``transcodes`` False) among them.
        chosen: the format ringed (none is when no row has it: a format that cannot store the block size).
        setup: ``{"title", "subtitle"}``.

    Returns:
        Top, tokens/s moved down and up per format, the device format's down rate as a dashed line; bottom left,
        a batch's copy against its transcode (down); bottom right, the quality cost (mean KL against fp16, log).
    """
    fig = make_subplots(rows=2, cols=2, specs=[[{"colspan": 2}, None], [{}, {}]], row_heights=[0.5, 0.5],
                        vertical_spacing=0.2, horizontal_spacing=0.12, subplot_titles=(
                            "tokens moved per second (millions); labels: x the device format's",
                            "a batch down: copy and transcode (µs)", "quality cost: mean KL against fp16"))
    names = [r["format"] for r in rows]
    ring = ["#d62828" if n == chosen else "rgba(0,0,0,0)" for n in names]
    for d, word in (("down", "down (to the tier)"), ("up", "up (back to the device)")):
        fig.add_bar(x=names, y=[1e-6 * r[f"{d}_tokens_per_s"] for r in rows], name=word,
                    marker=dict(color=FORMAT_COLORS[d], line=dict(color=ring, width=3)), offsetgroup=d,
                    text=[f"x{r[f'{d}_speedup']:.2f}" for r in rows], textposition="outside", textfont_size=10,
                    hovertext=[f"{r['format']} {d}: {r[f'{d}_tokens_per_s'] / 1e6:.2f} M tokens/s (x"
                               f"{r[f'{d}_speedup']:.2f}), {r['bytes_per_token']:,.0f} B a token, link "
                               f"{r[f'{d}_link_gbps']:.1f} GB/s" for r in rows], hoverinfo="text", row=1, col=1)
    ref = next((r for r in rows if not r["transcodes"]), None)
    if ref is not None:
        fig.add_scatter(x=names, y=[1e-6 * ref["down_tokens_per_s"]] * len(names), mode="lines",
                        name=f"{ref['format']} (the device's bytes) down", hoverinfo="skip",
                        line=dict(color="#111", dash="dash", width=1.5), row=1, col=1)
    top = max(1e-6 * r[f"{d}_tokens_per_s"] for r in rows for d in ("down", "up"))
    fig.update_yaxes(title_text="M tokens/s", range=[0, top * 1.25], row=1, col=1)
    for key, word in (("down_copy_s", "copy"), ("down_transcode_s", "transcode")):
        fig.add_bar(x=names, y=[1e6 * r[key] for r in rows], name=f"{word} a batch (down)",
                    marker=dict(color=FORMAT_COLORS[word], line=dict(color=ring, width=3)), offsetgroup=key,
                    hovertext=[f"{r['format']}: {word} {1e6 * r[key]:.1f} µs a batch; transcode "
                               f"{r['down_hidden']:.0%} hidden" for r in rows], hoverinfo="text", row=2, col=1)
    fig.update_yaxes(title_text="µs a batch", row=2, col=1)
    kl = [r["mean_kl"] if r["mean_kl"] > 0 else None for r in rows]  # NaN (no row) and fp16's 0 have no bar
    fig.add_bar(x=names, y=kl, name="mean KL", showlegend=False,
                marker=dict(color=FORMAT_COLORS["kl"], line=dict(color=ring, width=3)),
                text=[f"{r['agreement']:.2f}" if not math.isnan(r["agreement"]) else "" for r in rows],
                textposition="outside", textfont_size=10,
                hovertext=[f"{r['format']}: mean KL {r['mean_kl']:.3g}, greedy agreement {r['agreement']:.2f}, "
                           f"perplexity {r['ppl_change']:+.1%}" for r in rows], hoverinfo="text", row=2, col=2)
    shown = [v for v in kl if v]
    if shown:
        lo, hi = math.log10(min(shown)) - 0.3, math.log10(max(shown)) + 0.6
        fig.update_yaxes(type="log", range=[lo, hi], exponentformat="power", row=2, col=2)  # not plotly's "100µ"
    fig.update_yaxes(title_text="mean KL (labels: agreement)", row=2, col=2)
    for row, col in ((1, 1), (2, 1), (2, 2)):
        fig.update_xaxes(tickangle=-35, tickfont_size=10, row=row, col=col)
    head = setup_title(setup, margin_t=130, height=700)  # wrapped to fit
    # the title's lines from the top (plotly centres them in the margin, onto the first subplot's title)
    fig.update_layout(height=head["height"], barmode="group", margin=dict(t=head["margin_t"], r=10, l=60, b=50),
                      title=dict(text=head["title"], font_size=14, y=1 - 12 / head["height"], yanchor="top"),
                      legend=dict(orientation="h", x=0.0, xanchor="left", y=-0.2, yanchor="top", font_size=11))
    return fig
