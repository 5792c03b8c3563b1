"""A sweep's rows plotted: the view holds the other parameters, a file and the live grid draw the same, and the
panel loads any file the command wrote."""

from __future__ import annotations

import math

import pytest

from workbench import sweeps
from workbench.sweeps import runner, store, view

GRID = {"layout": ["nhd", "vllm"], "block_size": [4, 16, 64], "kind": ["k", "v"]}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return runner.run("coalescing", GRID, out=tmp_path_factory.mktemp("sweeps"), progress=False)


def test_select_holds_the_other_parameters_at_the_default_then_the_first(written):
    s = sweeps.get("coalescing")
    assert view.varying(written.rows, s) == {"layout": ["nhd", "vllm"], "kind": ["k", "v"], "block_size": [4, 16, 64]}
    v = view.select(written.rows, s, x="block_size", y="tile_line_eff", color="layout")
    assert v.held == {"kind": "k"} and v.rows == 6 and list(v.series) == ["nhd", "vllm"]
    for layout, pts in v.series.items():
        assert [x for x, _ in pts] == [4, 16, 64]
        for x, y in pts:
            row = next(r for r in written.rows if (r["layout"], r["block_size"], r["kind"]) == (layout, x, "k"))
            assert y == row["tile_line_eff"]
    assert v.numeric_x and v.log_x
    held = view.select(written.rows, s, x="layout", y="tile_line_eff", held={"kind": "v", "block_size": 64})
    assert held.held == {"kind": "v", "block_size": 64} and not held.numeric_x
    assert list(held.series) == ["tile_line_eff"] and len(held.series["tile_line_eff"]) == 2
    # a value only another file has: nothing drawn, and the title says why (not a silent fallback)
    gone = view.select(written.rows, s, x="layout", y="tile_line_eff", held={"block_size": 999, "pad": 8})
    assert gone.series == {} and gone.absent == {"block_size": 999, "pad": 8} and "no points at" in gone.title()


@pytest.mark.parametrize("kwargs,match", [
    ({"x": "nope", "y": "tile_line_eff"}, "x: 'nope' is not a column"),
    ({"x": "block_size", "y": "nope"}, "y: 'nope'"),
    ({"x": "block_size", "y": "tile_line_eff", "color": "block_size"}, "already the x axis"),
])
def test_select_names_a_bad_argument(written, kwargs, match):
    with pytest.raises(ValueError, match=match):
        view.select(written.rows, "coalescing", **kwargs)
    with pytest.raises(ValueError, match="rows: no rows"):
        view.select([], "coalescing", x="block_size", y="tile_line_eff")


def test_numeric_columns_put_the_sweeps_own_first(written):
    cols = view.numeric_columns(written.rows, sweeps.get("coalescing"))
    assert cols[:len(sweeps.get("coalescing").y)] == list(sweeps.get("coalescing").y)
    assert "layout" not in cols and "seconds" not in cols and "gpu" not in cols


def test_live_rows_are_the_rows_a_sweep_writes(written):
    live = view.live_rows("coalescing", GRID)
    strip = [{k: v for k, v in r.items() if k not in store.META_KEYS} for r in live]
    assert strip == [{k: v for k, v in r.items() if k not in store.META_KEYS} for r in written.rows]


def test_panel_draws_a_file_the_command_wrote_and_the_live_grid_alike(written, monkeypatch):
    from workbench.ui import sweep_panels

    monkeypatch.setattr(store, "COMMITTED", written.json_path.parent / "none")  # only this test's files
    monkeypatch.setattr(store, "OUT", written.json_path.parent / "none")
    panel = sweep_panels.sweep_panel(written.csv_path, live=GRID)
    assert list(panel.controls["source"].options)[0][1] == str(written.csv_path)
    from_file = [(d.name, list(d.x), list(d.y)) for d in panel.figure.data]
    panel.controls["source"].value = sweep_panels.LIVE
    assert panel.status.value == ""
    assert [(d.name, list(d.x), list(d.y)) for d in panel.figure.data] == from_file
    panel.controls["x"].value = "kind"  # categorical x: grouped bars, block size now held
    assert panel.figure.data[0].type == "bar" and "block size = 16 tokens" in panel.figure.layout.title.text
    assert panel.controls["at_block_size"].disabled is False and panel.controls["at_kind"].disabled is True
    panel.controls["at_block_size"].value = 64
    y = [r["tile_line_eff"] for r in written.rows if r["block_size"] == 64 and r["layout"] == "nhd"]
    assert list(panel.figure.data[0].y) == pytest.approx(y)
    panel.controls["color"].value = view.NO_COLOR
    panel.controls["y"].value = "token_line_eff"
    assert len(panel.figure.data) == 1 and all(math.isfinite(v) for v in panel.figure.data[0].y)


