"""The figures of notebooks 00-04: where a batch's KV memory goes, shared blocks, the lines a warp's reads touch,
the measured decode results, and the serving simulator's fragmentation."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.analysis.fragmentation import SHARED, STATES, TOKEN

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


def sharing_overview(r) -> go.Figure:
    """A shared-prompt scenario (``sharing.shared_prompt``): its block tables beside the blocks each way uses."""
    heat = block_table_heatmap(r.seq_ids, r.block_tables, r.ref_counts)
    bars = sharing_bars(r.blocks_used, r.blocks_unshared, r.cow_copies, r.prefix_hits)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.65, 0.35],
                        subplot_titles=(f"block tables: {r.tokens} token states in {r.blocks_used} blocks "
                                        f"({100 * r.memory_saved:.0f}% of blocks saved)", "blocks"))
    fig.add_trace(heat.data[0], row=1, col=1)
    fig.add_trace(bars.data[0], row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_layout(height=max(320, 26 * len(r.seq_ids) + 140), showlegend=False, margin=dict(t=50))
    return fig


IMPL_COLORS = {"ours": "#2a9d8f", "sdpa_contiguous": "#264653", "gather_sdpa": "#e76f51", "flex_paged": "#e9c46a"}


def coalescing_map(c):
    """Left: bytes of each token of a tile in each 128-byte line it touches
    (``workbench.analysis.coalescing.Coalescing``); right: line and sector efficiency of a token read and of the tile
    read."""
    m, g = c.line_map, c.geometry
    # short subplot titles (the long story is in the title): they must not run into each other at 700 px
    fig = make_subplots(rows=1, cols=2, column_widths=[0.66, 0.34], horizontal_spacing=0.16, subplot_titles=(
        f"useful bytes per 128-byte line (first {len(m.tokens)} tokens)", "coalescing efficiency"))
    fig.add_trace(go.Heatmap(
        z=[[v or None for v in row] for row in m.bytes], x=[f"+{o}" for o in m.line_offsets], y=m.tokens,
        zmin=0, zmax=128, colorscale="Teal", colorbar=dict(title="bytes", x=0.575, thickness=12, len=0.8),
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
              f"{c.tile.lines_per_request:.1f} lines per request; block 1 starts at +{m.block_start_mod_line} "
              f"in its line</sup>",
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
    # the 1.0 line named in the legend: an annotation on the plot ran into the bars' labels
    fig.add_hline(y=1.0, line_dash="dot", line_color="#444")
    fig.add_scatter(x=[None], y=[None], mode="lines", line=dict(dash="dot", color="#444"), name="copy bandwidth")
    fig.update_layout(barmode="group", yaxis_title=f"fraction of copy bandwidth ({'CUDA graph' if graph else 'eager'})",
                      height=380, margin=dict(t=30))
    return fig


def roofline(points, copy_gbps, peak_tflops=None):
    """Log-log roofline: achieved TFLOP/s against FLOP/byte, under the measured copy-bandwidth ceiling."""
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


def sweep_lines(rows, x, group, y="frac_copy_bw", model=None, x_title=None, model_title="model", y_title=None):
    """One line per ``group`` value: ``y`` against ``x`` over sweep rows; ``model`` (a row key) adds the
    coalescing model's prediction on a second axis titled ``model_title``. The axes read ``x_title`` and ``y_title``
    (default: the column's words, never its bare name)."""
    fig = go.Figure()
    for name in dict.fromkeys(r[group] for r in rows):
        rs = sorted((r for r in rows if r[group] == name), key=lambda r: r[x])
        fig.add_scatter(x=[r[x] for r in rs], y=[r.get(y) for r in rs], mode="lines+markers", name=str(name))
        if model:
            fig.add_scatter(x=[r[x] for r in rs], y=[r.get(model) for r in rs], mode="lines+markers", yaxis="y2",
                            name=f"{name}: {model_title}", line=dict(dash="dot"))
    xs = sorted({r[x] for r in rows})
    fig.update_layout(xaxis=dict(title=x_title or x.replace("_", " "), type="category", categoryorder="array",
                                 categoryarray=xs), yaxis=dict(title=y_title or y.replace("_", " ")), height=360,
                      margin=dict(t=30))
    if model:
        fig.update_layout(yaxis2=dict(title=model_title, overlaying="y", side="right", range=[0, 1.05]),
                          legend=dict(x=1.08))
    return fig


# ---- fragmentation and compaction (notebook 04) ----------------------------------------------------
SHARE_PARTS = ("token_states", "reservation", "internal", "external")
SHARE_NAMES = {"token_states": "token states", "reservation": "reservation", "internal": "internal fragmentation",
               "external": "external fragmentation & others"}
SHARE_COLORS = {"token_states": "#2a9d8f", "reservation": "#e9c46a", "internal": "#e76f51", "external": "#8d99ae"}


def share_bars(rows, title=None):
    """Stacked bars of the vLLM paper's four parts (percent of KV memory); ``rows``: ``{label: {part: %}}``
    (a part that is None is not drawn)."""
    fig = go.Figure()
    labels = list(rows)
    for part in SHARE_PARTS:
        ys = [rows[lb].get(part) for lb in labels]
        fig.add_bar(name=SHARE_NAMES[part], x=labels, y=ys, marker_color=SHARE_COLORS[part],
                    text=[f"{y:.1f}" if y else "" for y in (v or 0 for v in ys)], textposition="inside")
    fig.update_layout(barmode="stack", yaxis=dict(title="% of KV memory", range=[0, 100]), title=title,
                      height=400, margin=dict(t=50 if title else 30), legend=dict(traceorder="normal"))
    return fig


def fig2_bars(d):
    """The vLLM paper's Figure 2 beside ours: for each system a bar of ours and one of the paper's
    (``workbench.sim.fig2.breakdown()``); the paper labels only vLLM's token states, the rest of its bar is
    drawn as "external & others"."""
    fig = go.Figure()
    systems = list(d["systems"])
    x = [[s for s in systems for _ in (0, 1)], ["ours", "paper"] * len(systems)]
    for part in SHARE_PARTS:
        ys = []
        for s in systems:
            v = d["systems"][s]
            paper = dict(v["paper"] or {})  # None: a trace the paper did not plot
            if part == "external" and paper.get("external") is None:
                paper["external"] = round(100 - paper["token_states"], 1)
            ys += [v[part], paper.get(part)]
        fig.add_bar(name=SHARE_NAMES[part], x=x, y=ys, marker_color=SHARE_COLORS[part],
                    text=[f"{y:.1f}" if y else "" for y in (v or 0 for v in ys)], textposition="inside")
    s = d["setup"]
    fig.update_layout(barmode="stack", yaxis=dict(title="% of KV memory", range=[0, 100]), height=420,
                      title=f"Where KV memory goes: {s['trace']}, {s['requests']} requests<br>"
                            f"<sup>{s['kv_gib']:g} GiB ({s['slots']} slots of {s['model']}); largest difference "
                            f"from the paper {d['max_abs_diff_pp']:.1f} points</sup>",
                      title_font_size=14, margin=dict(t=70))
    return fig


def block_size_lines(sweep, part="token_states", best=(16, 128)):
    """``part`` (percent) against block size, one line per trace (``sweeps.block_size_sweep``); the
    shaded band is the range the vLLM paper found best on ShareGPT (for latency, which also counts kernel
    efficiency)."""
    fig = go.Figure()
    sizes = sorted({bs for t in sweep.values() for bs in t})
    for trace, rows in sweep.items():
        bss = sorted(rows)
        fig.add_scatter(x=[math.log2(b) for b in bss], y=[rows[b][part] for b in bss], mode="lines+markers",
                        name=trace, text=[f"block {b}: {rows[b][part]:.1f}%, batch {rows[b]['mean_batch']:.1f}"
                                          for b in bss], hovertemplate="%{text}<extra>%{fullData.name}</extra>")
    if best:
        fig.add_vrect(x0=math.log2(best[0]), x1=math.log2(best[1]), fillcolor="#e9c46a", opacity=0.2, line_width=0,
                      annotation_text=f"paper: best on ShareGPT ({best[0]}-{best[1]})", annotation_position="top left")
    fig.update_layout(xaxis=dict(title="block size (tokens)", tickvals=[math.log2(b) for b in sizes],
                                 ticktext=[str(b) for b in sizes]),
                      yaxis=dict(title=f"{SHARE_NAMES.get(part, part)} (% of KV memory)"), height=380,
                      margin=dict(t=30))
    return fig


MAP_COLORS = ("#f4f4f4", "#d9d9d9", "#a8dadc", "#e76f51", "#264653")  # uncarved, free, cached, unused, shared
OWNER_COLORS = ("#2a9d8f", "#e9c46a", "#8ab17d", "#f4a261", "#457b9d", "#b5838d", "#90be6d", "#f9c74f",
                "#43aa8b", "#bc6c25")


def _map_codes(pm):
    """Colour codes: 0-3 the free/unused states, 4 tokens of a shared block, 5+ tokens of sequence i."""
    code = pm.state.astype(np.int64)
    tok = pm.state == TOKEN
    code[tok] = np.where(pm.owner[tok] == SHARED, 4, 5 + pm.owner[tok] % len(OWNER_COLORS))
    return code


def _map_trace(pm, showlegend=True):
    n = len(MAP_COLORS) + len(OWNER_COLORS)
    scale = []
    for k, c in enumerate(MAP_COLORS + OWNER_COLORS):
        scale += [[k / n, c], [(k + 1) / n, c]]
    code = _map_codes(pm)
    names = list(STATES)
    text = [[f"page {p} ({pm.block_size[p] or 'uncarved'}), slot {s}: "
             + (f"block {pm.block[p, s]}, " if pm.block[p, s] >= 0 else "") + names[pm.state[p, s]]
             + (f", seq {pm.seq_ids[pm.owner[p, s]]}" if pm.owner[p, s] >= 0 else
                ", shared" if pm.owner[p, s] == -2 else "")
             for s in range(pm.state.shape[1])] for p in range(pm.state.shape[0])]
    return go.Heatmap(z=code + 0.5, zmin=0, zmax=n, colorscale=scale, showscale=False, xgap=1, ygap=3, text=text,
                      hovertemplate="%{text}<extra></extra>")


def memory_maps(maps, titles):
    """Pages (rows) x token slots (columns) of one or more ``fragmentation.PageMap``: grey free, light blue
    cached, red held but unused, dark shared tokens, other colours the tokens of each sequence; thin white
    lines are block boundaries."""
    fig = make_subplots(rows=1, cols=len(maps), subplot_titles=titles, horizontal_spacing=0.06)
    for i, pm in enumerate(maps, start=1):
        fig.add_trace(_map_trace(pm), row=1, col=i)
        for p, bs in enumerate(pm.block_size.tolist()):
            for x in range(bs, pm.state.shape[1], bs or pm.state.shape[1]):
                fig.add_shape(type="line", x0=x - 0.5, x1=x - 0.5, y0=p - 0.5, y1=p + 0.5,
                              line=dict(color="white", width=3), row=1, col=i)
        fig.update_yaxes(autorange="reversed", tickvals=list(range(len(pm.block_size))),
                         ticktext=[f"p{p} /{bs or '-'}" for p, bs in enumerate(pm.block_size.tolist())], row=1, col=i)
        fig.update_xaxes(title_text="token slot in page", row=1, col=i)
    for name, color in zip(("uncarved", "free", "cached (prefix)", "held, unused", "shared tokens",
                            "tokens (colour = sequence)"), (*MAP_COLORS, OWNER_COLORS[0]), strict=True):
        fig.add_scatter(x=[None], y=[None], mode="markers", marker=dict(size=12, color=color, symbol="square"),
                        name=name, row=1, col=1)
    fig.update_layout(height=max(300, 26 * len(maps[0].block_size) + 140), margin=dict(t=50),
                      legend=dict(orientation="h", y=-0.15), plot_bgcolor="white")
    return fig


def sim_run(r):
    """One simulator run (``sweeps.simulate``): the four parts, and token / free shares over steps."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.3, 0.7], subplot_titles=(
        "saturated average", "token states and free memory per step"))
    for trace in share_bars({r["label"]: r["shares"]}).data:
        fig.add_trace(trace, row=1, col=1)
    s = r["series"]
    stride = max(1, len(s["step"]) // 2000)  # at most ~2000 points per line
    for name, color in (("token", SHARE_COLORS["token_states"]), ("free", "#8d99ae")):
        fig.add_scatter(x=s["step"][::stride], y=100 * s[name][::stride], mode="lines", name=f"{name} (per step)",
                        line=dict(color=color, width=1), row=1, col=2)
    fig.update_yaxes(title_text="% of KV memory", range=[0, 100], row=1, col=1)
    fig.update_yaxes(range=[0, 100], row=1, col=2)
    fig.update_xaxes(title_text="step", row=1, col=2)
    # two short lines: a title fits a 700-px column without being cut
    fig.update_layout(barmode="stack", height=440, margin=dict(t=100), title_font_size=13,
                      title=f"{r['label']} on {r['trace']} ({r['requests']} requests, {r['slots']} slots)<br>"
                            f"<sup>batch {r['mean_batch']:.1f}, {r['throughput']:.3f} req/step, "
                            f"{r['preemptions']} preemptions, {r['copied_tokens']} tokens copied by compaction</sup>")
    return fig
