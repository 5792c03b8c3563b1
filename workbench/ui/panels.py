"""ipywidgets panels: controls wired to a pure function and a plotly FigureWidget.

A panel holds no logic of its own: on every change it calls ``compute`` (a function of
the package) and ``draw`` (a figure builder in ``workbench.ui.figures``). Setting
``panel.controls[name].value = x`` drives it without a browser (observers fire
synchronously), which is how the notebooks test their panels under nbval.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go

from workbench import memory, spec
from workbench.ui import figures


class Panel:
    def __init__(self, controls: dict[str, W.ValueWidget], compute: Callable[..., Any],
                 draw: Callable[[Any], go.Figure]):
        self.controls = controls
        self.compute = lambda: compute(**self.values())
        self._draw = draw
        self.figure = go.FigureWidget(draw(self.compute()))
        for control in controls.values():
            control.observe(lambda _change: self.redraw(), names="value")
        self.widget = W.VBox([W.HBox(list(controls.values())), self.figure])

    def values(self) -> dict[str, Any]:
        return {name: w.value for name, w in self.controls.items()}

    def redraw(self) -> None:
        fresh = self._draw(self.compute())
        with self.figure.batch_update():
            self.figure.data = ()
            self.figure.add_traces(fresh.data)
            self.figure.layout = fresh.layout

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def memory_panel(num_requests: int = 64, seed: int = 0) -> Panel:
    """Contiguous vs paged KV memory for a batch of requests; sliders for the knobs."""
    controls = {
        "model": W.Dropdown(options=sorted(spec.MODELS), value="llama-7b", description="model"),
        "kv_dtype": W.Dropdown(options=["fp16", "bf16", "fp8_e4m3", "int8", "int4"], value="fp16",
                               description="dtype"),
        "block_size": W.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=16,
                                        description="block size"),
        "max_len": W.IntSlider(value=2048, min=256, max=8192, step=256, description="max len"),
    }

    def compute(model: str, kv_dtype: str, block_size: int, max_len: int):
        current, final = memory.random_batch(num_requests, max_len, seed)
        bpt = spec.model(model).bytes_per_token(kv_dtype)
        return memory.compare_allocation(current, final, max_len, block_size, bpt)

    return Panel(controls, compute, figures.breakdown_bars)
