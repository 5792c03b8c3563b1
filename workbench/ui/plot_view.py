"""``PlotView``: a plotly figure as a small anywidget that takes the cell's width and redraws cleanly.

plotly's own ``FigureWidget`` (an anywidget since plotly 6) draws at 700 px whatever the column width and
never follows a resize (plotly/plotly.py#5208), and assigning a new layout to it merges in the browser, so
keys the new layout lacks stay on screen. This view sends the whole figure as JSON and the browser calls
``Plotly.react`` on it (see ``plot_view.js``), which replaces data and layout; a ``ResizeObserver`` keeps
it at the output area's width. plotly.js travels once per kernel, in a widget every view refers to
(:class:`PlotlySource`), and runs once per page.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import anywidget
import ipywidgets
import plotly.graph_objects as go
import plotly.offline
import traitlets


@cache
def _module() -> str:
    """The view (``plot_view.js``): a small ES module, parsed for every view a page renders."""
    return (Path(__file__).with_name("plot_view.js")).read_text()


class PlotlySource(ipywidgets.Widget):
    """plotly.js as one widget model of the kernel, which every :class:`PlotView` refers to: the page receives it once
    (every view's own copy cost ~0.2 s of the browser's CPU a view) and runs it once (it sets ``window.Plotly``)."""

    source = traitlets.Unicode().tag(sync=True)


_SOURCE: list[PlotlySource] = []


def plotly_source() -> PlotlySource:
    """The kernel's one :class:`PlotlySource` (a new one if it was closed, as ``Widget.close_all()`` does)."""
    if not _SOURCE or _SOURCE[0].comm is None:
        _SOURCE[:] = [PlotlySource(source=plotly.offline.get_plotlyjs())]
    return _SOURCE[0]


def figure_json(fig: go.Figure) -> dict:
    """The figure as plain JSON (plotly's encoder: numpy arrays, dates), as the browser receives it."""
    return json.loads(fig.to_json())


class PlotView(anywidget.AnyWidget):
    _esm = traitlets.Unicode().tag(sync=True)
    _css = traitlets.Unicode(".wb-plot { width: 100%; }").tag(sync=True)
    _plotly = traitlets.Instance(PlotlySource).tag(sync=True, **ipywidgets.widget_serialization)
    figure = traitlets.Dict().tag(sync=True)

    def __init__(self, fig: go.Figure | None = None, **kwargs):
        super().__init__(_esm=_module(), _plotly=plotly_source(), **kwargs)
        if fig is not None:
            self.show(fig)

    def show(self, fig: go.Figure) -> None:
        self.figure = figure_json(fig)
