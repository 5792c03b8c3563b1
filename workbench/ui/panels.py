"""ipywidgets panels: controls wired to a pure function and a figure.

A panel holds no logic of its own: on every change it calls ``compute`` (a function of the package) and
``draw`` (a figure builder of ``workbench.figures``), keeps the result as ``panel.figure`` (a plain
``go.Figure``: what the browser shows, readable from Python) and sends it to its ``PlotView``. Setting
``panel.controls[name].value = x`` drives it without a browser (observers fire synchronously), which is how
the notebooks test their panels under nbval; ``tests/browser`` moves the same controls in Chromium. A check cell
that moves them ends with ``panel.reset()``: after Run All every panel shows what its parameters cell set.
"""

from __future__ import annotations

import html
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go

from workbench.figures import cache as figures
from workbench.publish.page import PLOTLY_MIME
from workbench.results import decode as results
from workbench.studies import cache
from workbench.ui.controls import controls_for
from workbench.ui.plot_view import PlotView, figure_json

SLIDER_WIDTH = "330px"  # a track of ~200 px beside its label and readout: usable with a mouse


def arrange_controls(controls: dict[str, W.ValueWidget], live: bool = True) -> W.Box:
    """Controls in a row that wraps onto more lines rather than squeezing sliders to nothing."""
    for control in controls.values():
        control.style.description_width = "initial"  # labels never truncated
        if "Slider" in type(control).__name__:
            control.layout.width = SLIDER_WIDTH
            control.continuous_update = live  # live=False: recompute once, when the handle is released
        elif isinstance(control, W.Checkbox):
            control.indent = False
        control.layout.margin = "2px 16px 2px 0"
    return W.Box(list(controls.values()), layout=W.Layout(flex_flow="row wrap", align_items="center",
                                                          padding="0 0 0 4px"))


class Panel:
    _ids = itertools.count()
    _live: weakref.WeakValueDictionary[int, Panel] = weakref.WeakValueDictionary()
    _holding = False  # reset() sets every control before one redraw

    def __init__(self, controls: dict[str, W.ValueWidget], compute: Callable[..., Any],
                 draw: Callable[[Any], go.Figure], live: bool = True,
                 enabled: dict[str, Callable[..., bool]] | None = None):
        """``enabled[name](**values)`` says whether control ``name`` matters for the other values; when it
        does not, the control is greyed out rather than left to change nothing."""
        self.controls = controls
        self._enabled = enabled or {}
        self.compute = lambda: compute(**self.values())
        self._draw = draw
        self.initial = self.values()  # what the panel was built with: reset() goes back to it
        self._update_enabled()
        self.figure: go.Figure = draw(self.compute())
        self.view = PlotView(self.figure)
        self.status = W.HTML()  # a failed redraw says why here instead of in the lab's log
        self.id = next(Panel._ids)
        Panel._live[self.id] = self
        for control in controls.values():
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = W.VBox([arrange_controls(controls, live), self.status, self.view],
                             layout=W.Layout(width="100%"))
        self.widget.add_class("wb-panel")
        self.widget.add_class(f"wb-panel-{self.id}")

    @classmethod
    def live(cls) -> list[Panel]:
        """The panels alive in this kernel, oldest first (the browser test compares them with the page)."""
        return [cls._live[i] for i in sorted(cls._live)]

    def values(self) -> dict[str, Any]:
        return {name: w.value for name, w in self.controls.items()}

    def headline(self) -> str:
        """The figure's title without its smaller lines (``<sup>``), a wrapped title's lines joined: what a check
        cell prints."""
        return (self.figure.layout.title.text or "").split("<br><sup>")[0].replace("<br>", " ")

    def _update_enabled(self) -> None:
        for name, rule in self._enabled.items():
            self.controls[name].disabled = not rule(**self.values())

    def set(self, **values) -> None:
        """Several controls at once, then one redraw (a control set alone redraws at once: five set one by one draw
        five figures). A name that is no control, or a value a control refuses, changes nothing."""
        unknown = sorted(set(values) - set(self.controls))
        if unknown:
            raise ValueError(f"values: no control named {', '.join(unknown)} (the panel's: {', '.join(self.controls)})")
        before = self.values()
        self._holding = True
        try:
            for name, value in values.items():
                self.controls[name].value = value
        except Exception:
            for name, value in before.items():
                self.controls[name].value = value
            raise
        finally:
            self._holding = False
        self.redraw()

    def reset(self) -> None:
        """Every control back to the value the panel was built with (the parameters cell's), then one redraw: how a
        check cell that moved the controls leaves the panel, so that Run All shows the notebook's settings."""
        self._holding = True
        try:
            self._restore()
        finally:
            self._holding = False
        self.set(**self.initial)

    def _restore(self) -> None:
        """A subclass's own state back to what it was built with (a panel that keeps a run: the run); before the
        controls are set back."""

    def redraw(self) -> None:
        if self._holding:
            return
        self._update_enabled()
        try:
            fig = self._draw(self.compute())
        except Exception as e:  # noqa: BLE001  (shown in the panel; the figure keeps its last good state)
            self.status.value = (f"<span style='color:#b00020'>could not draw for {html.escape(str(self.values()))}:"
                                 f" {type(e).__name__}: {html.escape(str(e))}</span>")
            return
        self.status.value = ""
        self.figure = fig
        self.view.show(fig)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        """The live widget, plus a static snapshot of the figure for viewers without a kernel (a stored
        notebook, the HTML report); the widget's renderer wins in JupyterLab."""
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle[PLOTLY_MIME] = figure_json(self.figure)
        names = ", ".join(self.controls)
        bundle["text/plain"] = f"<interactive panel: {names}; run the notebook in JupyterLab to use it>"
        return bundle


