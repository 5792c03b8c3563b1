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
    assert panel.figure.data[0].type == "bar" and "block_size=16" in panel.figure.layout.title.text
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
    assert panel.figure.data == () and "no points at pad=8" in panel.figure.layout.title.text
    panel.controls["source"].value = str(other.json_path)
    assert len(panel.figure.data) == 1 and "pad=8" in panel.figure.layout.title.text


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
    assert "pad" in live.controls["x"].options
    live.controls["source"].value = sweep_panels.LIVE
    live.controls["x"].value = "pad"
    assert [list(d.x) for d in live.figure.data] == [[0, 8, 32]] * len(live.figure.data) and live.status.value == ""
    with pytest.raises(ValueError, match="live: expected a dict"):
        sweep_panels.sweep_panel("coalescing", live=[1, 2])
    with pytest.raises(ValueError, match="name_or_path: expected a sweep's name"):
        sweep_panels.sweep_panel(3)