def test_panel_without_any_file_says_how_to_make_one(tmp_path, monkeypatch):
    from workbench.ui import sweep_panels

    monkeypatch.setattr(store, "COMMITTED", tmp_path)
    monkeypatch.setattr(store, "OUT", tmp_path)
    with pytest.raises(ValueError, match="python -m workbench sweep memory"):
        sweep_panels.sweep_panel("memory")
    with pytest.raises(ValueError, match="unknown sweep"):
        sweep_panels.sweep_panel("nope")
    with pytest.raises(ValueError, match="path: no sweep file"):
        sweep_panels.sweep_panel(tmp_path / "nope.json")


def test_a_held_value_only_another_file_has_empties_the_plot_and_says_so(written, tmp_path, monkeypatch):
    from workbench.ui import sweep_panels

    other = runner.run("coalescing", {"layout": ["nhd"], "block_size": [4, 16], "pad": [0, 8]}, out=tmp_path,
                       tag="pads", progress=False)
    monkeypatch.setattr(store, "COMMITTED", written.json_path.parent)
    monkeypatch.setattr(store, "OUT", other.json_path.parent)
    panel = sweep_panels.sweep_panel("coalescing")
    assert panel.controls["source"].value == str(written.json_path)  # the untagged file first
    panel.controls["at_pad"].value = 8  # only the pads file has it
    assert panel.figure.data == () and "no points at block stride padding = 8" in panel.figure.layout.title.text
    panel.controls["source"].value = str(other.json_path)
    assert len(panel.figure.data) == 1 and "padding = 8 elements" in panel.figure.layout.title.text


def test_the_first_plot_is_the_first_sources_and_a_live_grid_brings_its_own_axes(written, tmp_path, monkeypatch):
    from workbench.ui import sweep_panels

    other = runner.run("coalescing", {"layout": ["nhd"], "kind": ["k"], "block_size": [16], "head_dim": [64, 128]},
                       out=tmp_path, progress=False)
    monkeypatch.setattr(store, "COMMITTED", written.json_path.parent)
    monkeypatch.setattr(store, "OUT", other.json_path.parent)  # a user's own run varies head_dim
    with_extra = sweep_panels.sweep_panel(written.json_path.parent / "coalescing.json").figure.to_json()
    monkeypatch.setattr(store, "OUT", tmp_path / "none")
    assert sweep_panels.sweep_panel(written.json_path).figure.to_json() == with_extra  # it adds options only
    live = sweep_panels.sweep_panel(written.json_path, live={"pad": [0, 8, 32], "layout": "vllm"})  # a scalar: one
    assert "pad" in [value for _, value in live.controls["x"].options]
    live.controls["source"].value = sweep_panels.LIVE
    live.controls["x"].value = "pad"
    assert [list(d.x) for d in live.figure.data] == [[0, 8, 32]] * len(live.figure.data) and live.status.value == ""
    with pytest.raises(ValueError, match="live: expected a dict"):
        sweep_panels.sweep_panel("coalescing", live=[1, 2])
    with pytest.raises(ValueError, match="name_or_path: expected a sweep's name"):
        sweep_panels.sweep_panel(3)


# ---- what a user reads off a sweep panel (issue 30, item 8) --------------------------------------------------------
SNAKE = r"^[A-Za-z0-9]+(_[A-Za-z0-9]+)+$"  # a bare column name, as the axes read before


def test_every_sweep_labels_its_parameters_and_columns_in_one_table():
    """One table beside each sweep's parameters labels every parameter, every plotted column and every numeric
    column of its committed files: no axis falls back to a column's name."""
    for name in sweeps.names():
        s = sweeps.get(name)
        cols = [p.name for p in s.params] + list(s.y)
        for path in store.files(name):
            cols += view.numeric_columns(store.load(path).rows, s)
        missing = [c for c in dict.fromkeys(cols) if s.column(c) is None]
        assert not missing, f"sweep {name}: no label for {missing}"
        for c in dict.fromkeys(cols):
            col = s.column(c)
            assert col.label and not __import__("re").match(SNAKE, col.label) and col.scale > 0, (name, c, col)


def _sweep_panels():
    from workbench.ui import sweep_panels

    return {name: sweep_panels.sweep_panel(name) for name in sweeps.names() if store.files(name)}


def test_no_axis_title_is_a_bare_column_name_and_the_y_range_fits_the_data():
    """Every committed sweep, every column on y: the axes read labels and units; the y range holds every value, from
    0 for a column with no negative value (a constant series sat on a -1..1 axis: a negative time)."""
    import re

    for name, panel in _sweep_panels().items():
        for _, y in panel.controls["y"].options:
            panel.controls["y"].value = y
            lay = panel.figure.layout
            for title in (lay.xaxis.title.text, lay.yaxis.title.text, lay.title.text.split("<br>")[0]):
                assert title and not re.match(SNAKE, title), (name, y, title)
                assert "_" not in y or y not in title, (name, y, title)  # no column name inside a title
            ys = [v for d in panel.figure.data for v in d.y if v is not None and math.isfinite(v)]
            if ys and lay.yaxis.range is not None:
                lo, hi = lay.yaxis.range
                assert lo <= min(ys) and max(ys) <= hi, (name, y, lay.yaxis.range)
                assert lo >= 0 or min(ys) < 0 or lay.yaxis.ticktext, (name, y, lay.yaxis.range)  # yes/no: -0.3
        panel.reset()


