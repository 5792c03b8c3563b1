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


def test_plot_views_share_one_copy_of_plotly_js():
    """plotly.js travels once per kernel, in one PlotlySource every view refers to (each view's own 3.5 MB cost the
    browser ~0.2-0.4 s of CPU a view); the view's module is only the view. A closed source is replaced."""
    import plotly.offline

    from workbench.ui import plot_view

    module = plot_view._module()
    assert "export default { render }" in module and "Plotly.react" in module and "ResizeObserver" in module
    assert len(module) < 10_000  # the view alone, not plotly.js
    a, b = PlotView(go.Figure(go.Scatter(y=[3, 1, 2]))), PlotView()
    assert a.figure["data"][0]["y"] == [3, 1, 2]
    assert a._plotly is b._plotly and a._plotly.source == plotly.offline.get_plotlyjs()
    assert a.get_state("_plotly")["_plotly"] == f"IPY_MODEL_{a._plotly.model_id}"  # a reference, not the source
    a._plotly.close()
    c = PlotView()
    assert c._plotly is not a._plotly and c._plotly.comm is not None


# ---- after Run All a panel shows its parameters cell's settings (issue 30, item 8) ------------------------------
def _moves(panel):
    """Every (control, value) a check cell could set: each option of a dropdown or toggle, a slider's range."""
    import panel_controls

    def values(c):
        if isinstance(c, W.Checkbox):
            return [True, False]
        return [c.min, c.max] if isinstance(c, W.FloatSlider) else panel_controls.control_values(c)

    return [(name, v) for name, c in panel.controls.items() for v in values(c)]


@pytest.mark.parametrize("name", ALL_PANELS)
def test_reset_puts_every_control_and_the_figure_back_after_random_moves(name):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    panel = ALL_PANELS[name]()
    built, figure = dict(panel.values()), figure_json(panel.figure)
    assert panel.initial == built
    moves = _moves(panel)

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(moves), min_size=1, max_size=4))
    def check(seq):
        for control, value in seq:
            panel.controls[control].value = value
        panel.reset()
        assert panel.values() == built and panel.status.value == ""
        assert figure_json(panel.figure) == figure and panel.view.figure == figure  # one redraw, the page's too

    check()


def test_reset_redraws_once_and_restores_a_subclass_state():
    draws = []

    class Counting(panels.Panel):
        def _restore(self):
            self.restored = True

    sliders = {n: W.IntSlider(value=1, min=0, max=5) for n in "ab"}
    panel = Counting(sliders, lambda a, b: (a, b), lambda r: draws.append(r) or go.Figure(go.Bar(y=list(r))))
    sliders["a"].value, sliders["b"].value = 4, 5
    draws.clear()
    panel.reset()
    assert draws == [(1, 1)] and panel.restored and panel.values() == {"a": 1, "b": 1}


def test_set_moves_several_controls_with_one_redraw_and_refuses_before_moving_any():
    import random

    from traitlets import TraitError

    draws = []
    rng = random.Random(7)
    sliders = {n: W.IntSlider(value=rng.randint(0, 9), min=0, max=9) for n in "abc"}
    sliders["d"] = W.Dropdown(options=["x", "y", "z"], value="y")
    panel = panels.Panel(sliders, lambda a, b, c, d: (a, b, c, d),
                         lambda r: draws.append(r) or go.Figure(go.Bar(y=list(r[:3]))))
    for _ in range(5):
        want = {"a": rng.randint(0, 9), "c": rng.randint(0, 9), "d": rng.choice("xyz")}
        before, draws[:] = panel.values(), []
        panel.set(**want)
        assert panel.values() == {**before, **want} and draws == [tuple(panel.values().values())]
        assert panel.view.figure == figure_json(panel.figure)
    shown, values, draws[:] = figure_json(panel.figure), panel.values(), []
    with pytest.raises(ValueError, match="no control named e, f"):
        panel.set(a=1, f=2, e=3)
    with pytest.raises(TraitError, match="Invalid selection"):  # not one of the dropdown's options
        panel.set(a=(values["a"] + 1) % 10, d="w")
    assert panel.values() == values and draws == [] and figure_json(panel.figure) == shown


