"""Plotly figures, built from plain data returned by the package's pure functions."""

from __future__ import annotations

import plotly.graph_objects as go

BREAKDOWN_PARTS = ("token_states", "reservation", "internal_fragmentation")
COLORS = {"token_states": "#2a9d8f", "reservation": "#e9c46a", "internal_fragmentation": "#e76f51"}


def breakdown_bars(breakdowns: dict[str, dict[str, float]], unit: float = 2**30, unit_name: str = "GiB"):
    """Stacked bars: for each scheme, bytes of token states / reservation / fragmentation."""
    fig = go.Figure()
    schemes = list(breakdowns)
    for part in BREAKDOWN_PARTS:
        fig.add_bar(
            name=part.replace("_", " "),
            x=schemes,
            y=[breakdowns[s].get(part, 0.0) / unit for s in schemes],
            marker_color=COLORS[part],
        )
    fig.update_layout(barmode="stack", yaxis_title=f"KV memory ({unit_name})", height=380, margin=dict(t=40))
    return fig


def block_table_heatmap(seq_ids, block_tables, ref_counts, title="block tables"):
    """Rows are sequences, columns logical blocks; colour is the physical block's ref count,
    the text the physical block id (shared blocks show the same id in several rows)."""
    width = max((len(t) for t in block_tables), default=0)
    z = [[ref_counts[b] for b in t] + [None] * (width - len(t)) for t in block_tables]
    text = [[str(b) for b in t] + [""] * (width - len(t)) for t in block_tables]
    fig = go.Figure(go.Heatmap(
        z=z, x=[f"L{i}" for i in range(width)], y=list(seq_ids), text=text, texttemplate="%{text}",
        colorscale="Tealrose", zmin=1, colorbar=dict(title="ref count"),
        hovertemplate="seq %{y}, logical %{x}: physical block %{text}, ref count %{z}<extra></extra>",
    ))
    fig.update_layout(title=title, xaxis_title="logical block", yaxis_autorange="reversed",
                      height=max(260, 28 * len(seq_ids) + 120), margin=dict(t=50))
    return fig


def sharing_bars(blocks_used, blocks_unshared, cow_copies, prefix_hits):
    """Physical blocks with sharing vs every sequence owning its copy; CoW copies and prefix hits."""
    fig = go.Figure(go.Bar(
        x=["no sharing", "paged + sharing", "copy-on-write copies", "prefix-cache hits"],
        y=[blocks_unshared, blocks_used, cow_copies, prefix_hits],
        marker_color=["#e76f51", "#2a9d8f", "#e9c46a", "#264653"],
        text=[blocks_unshared, blocks_used, cow_copies, prefix_hits], textposition="outside",
    ))
    fig.update_layout(yaxis_title="blocks", height=320, margin=dict(t=30))
    return fig


IMPL_COLORS = {"ours": "#2a9d8f", "sdpa_contiguous": "#264653", "gather_sdpa": "#e76f51", "flex_paged": "#e9c46a"}


def coalescing_map(c):
    """Left: bytes of each token of a tile in each 128-byte line it touches (``workbench.coalescing.Coalescing``);
    right: line and sector efficiency of a token read and of the tile read."""
    from plotly.subplots import make_subplots

    m, g = c.line_map, c.geometry
    fig = make_subplots(rows=1, cols=2, column_widths=[0.7, 0.3], horizontal_spacing=0.12, subplot_titles=(
        f"useful bytes per 128-byte line, first {len(m.tokens)} tokens of a tile "
        f"(block 1 starts at +{m.block_start_mod_line})",
        "coalescing efficiency"))
    fig.add_trace(go.Heatmap(
        z=[[v or None for v in row] for row in m.bytes], x=[f"+{o}" for o in m.line_offsets], y=m.tokens,
        zmin=0, zmax=128, colorscale="Teal", colorbar=dict(title="bytes", x=0.62),
        hovertemplate="token %{y}, line %{x}: %{z} useful bytes of 128<extra></extra>"), row=1, col=1)
    names = ["token: lines", "token: sectors", f"tile {c.block_n}: lines", f"tile {c.block_n}: sectors"]
    vals = [c.token.line_efficiency, c.token.sector_efficiency, c.tile.line_efficiency, c.tile.sector_efficiency]
    fig.add_trace(go.Bar(x=names, y=vals, marker_color=["#e9c46a", "#f4a261", "#2a9d8f", "#264653"],
                         text=[f"{v:.2f}" for v in vals], textposition="outside"), row=1, col=2)
    fig.update_xaxes(title_text="line (byte offset from the first)", type="category", row=1, col=1)
    fig.update_yaxes(title_text="token", autorange="reversed", row=1, col=1)
    fig.update_yaxes(range=[0, 1.15], row=1, col=2)
    fig.update_layout(
        title=f"{g.layout} {g.kind}, {g.block_size}-token blocks, head_dim {g.head_dim}, {g.elem_size}-byte elements, "
              f"block stride +{g.pad_bytes} B: blocks {'' if c.aligned else 'NOT '}128-byte aligned<br>"
              f"<sup>tile of {c.block_n}: lanes load {c.tile.lane_bytes} B, {c.tile.requests:.0f} warp requests, "
              f"{c.tile.lines_per_request:.1f} lines per request</sup>",
        title_font_size=14, height=440, showlegend=False, margin=dict(t=100))
    return fig


