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
