"""Plotly figures of notebook 08 (shared-prefix decode), built from ``workbench.shared_prefix.study``,
``workbench.bench.shared_prefix_results`` and ``workbench.sim.forks`` tables."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLORS = {"plain": "#e76f51", "cascade": "#2a9d8f", "shared": "#264653", "suffix": "#2a9d8f", "sdpa": "#8d99ae",
          "arrival": "#e76f51", "grouped": "#2a9d8f", "none": "#a8b8c0", "ours": "#2a9d8f", "paper": "#264653"}
NAMES = {"plain": "plain paged decode", "cascade": "cascade (shared runs once)", "sdpa": "SDPA, contiguous copy"}


def scenario_figure(sc, plain_reads: Sequence[dict], shared_reads: Sequence[dict], title: str,
                    model: str = "CUDA-graph") -> go.Figure:
    """Left: K/V bytes per step of both paths (the cascade's split into its shared tiles and suffixes) with the cost
    model's times; right: which blocks each program reads (one kv head), plain and cascade."""
    b, c = sc.choice.bytes, sc.choice
    fig = make_subplots(rows=2, cols=2, column_widths=[0.24, 0.76], horizontal_spacing=0.17, vertical_spacing=0.14,
                        specs=[[{"rowspan": 2}, {}], [None, {}]],
                        subplot_titles=("K/V read per step", "plain: each sequence reads its table",
                                        "cascade: shared tiles (dark), then each sequence's suffix"))
    fig.add_bar(x=["plain"], y=[b["plain"] / 1e6], name="plain: every sharer reads the prefix",
                marker_color=COLORS["plain"], text=[f"{c.plain_us:.0f} µs"], textposition="outside", row=1, col=1)
    fig.add_bar(x=["cascade"], y=[b["shared"] / 1e6], name="cascade: shared tiles", marker_color=COLORS["shared"],
                row=1, col=1)
    fig.add_bar(x=["cascade"], y=[b["suffix"] / 1e6], name="cascade: private suffixes", marker_color=COLORS["suffix"],
                text=[f"{c.cascade_us:.0f} µs"], textposition="outside", row=1, col=1)
    top = max(b["plain"], b["cascade"]) / 1e6
    fig.update_yaxes(title_text="MB per step (all layers' one)", range=[0, top * 1.25], row=1, col=1)
    for row, reads in ((1, plain_reads), (2, shared_reads)):
        z, labels, width = _read_grid(reads, sc.num_blocks)
        fig.add_heatmap(z=z, x=[i * width for i in range(len(z[0]))], y=labels, zmin=0, zmax=3, showscale=False,
                        colorscale=[[0, "#f4f4f4"], [0.33, "#f4f4f4"], [0.34, COLORS["plain"]],
                                    [0.66, COLORS["plain"]], [0.67, COLORS["shared"]], [1, COLORS["shared"]]],
                        hovertemplate="%{y}: block %{x}<extra></extra>", xgap=0, ygap=1, row=row, col=2)
        fig.update_xaxes(title_text="physical block" + (f" ({width} a column)" if width > 1 else ""), row=row, col=2)
        fig.update_yaxes(autorange="reversed", tickfont_size=9, row=row, col=2)
    pick = "cascade" if c.path == "shared" else "plain decode"
    fig.update_layout(
        barmode="stack", height=720, margin=dict(t=110, r=10, b=50), title_font_size=14,
        legend=dict(orientation="h", x=0, y=-0.1, yanchor="top", font_size=11),
        title=f"{title}<br><sup>selector: <b>{pick}</b> (predicted {c.predicted_speedup:.2f}x, H200 {model} "
              f"model); {len(c.segments)} shared segment(s), {sum(sc.geo.tiles(len(r)) for *_, r in c.segments)} "
              f"tile(s) of {sc.geo.rows_per_tile} query rows</sup>")
    return fig


def _read_grid(reads, num_blocks, max_columns: int = 240):
    """Programs x physical blocks (binned to at most ``max_columns``: a column holds ``width`` blocks and shows the
    strongest read among them); each program's label says how many blocks it reads for how many query heads."""
    width = max(1, -(-num_blocks // max_columns))
    cols = -(-num_blocks // width)
    z, labels = [], []
    for p in reads:
        row = [0] * cols
        level = 2 if p["kind"] == "shared" else 1
        for blk in p["blocks"]:
            row[blk // width] = max(row[blk // width], level)
        z.append(row)
        if p["kind"] == "more":
            labels.append(f"{p['program']} ({p['more']} blk)")
        else:
            labels.append(f"{p['program']} ({len(p['blocks'])} blk, {p['rows']} heads)")
    return z, labels, width


def crossover_figure(cmap, curves: Mapping[str, Sequence[tuple[int, float]]], prefix: int, title: str) -> go.Figure:
    """Left: the measured speedup of the cascade over plain decode, prefix x sharers (circles: where the selector
    takes the cascade; a cross would mark a wrong pick); right: the paths' times by sharers at ``prefix``."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.2,
                        subplot_titles=("cascade speedup over plain decode (measured)",
                                        f"time by sharers, {prefix}-token prefix"))
    xs, ys = [str(s) for s in cmap.sharers], [str(p) for p in cmap.prefixes]
    z = [[math.log2(v) if v else None for v in row] for row in cmap.speedup]
    text = [[f"{v:.2f}x" if v else "" for v in row] for row in cmap.speedup]
    fig.add_heatmap(z=z, x=xs, y=ys, zmid=0, zmin=-3, zmax=5, colorscale="RdBu", text=text, texttemplate="%{text}",
                    hovertext=[[f"prefix {p}, {s} sharers: {t}" for s, t in zip(xs, row, strict=True)]
                               for p, row in zip(ys, text, strict=True)], hoverinfo="text", xgap=1, ygap=1,
                    colorbar=dict(title=dict(text="log2 x", side="top"), x=0.47, len=0.9, thickness=12), row=1, col=1)
    px, py, sym = [], [], []
    for p, picks, rights in zip(ys, cmap.picked, cmap.right, strict=True):
        for s, pick, ok in zip(xs, picks, rights, strict=True):
            if pick:
                px.append(s)
                py.append(p)
                sym.append("circle-open" if ok else "x")
    fig.add_scatter(x=px, y=py, mode="markers", marker=dict(symbol=sym, size=30, color="#111", line_width=2),
                    name="selector takes the cascade", hoverinfo="skip", row=1, col=1)
    fig.update_xaxes(title_text="sequences sharing the prefix", type="category", row=1, col=1)
    fig.update_yaxes(title_text="shared prefix (tokens)", type="category", row=1, col=1)
    for impl, pts in curves.items():
        fig.add_scatter(x=[s for s, _ in pts], y=[t for _, t in pts], mode="lines+markers", name=NAMES[impl],
                        line=dict(color=COLORS[impl]), hovertemplate=f"{NAMES[impl]}: %{{x}} sharers, %{{y:.1f}} µs"
                        "<extra></extra>", row=1, col=2)
    fig.update_xaxes(title_text="sharers", type="log", row=1, col=2)
    fig.update_yaxes(title_text="µs per step (one layer)", type="log", row=1, col=2)
    fig.update_layout(height=500, margin=dict(t=100, r=10, b=50), title_font_size=14, title=title,
                      legend=dict(orientation="h", x=0, y=-0.16, yanchor="top", font_size=11))
    return fig


def growth_figure(points: Mapping[str, Sequence[tuple[float, float, dict]]], title: str) -> go.Figure:
    """Each path's time against the tokens it must read: plain ``sharers x (prefix + suffix)``, the cascade
    ``tiles x prefix + sharers x suffix``."""
    fig = go.Figure()
    for impl, label in (("plain", "plain vs sharers x (prefix + suffix)"),
                        ("cascade", "cascade vs tiles x prefix + sharers x suffix")):
        pts = points[impl]
        fig.add_scatter(x=[x for x, _, _ in pts], y=[t for _, t, _ in pts], mode="markers", name=label,
                        marker=dict(color=COLORS[impl], size=8),
                        hovertext=[f"prefix {r['prefix']}, {r['sharers']} sharers, suffix {r['suffix']}: {t:.1f} µs"
                                   for _, t, r in pts], hoverinfo="text")
    fig.update_xaxes(title_text="tokens the path reads (per kv head)", type="log")
    fig.update_yaxes(title_text="µs per step", type="log")
    fig.update_layout(height=420, margin=dict(t=80, r=10, b=50), title=title, title_font_size=14,
                      legend=dict(orientation="h", x=0, y=-0.2, yanchor="top"))
    return fig


def batching_figure(res: Mapping, measured: Sequence[dict], title: str) -> go.Figure:
    """Bytes of one step: no sharing, batches in arrival order, batches grouped by overlap (the cascade on what each
    batch shares); the H200 run's measured step beside it."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.14,
                        subplot_titles=("K/V read per step (this batch)", "H200: 256 sequences, batches of 32"))
    keys = [("plain", "none", "no sharing"), ("arrival", "arrival", "arrival order"), ("grouped", "grouped", "grouped")]
    fig.add_bar(x=[k[2] for k in keys], y=[res[k[0]] / 1e6 for k in keys], marker_color=[COLORS[k[1]] for k in keys],
                text=[f"{res[k[0]] / 1e6:.0f} MB" for k in keys], textposition="outside", showlegend=False,
                row=1, col=1)
    fig.update_yaxes(title_text="MB per step", range=[0, max(res["plain"], res["arrival"]) / 1e6 * 1.2], row=1, col=1)
    if measured:
        fig.add_bar(x=[r["impl"] for r in measured], y=[r["time_us_graph"] for r in measured],
                    marker_color=[COLORS.get(r["impl"], "#888") for r in measured], showlegend=False,
                    text=[f"{r['time_us_graph']:.0f} µs, {r['bytes'] / 1e6:.0f} MB" for r in measured],
                    textposition="outside", row=1, col=2)
        fig.update_yaxes(title_text="µs per step (CUDA graph)",
                         range=[0, max(r["time_us_graph"] for r in measured) * 1.25], row=1, col=2)
    fig.update_layout(height=430, margin=dict(t=90, r=10, b=40), title=title, title_font_size=14)
    return fig


def forks_figure(rows: Sequence[Mapping], paper: tuple[float, float] | None, title: str) -> go.Figure:
    """Memory saved by sharing per n (samples or beam width), ours as bars, the paper's range as a band."""
    fig = go.Figure()
    fig.add_bar(x=[str(r["n"]) for r in rows], y=[r["saving_pct"] for r in rows], name="this simulator",
                marker_color=COLORS["ours"], text=[f"{r['saving_pct']:.1f}%" for r in rows], textposition="outside")
    if paper:
        lo, hi = paper
        fig.add_hrect(y0=lo, y1=hi, fillcolor=COLORS["paper"], opacity=0.15, line_width=0,
                      annotation_text=f"vLLM paper: {lo}-{hi}%", annotation_position="top left")
    top = max([r["saving_pct"] for r in rows] + ([paper[1]] if paper else []))
    fig.update_xaxes(title_text="parallel samples / beam width", type="category")
    fig.update_yaxes(title_text="memory saved by sharing (%)", range=[0, top * 1.25])
    fig.update_layout(height=420, margin=dict(t=80, r=10, b=50), title=title, title_font_size=14)
    return fig
