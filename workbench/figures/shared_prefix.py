"""Plotly figures of notebook 08 (shared-prefix decode), built from ``workbench.shared_prefix.scenarios``,
``workbench.results.shared_prefix`` and ``workbench.sim.forks`` tables."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.figures.titles import SUB_CHARS, TITLE_CHARS, wrap

COLORS = {"plain": "#e76f51", "cascade": "#2a9d8f", "shared": "#264653", "suffix": "#2a9d8f", "sdpa": "#8d99ae",
          "arrival": "#e76f51", "grouped": "#2a9d8f", "none": "#a8b8c0", "ours": "#2a9d8f", "paper": "#264653"}
NAMES = {"plain": "plain paged decode", "cascade": "cascade (shared runs once)", "sdpa": "SDPA, contiguous copy"}
ZMIN, ZMAX = -3, 5  # the crossover map's colour range, log2 of the speedup


def plural(n: int, word: str) -> str:
    """``1 head``, ``2 heads``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def scenario_figure(sc, plain_reads: Sequence[dict], shared_reads: Sequence[dict], title: str,
                    model: str = "CUDA-graph") -> go.Figure:
    """Left: K/V bytes per step of both paths (the cascade's split into its shared tiles and suffixes) with the cost
    model's times; right: which blocks each program reads (one kv head), plain and cascade. A map that lists only the
    first programs says how many of how many, and its x axis ends at the last block a listed program reads."""
    b, c = sc.choice.bytes, sc.choice
    last = max((blk for p in (*plain_reads, *shared_reads) for blk in p["blocks"]), default=0) + 1
    fig = make_subplots(rows=2, cols=2, column_widths=[0.24, 0.76], horizontal_spacing=0.17, vertical_spacing=0.16,
                        specs=[[{"rowspan": 2}, {}], [None, {}]],
                        subplot_titles=("K/V read per step", "plain: each sequence reads its table" +
                                        _listed(plain_reads), "cascade: shared tiles (dark), then suffixes" +
                                        _listed(shared_reads)))
    fig.add_bar(x=["plain"], y=[b["plain"] / 1e6], name="plain: every sharer reads the prefix",
                marker_color=COLORS["plain"], text=[f"{c.plain_us:.0f} µs"], textposition="outside", row=1, col=1)
    fig.add_bar(x=["cascade"], y=[b["shared"] / 1e6], name="cascade: shared tiles", marker_color=COLORS["shared"],
                row=1, col=1)
    fig.add_bar(x=["cascade"], y=[b["suffix"] / 1e6], name="cascade: private suffixes", marker_color=COLORS["suffix"],
                text=[f"{c.cascade_us:.0f} µs"], textposition="outside", row=1, col=1)
    top = max(b["plain"], b["cascade"]) / 1e6
    fig.update_yaxes(title_text="MB read per step, one layer (all kv heads)", range=[0, top * 1.25], row=1, col=1)
    for row, reads in ((1, plain_reads), (2, shared_reads)):
        z, labels, width = _read_grid(reads, last)
        fig.add_heatmap(z=z, x=[i * width for i in range(len(z[0]))], y=list(range(len(labels))), zmin=0, zmax=3,
                        showscale=False, customdata=[[lab] * len(z[0]) for lab in labels],
                        colorscale=[[0, "#f4f4f4"], [0.33, "#f4f4f4"], [0.34, COLORS["plain"]],
                                    [0.66, COLORS["plain"]], [0.67, COLORS["shared"]], [1, COLORS["shared"]]],
                        hovertemplate="%{customdata}: block %{x}<extra></extra>", xgap=0, ygap=1, row=row, col=2)
        fig.update_xaxes(title_text="physical block" + (f" ({width} a column)" if width > 1 else ""),
                         range=[-0.5 * width, len(z[0]) * width - 0.5 * width], row=row, col=2)
        # every row labelled (plotly thins crowded ticks, and hid the '+N more' row)
        fig.update_yaxes(autorange="reversed", tickmode="array", tickvals=list(range(len(labels))), ticktext=labels,
                         tickfont_size=8 if len(labels) > 16 else 9, row=row, col=2)
    pick = "cascade" if c.path == "shared" else "plain decode"
    tiles = sum(sc.geo.tiles(len(r)) for *_, r in c.segments)
    sub = wrap(f"selector: {pick} (predicted {c.predicted_speedup:.2f}x, H200 {model} model); "
               f"{plural(len(c.segments), 'shared segment')}, {plural(tiles, 'tile')} of {sc.geo.rows_per_tile} query "
               f"rows", SUB_CHARS).replace(pick, f"<b>{pick}</b>", 1)
    head = wrap(title, TITLE_CHARS)
    lines = head.count("<br>") + sub.count("<br>") + 2
    fig.update_annotations(font_size=13)  # the subplot titles: fit their column
    fig.update_layout(
        barmode="stack", height=700 + 20 * lines, margin=dict(t=70 + 20 * lines, r=10, b=50), title_font_size=14,
        legend=dict(orientation="h", x=0, y=-0.1, yanchor="top", font_size=11), title=f"{head}<br><sup>{sub}</sup>")
    return fig