def memory_panel(num_requests: int = 64, seed: int = 0) -> Panel:
    """Contiguous vs paged KV memory for a batch of requests (the ``memory`` study); sliders for the knobs."""
    return Panel(controls_for(cache.MEMORY, options={"max_len": range(256, 8193, 256)}),
                 lambda **kw: cache.allocation(num_requests=num_requests, seed=seed, **kw), cache.MEMORY.draw)


def sharing_panel() -> Panel:
    """A shared system prompt across N requests, each forking parallel samples that generate tokens (the
    ``sharing`` study)."""
    small = {"num_requests": range(1, 13), "system_len": range(0, 129, 4), "samples": range(1, 5),
             "gen_len": range(0, 65), "block_size": (4, 8, 16, 32)}
    return Panel(controls_for(cache.SHARING, options=small), cache.sharing, cache.SHARING.draw)


def coalescing_panel(num_kv_heads: int = 8) -> Panel:
    """Which 128-byte lines one kv head's reads touch, for a layout, block size, head_dim, dtype and alignment (the
    ``coalescing`` study)."""
    small = {"block_size": (1, 2, 4, 8, 16, 32, 64, 128), "pad": (0, 1, 2, 4, 8, 16, 32, 64)}
    return Panel(controls_for(cache.COALESCING, options=small),
                 lambda **kw: cache.coalescing(num_kv_heads=num_kv_heads, **kw), cache.COALESCING.draw)


def decode_results_panel(rows: list[dict]) -> Panel:
    """Measured decode results (``workbench.results.decode``): per-workload bars, roofline, layout and alignment
    sweeps; eager or CUDA-graph times."""
    controls = {
        "view": W.Dropdown(options=["workloads", "roofline", "layouts", "alignment"], value="workloads",
                           description="view"),
        "timing": W.ToggleButtons(options=["eager", "graph"], value="eager", description="timing"),
    }

    def compute(view, timing):
        graph = timing == "graph"
        y = "frac_copy_bw_graph" if graph else "frac_copy_bw"
        if view == "workloads":
            return view, results.best_per_workload(rows, graph), graph
        if view == "roofline":
            return view, (results.roofline_points(results.headline_rows(rows, graph), graph),
                          results.copy_ceiling(rows)), graph
        if view == "layouts":
            return view, results.layout_sweep(rows), y
        return view, results.align_sweep(rows), y

    def draw(r):
        view, data, extra = r
        if view == "workloads":
            return figures.decode_bars(data, graph=extra)
        if view == "roofline":
            return figures.roofline(data[0], data[1], results.H200_PEAK_TFLOPS_FP16)
        y_title = f"fraction of the copy bandwidth ({'CUDA graph' if extra.endswith('_graph') else 'eager'})"
        if view == "layouts":
            return figures.sweep_lines(data, "block_size", "series", y=extra, x_title="block size (tokens)",
                                       y_title=y_title)
        return figures.sweep_lines(data, "pad_bytes", "layout", y=extra, model="model_k_line_eff",
                                   x_title="bytes added to the block stride", model_title="model: K tile line eff.",
                                   y_title=y_title)

    return Panel(controls, compute, draw)


def fragmentation_panel(num_requests: int = 2000) -> Panel:
    """The serving simulator (the ``fragmentation`` study): trace, block size, strategy, KV budget and compaction
    period (adaptive blocks only; 0 = never) -> where the memory goes."""
    f = cache.FRAGMENTATION
    small = {"kv_gib": [float(g) for g in range(2, 41)], "compact_every": (0, 16, 32, 64, 128, 256)}
    model = f.param("model").default
    return Panel(controls_for(f, options=small),
                 lambda **kw: cache.fragmentation(num_requests=num_requests, model=model, **kw), f.draw, live=False,
                 enabled=f.enabled)