def test_value_range_covers_the_values_from_zero_when_none_is_negative():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.one_of(st.floats(-1e6, 1e6), st.just(float("nan"))), max_size=8))
    def check(values):
        r = view.value_range(values)
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            assert r is None
            return
        lo, hi = r
        assert lo <= min(finite) and max(finite) <= hi and hi > lo
        assert (lo == 0) == (min(finite) >= 0)

    check()
    assert view.value_range([0.02, 0.02, 0.02]) == [0.0, pytest.approx(0.0216)]  # a constant: from 0, not -1..1
    assert view.value_range([True, False], yes_no=True) == [-0.3, 1.3]


def test_a_yes_no_column_is_markers_with_yes_no_ticks_not_a_line():
    from workbench.ui import sweep_panels

    panel = sweep_panels.sweep_panel("forks")  # 08's forks sweep: in_paper_range drew lines through 0.5
    panel.controls["y"].value = "in_paper_range"
    lay = panel.figure.layout
    assert all(d.mode == "markers" for d in panel.figure.data) and lay.scattermode == "group"
    assert list(lay.yaxis.tickvals) == [0, 1] and list(lay.yaxis.ticktext) == ["no", "yes"]
    assert lay.xaxis.type == "category" and set(v for d in panel.figure.data for v in d.y) <= {0.0, 1.0}


def test_series_that_coincide_stay_distinguishable():
    """03: fp8_e4m3's bytes per token (384) hid under int8's: each series has its own marker and dash, and one that
    repeats another says so in the legend."""
    from workbench.ui import sweep_panels

    panel = sweep_panels.sweep_panel("quant")
    panel.controls["y"].value = "bytes_per_token"
    data = {d.name: d for d in panel.figure.data}
    assert "int8 (same as fp8_e4m3)" in data and list(data["fp8_e4m3"].y) == list(data["int8 (same as fp8_e4m3)"].y)
    assert len({d.marker.symbol for d in data.values()}) == len(data) == len({d.line.dash for d in data.values()})
    assert data["fp8_e4m3"].marker.size > data["int8 (same as fp8_e4m3)"].marker.size  # the one under shows round


def test_duplicates_name_the_first_series_each_repeats():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=100, deadline=None)
    @given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=3), min_size=1, max_size=6))
    def check(ys):
        series = {f"s{i}": [(x, float(y)) for x, y in enumerate(pts)] for i, pts in enumerate(ys)}
        v = view.View("quant", "outlier", "attn_err", "family", series)
        same = v.duplicates()
        for key, first in same.items():
            assert series[key] == series[first] and list(series).index(first) < list(series).index(key)
            assert first not in same
        kept = [k for k in series if k not in same]
        assert len({tuple(series[k]) for k in kept}) == len(kept)

    check()


def test_a_sweep_shows_its_times_in_its_panels_unit():
    """05: the preemption panel draws milliseconds, its sweep drew seconds: the sweep's column table scales to ms,
    so the two plots give the same numbers on the same axis unit."""
    from workbench.sim.preemption_cost import BLOCK_SIZES
    from workbench.ui import sweep_panels, tier_panels
    from workbench.ui.tier_panels import preemption_panel

    sweep = sweep_panels.sweep_panel("preemption")
    sweep.controls["color"].value = view.NO_COLOR
    sweep.controls["at_copies"].value = "layer"
    assert "(ms)" in sweep.figure.layout.yaxis.title.text
    panel = preemption_panel(block_sizes=BLOCK_SIZES)
    assert "(ms)" in panel.figure.layout.yaxis.title.text
    drawn = dict(zip(sweep.figure.data[0].x, sweep.figure.data[0].y, strict=True))
    ref = dict(zip(panel.figure.data[0].x, panel.figure.data[0].y, strict=True))  # swap, block by block
    assert drawn.keys() <= ref.keys() and all(drawn[b] == pytest.approx(ref[b]) for b in drawn)
    assert tier_panels  # the panel and the sweep read the same committed link


def test_a_numeric_x_is_ticked_at_the_values_swept():
    """08's forks sweep ticked its sample counts 2, 4, 6 at 2.5, 3, 3.5 ...: an x of a few values is ticked at them."""
    from workbench.ui import sweep_panels

    panel = sweep_panels.sweep_panel("forks")
    assert list(panel.figure.layout.xaxis.tickvals) == [2, 4, 6] and panel.figure.layout.xaxis.type == "linear"
    quant = sweep_panels.sweep_panel("quant")
    assert list(quant.figure.layout.xaxis.tickvals) == [1, 4, 8]