def _check_cells():
    """(notebook, cell index, source) of every code cell that moves a panel's controls or presses its button."""
    import re
    from pathlib import Path

    import nbformat

    for path in sorted((Path(__file__).parents[1] / "notebooks").glob("[0-9]*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code" and re.search(r"\w+\.(controls\[[^]]+\]\.value\s*=|button\.click\()",
                                                      cell.source.replace(", ", ",")):
                yield path.stem, i, cell.source


def test_every_check_cell_that_moves_a_panel_ends_by_resetting_it():
    """A check cell that moved a panel's controls and left them there made Run All show the check's last state
    (06: 3 samples at temperature 0, K/V layer 3 instead of KV_LAYER; 08: MHA at a 128-token prefix): each panel it
    moves is reset after its last move."""
    import re

    cells = list(_check_cells())
    assert len(cells) >= 20  # every notebook has such cells
    for stem, i, source in cells:
        lines = source.splitlines()
        moved = set(re.findall(r"(\w+)\.controls\[", source)) | set(re.findall(r"(\w+)\.button\.click", source))
        for name in moved:
            last_move = max(n for n, line in enumerate(lines) if re.search(rf"\b{name}\.(controls\[|button)", line))
            resets = [n for n, line in enumerate(lines) if re.match(rf"{name}\.reset\(\)", line)]
            assert resets and resets[-1] > last_move, f"{stem} cell {i}: {name} is moved and not reset after"


def test_quant_speed_heatmap_frames_the_scheme_chosen_or_says_it_was_not_timed():
    """03: 'int2 K/tok R128' framed int2/token, which keeps no fp16 residual: the frame goes to the measured scheme
    equal to the choice in every parameter, or to none, and the heatmap's title says the choice was not timed."""
    import dataclasses

    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    from workbench import quant
    from workbench.quant import error_study
    from workbench.ui.quant_panels import measured_scheme, quant_panel

    timed = ["fp16", "fp8_e4m3/tensor", "int8/token", "int4/kivi", "int4/token", "int2/kivi", "int2/token"]
    rows = [{"section": "decode", "workload": "W1", "scheme": s, "time_us": 10.0 + i, "speedup_vs_fp16": 1.0,
             "bytes_per_token": 100 - i} for i, s in enumerate(timed)]
    panel = quant_panel(num_layers=1, num_tokens=64, num_kv_heads=1, head_dim=64, group=1, num_queries=4,
                        decode_rows=rows)
    c = panel.controls

    def params(s):
        return {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in ("name", "label")}

    @settings(max_examples=10, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
    @given(st.sampled_from(error_study.FAMILIES), st.sampled_from(["tensor", "head", "token"]), st.sampled_from(
        [8, 32, 128]), st.sampled_from([0, 128]), st.sampled_from(["channel", "token"]))
    def check(family, granularity, group, residual, key_mode):
        for k, v in dict(family=family, granularity=granularity, group=group, residual=residual,
                         key_mode=key_mode).items():
            c[k].value = v
        chosen = error_study.scheme_for(family, granularity, group, residual, key_mode, head_dim=64)
        name = measured_scheme(chosen, timed)
        assert name is None or params(quant.get(name)) == params(chosen)
        heat = next(d for d in panel.figure.data if d.type == "heatmap")
        framed = [heat.y[round((s.y0 + s.y1) / 2)] for s in panel.figure.layout.shapes]
        assert framed == ([name] if name else [])
        assert ("not timed" in panel.figure.layout.annotations[1].text) == (name is None)

    check()
    c["family"].value, c["residual"].value, c["key_mode"].value = "int2", 128, "token"  # the example
    assert measured_scheme(error_study.scheme_for("int2", "tensor", 32, 128, "token"), timed) is None
    panel.reset()


def test_setup_titles_wrap_to_fit_and_grow_the_margin():
    """07's evicted-cache title ran past its figure's right edge (the browser test's title check): a setup title and
    each subtitle line are wrapped at word boundaries, the top margin and the height growing by the lines added."""
    import re

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from workbench.figures.titles import SUB_CHARS, TITLE_CHARS, setup_title

    words = st.lists(st.text("abcdefghij:,%", min_size=1, max_size=12), min_size=1, max_size=40).map(" ".join)

    @settings(max_examples=100, deadline=None)
    @given(words, st.lists(words, min_size=1, max_size=3))
    def check(title, subs):
        top = setup_title({"title": title, "subtitle": "<br>".join(subs)}, margin_t=100, height=500)
        head, _, sub = top["title"].partition("<br><sup>")
        sub = sub.removesuffix("</sup>")
        assert all(len(line) <= TITLE_CHARS for line in head.split("<br>"))
        assert all(len(line) <= SUB_CHARS for line in sub.split("<br>"))
        assert head.replace("<br>", " ").split() == title.split()  # the same words, in order
        extra = head.count("<br>") + sub.count("<br>") - (len(subs) - 1)
        assert top["margin_t"] == 100 + 20 * extra and top["height"] == 500 + 20 * extra
        assert not re.search(r"<br>\s*<br>", top["title"])

    check()


def test_headline_is_the_whole_title_line_without_its_subtitle():
    from workbench.ui.sweep_panels import sweep_panel

    panel = sweep_panel("quest")
    text = panel.figure.layout.title.text
    assert "<br>" in text.split("<br><sup>")[0]  # this title wraps: its first line alone is a fragment
    assert panel.headline() == text.split("<br><sup>")[0].replace("<br>", " ") and "<" not in panel.headline()