def _listed(reads) -> str:
    """``; 23 of 64 shown`` when the map lists only the first programs."""
    more = next((p["programs"] for p in reads if p["kind"] == "more"), 0)
    return f"; {len(reads) - 1} of {len(reads) - 1 + more} shown" if more else ""


def _read_grid(reads, num_blocks, max_columns: int = 240):
    """Programs x physical blocks ``0 .. num_blocks - 1`` (binned to at most ``max_columns``: a column holds ``width``
    blocks and shows the strongest read among them); each program's label says how many blocks it reads for how
    many query heads."""
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
            labels.append(f"+{plural(p['programs'], 'program')} ({p['more']} blk)")
        else:
            labels.append(f"{p['program']} ({len(p['blocks'])} blk, {plural(p['rows'], 'head')})")
    return z, labels, width


def crossover_figure(cmap, curves: Mapping[str, Sequence[tuple[int, float]]], prefix: int, title: str) -> go.Figure:
    """Left: the measured speedup of the cascade over plain decode, prefix x sharers, each cell's number in a colour
    that reads on it (the selector's picks framed around the number, a wrong pick in red dashes; one sharer shares
    nothing: no cascade there, said in its cells); right: the paths' times by sharers at ``prefix``."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45], horizontal_spacing=0.2,
                        subplot_titles=("cascade speedup over plain decode (measured)",
                                        f"time by sharers, {prefix}-token prefix"))
    xs, ys = [str(s) for s in cmap.sharers], [str(p) for p in cmap.prefixes]
    z = [[math.log2(v) if v else None for v in row] for row in cmap.speedup]
    text = [[f"{v:.2f}x" if v else "" for v in row] for row in cmap.speedup]
    fig.add_heatmap(z=z, x=xs, y=ys, zmid=0, zmin=ZMIN, zmax=ZMAX, colorscale="RdBu",
                    hovertext=[[f"prefix {p}, {s} sharers: {t or 'nothing shared, no cascade'}"
                                for s, t in zip(xs, row, strict=True)] for p, row in zip(ys, text, strict=True)],
                    hoverinfo="text", xgap=1, ygap=1,
                    colorbar=dict(title=dict(text="log2 x", side="top"), x=0.47, len=0.9, thickness=12), row=1, col=1)
    cells = [(s, p, t or "no<br>sharing", _text_colour(v)) for p, zrow, trow in zip(ys, z, text, strict=True)
             for s, v, t in zip(xs, zrow, trow, strict=True)]
    fig.add_scatter(x=[c[0] for c in cells], y=[c[1] for c in cells], text=[c[2] for c in cells], mode="text",
                    textfont=dict(size=11, color=[c[3] for c in cells]), hoverinfo="skip", showlegend=False,
                    row=1, col=1)
    for i, (picks, rights) in enumerate(zip(cmap.picked, cmap.right, strict=True)):
        for j, (pick, ok) in enumerate(zip(picks, rights, strict=True)):
            if pick:
                fig.add_shape(type="rect", x0=j - 0.42, x1=j + 0.42, y0=i - 0.4, y1=i + 0.4, row=1, col=1,
                              line=dict(color=_text_colour(z[i][j]) if ok else "#d62828", width=2,
                                        dash="solid" if ok else "dash"))  # as its number: seen on dark cells too
    fig.update_xaxes(title_text="sequences sharing the prefix", type="category", row=1, col=1)
    fig.update_yaxes(title_text="shared prefix (tokens)", type="category", row=1, col=1)
    for impl, pts in curves.items():
        fig.add_scatter(x=[s for s, _ in pts], y=[t for _, t in pts], mode="lines+markers", name=NAMES[impl],
                        line=dict(color=COLORS[impl]), hovertemplate=f"{NAMES[impl]}: %{{x}} sharers, %{{y:.1f}} µs"
                        "<extra></extra>", row=1, col=2)
    fig.update_xaxes(title_text="sharers", type="log", row=1, col=2)
    fig.update_yaxes(title_text="µs per step (one layer)", type="log", row=1, col=2)
    lines = title.count("<br>") + 1
    fig.update_layout(height=460 + 20 * lines, margin=dict(t=60 + 20 * lines, r=10, b=50), title_font_size=14,
                      title=title, legend=dict(orientation="h", x=0, y=-0.16, yanchor="top", font_size=11))
    return fig


def _text_colour(z: float | None) -> str:
    """A number's colour on its heatmap cell: white on the dark ends of RdBu, dark on its pale middle, grey where
    there is no value."""
    if z is None:
        return "#777"
    depth = z / ZMAX if z > 0 else z / ZMIN  # 0 at the middle (white), 1 at either dark end
    return "white" if depth > 0.45 else "#222"


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
