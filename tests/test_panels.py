"""Panels without a browser: what each redraw sends to the page, the static snapshot, failures, layout.

``tests/browser`` checks the same panels in Chromium; these are the fast, exact checks of the Python side.
"""

import json

import pytest

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

import ipywidgets as W  # noqa: E402
import plotly.graph_objects as go  # noqa: E402

from workbench.ui import panels  # noqa: E402
from workbench.ui.plot_view import PlotView, figure_json  # noqa: E402

ALL_PANELS = {
    "memory": lambda: panels.memory_panel(num_requests=16),
    "sharing": panels.sharing_panel,
    "coalescing": panels.coalescing_panel,
    "fragmentation": lambda: panels.fragmentation_panel(num_requests=100),
}


@pytest.mark.parametrize("name", ALL_PANELS)
def test_every_redraw_sends_the_whole_new_figure(name):
    panel = ALL_PANELS[name]()
    assert panel.view.figure == figure_json(panel.figure)
    for control in panel.controls.values():
        if control.disabled or not hasattr(control, "options"):
            continue
        other = [o for o in control.options if (o[1] if isinstance(o, tuple) else o) != control.value]
        if not other:
            continue
        control.value = other[-1][1] if isinstance(other[-1], tuple) else other[-1]
        # the page gets the complete figure, so nothing of the previous layout can survive (Plotly.react)
        assert panel.view.figure == figure_json(panel.figure), control.description
        assert panel.status.value == ""


def test_snapshot_bundle_has_the_widget_the_figure_and_a_short_text():
    panel = panels.memory_panel(num_requests=16)
    bundle = panel._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == panel.widget.model_id
    assert bundle[panels.PLOTLY_MIME] == figure_json(panel.figure)
    assert "VBox(" not in bundle["text/plain"] and "run the notebook" in bundle["text/plain"]
    json.dumps(bundle)  # what the notebook stores must be plain JSON


def test_a_failed_redraw_says_why_and_keeps_the_last_figure():
    calls = {"n": 0}

    def compute(x):
        calls["n"] += 1
        if x == 3:
            raise ValueError("x must not be 3")
        return x

    slider = W.IntSlider(value=1, min=0, max=5)
    panel = panels.Panel({"x": slider}, compute, lambda x: go.Figure(go.Bar(y=[x])))
    slider.value = 3
    assert "ValueError" in panel.status.value and "x must not be 3" in panel.status.value
    assert list(panel.figure.data[0].y) == [1] and panel.view.figure == figure_json(panel.figure)
    slider.value = 4
    assert panel.status.value == "" and list(panel.figure.data[0].y) == [4]


def test_controls_wrap_and_sliders_keep_a_usable_track():
    panel = panels.sharing_panel()
    box = panel.widget.children[0]
    assert box.layout.flex_flow == "row wrap"
    sliders = [c for c in panel.controls.values() if "Slider" in type(c).__name__]
    assert sliders and all(s.layout.width == panels.SLIDER_WIDTH for s in sliders)
    assert all(c.style.description_width == "initial" for c in panel.controls.values())


def test_controls_that_do_not_apply_are_greyed_out():
    panel = panels.fragmentation_panel(num_requests=100)
    c = panel.controls
    assert c["compact_every"].disabled and not c["block_size"].disabled
    c["strategy"].value = "paged-adaptive"
    assert not c["compact_every"].disabled
    c["strategy"].value = "orca-max"
    assert c["compact_every"].disabled and c["block_size"].disabled


def test_slow_panels_recompute_on_release_only():
    frag, mem = panels.fragmentation_panel(num_requests=100), panels.memory_panel(num_requests=16)
    assert not frag.controls["kv_gib"].continuous_update
    assert mem.controls["max_len"].continuous_update


def test_live_panels_are_listed_with_their_page_class():
    panel = panels.memory_panel(num_requests=16)
    assert panel in panels.Panel.live()
    assert f"wb-panel-{panel.id}" in panel.widget._dom_classes


def test_plot_view_module_carries_plotly_once_and_the_view():
    from workbench.ui import plot_view

    module = plot_view._module()
    assert module.startswith("if (!globalThis.Plotly)") and "export default { render }" in module
    assert "Plotly.react" in module and "ResizeObserver" in module
    view = PlotView(go.Figure(go.Scatter(y=[3, 1, 2])))
    assert view.figure["data"][0]["y"] == [3, 1, 2]