def decode_bars(best, graph=False):
    """Fraction of copy bandwidth per workload and implementation, from ``results.best_per_workload``."""
    fig = go.Figure()
    workloads = list(best)
    impls = list(dict.fromkeys(i for w in workloads for i in best[w]))
    key = "frac_copy_bw_graph" if graph else "frac_copy_bw"
    for impl in impls:
        rows = [best[w].get(impl) for w in workloads]
        ys = [r.get(key) if r else None for r in rows]
        fig.add_bar(name=impl, x=workloads, y=ys, marker_color=IMPL_COLORS.get(impl),
                    text=[f"{y:.2f}" if y else "" for y in ys], textposition="outside",
                    hovertext=[f"{r.get('variant') or impl}: {r['time_us']:.1f} us" if r else "" for r in rows])
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="copy bandwidth")
    fig.update_layout(barmode="group", yaxis_title=f"fraction of copy bandwidth ({'CUDA graph' if graph else 'eager'})",
                      height=380, margin=dict(t=30))
    return fig


def roofline(points, copy_gbps, peak_tflops=None):
    """Log-log roofline: achieved TFLOP/s against FLOP/byte, under the measured copy-bandwidth ceiling."""
    import math

    fig = go.Figure()
    xs = [p["intensity"] for p in points] or [1.0]
    lo, hi = min(xs) / 2, max(max(xs) * 4, (peak_tflops * 1e3 / copy_gbps * 2) if peak_tflops and copy_gbps else 0)
    if copy_gbps:
        grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
        ceil = [min(x * copy_gbps / 1e3, peak_tflops or math.inf) for x in grid]
        fig.add_scatter(x=grid, y=ceil, mode="lines", name=f"copy bandwidth {copy_gbps:.0f} GB/s",
                        line=dict(color="#888", dash="dash"))
    for impl in dict.fromkeys(p["impl"] for p in points):
        ps = [p for p in points if p["impl"] == impl]
        fig.add_scatter(x=[p["intensity"] for p in ps], y=[p["tflops"] for p in ps], mode="markers", name=impl,
                        marker=dict(color=IMPL_COLORS.get(impl), size=9, opacity=0.8),
                        text=[f"{p['workload']} {p['label']}: {p['gbps']:.0f} GB/s" for p in ps],
                        hovertemplate="%{text}<br>%{x:.2f} FLOP/B, %{y:.2f} TFLOP/s<extra></extra>")
    fig.update_layout(xaxis=dict(type="log", title="arithmetic intensity (FLOP/byte)"),
                      yaxis=dict(type="log", title="TFLOP/s"), height=420, margin=dict(t=30))
    return fig


def sweep_lines(rows, x, group, y="frac_copy_bw", model=None, x_title=None, model_title="model"):
    """One line per ``group`` value: ``y`` against ``x`` over sweep rows; ``model`` (a row key) adds the
    coalescing model's prediction on a second axis titled ``model_title``."""
    fig = go.Figure()
    for name in dict.fromkeys(r[group] for r in rows):
        rs = sorted((r for r in rows if r[group] == name), key=lambda r: r[x])
        fig.add_scatter(x=[r[x] for r in rs], y=[r.get(y) for r in rs], mode="lines+markers", name=str(name))
        if model:
            fig.add_scatter(x=[r[x] for r in rs], y=[r.get(model) for r in rs], mode="lines+markers", yaxis="y2",
                            name=f"{name}: {model_title}", line=dict(dash="dot"))
    xs = sorted({r[x] for r in rows})
    fig.update_layout(xaxis=dict(title=x_title or x, type="category", categoryorder="array",
                                 categoryarray=xs), yaxis=dict(title=y), height=360, margin=dict(t=30))
    if model:
        fig.update_layout(yaxis2=dict(title=model_title, overlaying="y", side="right", range=[0, 1.05]),
                          legend=dict(x=1.08))
    return fig
