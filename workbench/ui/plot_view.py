"""``PlotView``: a plotly figure as a small anywidget that takes the cell's width and redraws cleanly.

plotly's own ``FigureWidget`` (an anywidget since plotly 6) draws at 700 px whatever the column width and
never follows a resize (plotly/plotly.py#5208), and assigning a new layout to it merges in the browser, so
keys the new layout lacks stay on screen. This view sends the whole figure as JSON and the browser calls
``Plotly.react`` on it (see ``plot_view.js``), which replaces data and layout; a ``ResizeObserver`` keeps
it at the output area's width. plotly.js travels inside the widget's module and is evaluated once per page.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import anywidget
import plotly.graph_objects as go
import plotly.offline
import traitlets


@cache
def _module() -> str:
    """plotly.js (it sets ``window.Plotly``), evaluated only if the page lacks it, then the view."""
    view = (Path(__file__).with_name("plot_view.js")).read_text()
    return f"if (!globalThis.Plotly) {{\n{plotly.offline.get_plotlyjs()}\n}}\n{view}"


def figure_json(fig: go.Figure) -> dict:
    """The figure as plain JSON (plotly's encoder: numpy arrays, dates), as the browser receives it."""
    return json.loads(fig.to_json())


class PlotView(anywidget.AnyWidget):
    _esm = traitlets.Unicode().tag(sync=True)
    _css = traitlets.Unicode(".wb-plot { width: 100%; }").tag(sync=True)
    figure = traitlets.Dict().tag(sync=True)

    def __init__(self, fig: go.Figure | None = None, **kwargs):
        super().__init__(_esm=_module(), **kwargs)
        if fig is not None:
            self.show(fig)

    def show(self, fig: go.Figure) -> None:
        self.figure = figure_json(fig)
