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
