"""Notebook 05's data and panels: the loaders of the committed ``bench tiers`` runs (``workbench.results.tiers``)
checked against the files themselves, then the panels and figures headless (``workbench.ui.tier_panels``,
``tier_figures``): they build, every control changes the figure, and what they show is what the package computes.
"""

import json
import shutil
import time
from pathlib import Path

import pytest
from panel_controls import control_values, next_value

from workbench.results import tiers as measured

RESULTS = Path(__file__).resolve().parents[1] / "data" / "results"
OLD, NEW = "tiers-h200-20261201T205629.json", "tiers-h200-20261201T205651.json"
SIZES = tuple(1024 * k for k in (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
BATCHES = (1, 4, 16, 64, 256)


@pytest.fixture(scope="module")
def runs():
    found = measured.runs()
    assert [measured.run_name(r) for r in found][-2:] == [OLD, NEW]
    return {measured.run_name(r): r for r in found}


def raw(name):
    return json.loads((RESULTS / name).read_text())


# ---- the loaders, against the committed files ----------------------------------------------------------------------
def test_runs_are_the_full_h200_runs_oldest_first(runs, tmp_path):
    assert measured.latest()["path"].name == NEW
    r = runs[NEW]
    assert r["info"]["gpu"] == "NVIDIA H200" and r["info"]["quick"] is False
    assert measured.runs(tmp_path) == [] and measured.latest(tmp_path) is None
    shutil.copy(RESULTS / OLD, tmp_path / OLD)
    quick = {**raw(NEW), "quick": True}
    (tmp_path / NEW).write_text(json.dumps(quick))
    assert [measured.run_name(x) for x in measured.runs(tmp_path)] == [OLD]  # --quick runs are left out
    assert len(measured.runs(tmp_path, where={})) == 2


def test_pinned_numbers_are_the_files(runs):
    for name in (OLD, NEW):
        doc, p = raw(name), measured.pinned(runs[name])
        assert p == {"h2d": doc["pinned_gbps"]["h2d"], "d2h": doc["pinned_gbps"]["d2h"],
                     "pageable_h2d": doc["pageable_gbps"]["h2d"], "pageable_d2h": doc["pageable_gbps"]["d2h"]}
    assert measured.pinned(runs[NEW])["h2d"] == pytest.approx(55.41, abs=0.01)


@pytest.mark.parametrize("path", list(measured.PATHS))
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_bandwidth_map_is_the_full_grid_of_the_link_rows(runs, path, direction):
    m = measured.bandwidth_map(runs[NEW], path, direction)
    assert (m.block_bytes, m.blocks, m.source, m.value) == (SIZES, BATCHES, NEW, "frac")
    assert len(m.z) == len(BATCHES) and all(len(row) == len(SIZES) for row in m.z)
    rows = [r for r in raw(NEW)["rows"] if r["section"] == "link" and r["path"] == path and r["direction"] == direction]
    assert len(rows) == 50
    for r in rows:
        assert m.at(r["block_bytes"], r["blocks"]) == r["frac"]
        assert m.gbps[BATCHES.index(r["blocks"])][SIZES.index(r["block_bytes"])] == r["gbps"]
        # frac is of the same run's pinned bandwidth (gbps rounded to 0.01, frac to 0.001)
        assert r["gbps"] / m.pinned_gbps == pytest.approx(r["frac"], abs=1.5e-3)
    eager = measured.bandwidth_map(runs[NEW], path, direction, "frac_eager")
    flat = lambda grid: [v for row in grid for v in row]
    assert len(flat(eager.z)) == 50 and sum(flat(eager.z)) < sum(flat(m.z))  # the host's launches cost time


def test_what_batching_buys_at_32_kib(runs):
    """The notebook's numbers: per-block copies ~0.24 of the link, a batch of 64 ~0.74, of 256 ~0.92, SM ~0.94/0.86."""
    s = measured.batching_summary(runs[NEW])
    assert s["d2h"]["dma_per_block"] == {64: 0.239, 256: 0.232} and s["h2d"]["dma_per_block"] == {64: 0.19, 256: 0.187}
    assert s["d2h"]["dma"] == {64: 0.768, 256: 0.917} and s["h2d"]["dma"] == {64: 0.737, 256: 0.92}
    assert s["d2h"]["sm"][64] == 0.94 and s["h2d"]["sm"][64] == 0.863
    old = measured.batching_summary(runs[OLD])
    assert old["d2h"]["dma"] == {64: 0.742, 256: 0.915} and old["h2d"]["sm"][64] == 0.858
    for summary in (s, old):  # batching beats per-block copies 3x and more in both runs and directions
        for d in ("h2d", "d2h"):
            assert summary[d]["dma"][64] > 3 * summary[d]["dma_per_block"][64]
    curves = measured.batch_curves(runs[NEW], 32 << 10, "h2d")
    assert list(curves) == list(measured.PATHS) and [n for n, _ in curves["dma"]] == list(BATCHES)
    assert dict(curves["dma"])[256] == 0.92 and dict(curves["sm"])[16] == 0.717


def test_beside_and_overlap_rows(runs):
    beside = measured.beside_rows(runs[NEW])
    assert [r["label"] for r in beside] == ["DMA (copy engine)", "SM copy, 8 programs", "SM copy, 16 programs",
                                             "SM copy, 32 programs", "SM copy, 66 programs", "SM copy, full grid"]
    assert beside[0]["slowdown"] == 0.0137 and beside[0]["frac_beside"] == 0.976 and beside[-1]["slowdown"] == 0.8069
    assert all(r["decode_alone_us"] == 250.91 for r in beside)
    overlap = measured.overlap_rows(runs[NEW])
    assert [r["label"] for r in overlap] == ["DMA (copy engine)", "DMA, gather on 32 programs",
                                              "DMA, gather on 8 programs", "SM copy, full grid", "SM copy, 16 programs"]
    assert overlap[0]["hidden"] == 0.852 and overlap[3]["hidden"] == 0.078 and overlap[3]["decode_slowdown"] == 0.763
    assert all(r["bytes"] == 3 * 1024 * (64 << 10) for r in overlap)
    old = measured.overlap_rows(runs[OLD])
    assert [r["hidden"] for r in old] == [0.779, 0.557, 0.273, 0.065, 0.489]
    # the copy engine hides most of a prefetch, the full-grid SM copy almost none, in both runs
    assert all(o[0]["hidden"] > 0.75 and o[3]["hidden"] < 0.1 for o in (overlap, old))


def test_check_summary_and_spread(runs):
    c = measured.check_summary(runs[NEW])
    assert c == {"checks": 6, "ok": 6, "kv_dtypes": ["fp16", "fp8_e4m3/token", "int8/token"], "paths": ["dma", "sm"],
                 "disk_write_gbps": 1.19, "disk_read_gbps": 1.57}
    assert measured.spread([2.0]) == 0 and measured.spread([1.0, 1.5]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        measured.spread([0.0, 1.0])


@pytest.mark.parametrize("call, argument", [
    (lambda r: measured.bandwidth_map(r, "pcie"), "path"),
    (lambda r: measured.bandwidth_map(r, "dma", "up"), "direction"),
    (lambda r: measured.bandwidth_map(r, "dma", "h2d", "time"), "value"),
    (lambda r: measured.batch_curves(r, 3000), "block_bytes"),
    (lambda r: measured.link_value(r, "dma", "h2d", 32 << 10, 3), "no dma h2d row"),
    (lambda r: measured.pinned({**r, "info": {}}), "pinned_gbps"),
    (lambda r: measured.bandwidth_map({**r, "rows": []}), "no link rows"),
])
def test_bad_arguments_name_the_argument(runs, call, argument):
    with pytest.raises(ValueError, match=argument):
        call(runs[NEW])


# ---- panels and figures, headless ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ui():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    pytest.importorskip("anywidget")
    from workbench.figures import tiers as tier_figures
    from workbench.ui import tier_panels
    from workbench.ui.plot_view import figure_json

    return tier_panels, tier_figures, figure_json


@pytest.fixture(scope="module")
def panels(ui):
    tp, _, _ = ui
    return {"bandwidth": tp.bandwidth_panel(), "prefetch": tp.prefetch_panel(), "preemption": tp.preemption_panel(),
            "format": tp.format_panel()}


@pytest.mark.parametrize("name", ["bandwidth", "prefetch", "preemption", "format"])
def test_every_control_changes_the_figure_and_redraws_fast(ui, panels, name):
    _, _, figure_json = ui
    panel = panels[name]
    assert len(panel.controls) <= 8
    for key, control in panel.controls.items():
        if control.disabled:
            continue
        first = control.value
        for value in [v for v in control_values(control) if v != first][:2] + [next_value(control)]:
            before = json.dumps(figure_json(panel.figure), sort_keys=True)
            start = time.perf_counter()
            control.value = value
            took = time.perf_counter() - start
            assert panel.status.value == "", (key, value, panel.status.value)
            after = figure_json(panel.figure)
            assert json.dumps(after, sort_keys=True) != before, f"{name}: {key} -> {value!r} changed nothing"
            assert panel.view.figure == after  # the page gets the whole new figure
            assert took < 2.0, f"{name}: {key} -> {value!r} took {took:.2f} s"
            control.value = first
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.plotly.v1+json" in bundle and "run the notebook" in bundle["text/plain"]


def test_bandwidth_panel_shows_the_chosen_map(panels, runs):
    p = panels["bandwidth"]
    assert p.controls["run"].value == NEW and p.controls["block_bytes"].value == 32 << 10
    heat = p.figure.data[0]
    assert heat.type == "heatmap" and [list(r) for r in heat.z] == [list(r) for r in
                                                                    measured.bandwidth_map(runs[NEW]).z]
    p.controls["path"].value = "sm"
    p.controls["direction"].value = "d2h"
    assert list(p.figure.data[0].z[3]) == list(measured.bandwidth_map(runs[NEW], "sm", "d2h").z[3])
    assert "SM copy kernel" in p.figure.layout.title.text and NEW in p.figure.layout.title.text
    lines = {t.name: list(t.y) for t in p.figure.data[1:]}
    assert lines["one copy per block"] == [v for _, v in measured.batch_curves(runs[NEW], 32 << 10,
                                                                               "d2h")["dma_per_block"]]
    p.controls["path"].value, p.controls["direction"].value = "dma", "h2d"


def test_prefetch_panel_rows_are_compare_of_the_same_configuration(panels):
    from workbench.tiers import access
    from workbench.tiers.link import latest_link_model
    from workbench.tiers.prefetch import get
    from workbench.tiers.replay import compare

    p = panels["prefetch"]
    r = p.compute()
    tr = access.topk_trace(2048, 128, 16, 16, drift=0.2)
    want = compare(tr, ["none", get("sequential", depth=24), get("window", window_tokens=256), "hot_lru", "hot_lfu",
                        get("score", depth=24)], device_blocks=48, block_bytes=16384 * 16, compute_s=100e-6,
                   link=latest_link_model())
    assert [x["hit_rate"] for x in r["rows"]] == [w["hit_rate"] for w in want]
    assert [x["strategy"] for x in r["rows"]] == ["none", "sequential", "window", "hot_lru", "hot_lfu", "score"]
    assert r["chosen"] == "score" and r["rows"][-1]["hit_rate"] > r["rows"][0]["hit_rate"] > r["rows"][4]["hit_rate"]
    assert {i.step for i in r["timeline"]} == set(range(40))
    kinds = {t.name for t in p.figure.data if t.orientation == "h"}
    assert kinds == {"compute", "demand fetch (stall)", "prefetch (beside compute)"}
    assert list(p.figure.data[0].x) == ["none", "readahead", "window", "hot LRU", "hot LFU", "score"]


def test_prefetch_panel_greys_out_depth_and_falls_back_without_scores(panels):
    p = panels["prefetch"]
    c = p.controls
    assert not c["depth"].disabled
    c["pattern"].value = "full"
    assert c["depth"].disabled and p.status.value == ""
    r = p.compute()
    assert r["replayed"] == "none" and "score" not in [x["strategy"] for x in r["rows"]]
    assert "no prefetch shown" in p.figure.layout.annotations[2].text
    assert r["chosen"] == "score" and _ringed(p) == []  # not the 'none' bar: the user did not choose it
    c["pattern"].value = "sliding_window"
    assert c["depth"].disabled
    c["pattern"].value = "capture"
    assert not c["depth"].disabled and {i.step for i in p.compute()["timeline"]} == set(range(16))
    c["pattern"].value = "topk"


def _ringed(panel) -> list[str]:
    """The bars the prefetch panel rings (its hit-rate bars' outlines), by their axis names."""
    bars = panel.figure.data[0]
    return [x for x, colour in zip(bars.x, bars.marker.line.color, strict=True) if colour != "rgba(0,0,0,0)"]


def test_prefetch_panel_rings_the_chosen_strategy_or_none(panels):
    """05: sliding window while 'score-guided' was chosen ringed the 'none' bar. For any pattern and strategy, the
    ringed bar is the strategy chosen, or nothing when the trace cannot run it."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from workbench.studies.tiers import SHORT

    p = panels["prefetch"]
    c = p.controls
    patterns, strategies = [v for _, v in c["pattern"].options], [v for _, v in c["strategy"].options]

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.explicit, Phase.reuse, Phase.generate))
    @given(st.sampled_from(patterns), st.sampled_from(strategies))
    def check(pattern, strategy):
        c["pattern"].value, c["strategy"].value = pattern, strategy
        ran = [x["strategy"] for x in p.compute()["rows"]]
        assert _ringed(p) == ([SHORT[strategy]] if strategy in ran else []), (pattern, strategy)

    check()
    p.reset()


def test_preemption_panel_follows_the_curve(panels):
    from workbench.sim import preemption_cost as pc
    from workbench.tiers.link import latest_link_model

    p = panels["preemption"]
    rows = p.compute()["rows"]
    want = pc.block_size_curve([1, 2, 4, 8, 16, 32, 64, 128, 256], 1024, pc.model_bytes_per_token("llama-7b"),
                               latest_link_model(), pc.PrefillModel.for_model("llama-7b"),
                               transfers_per_block=pc.per_layer_transfers("llama-7b"))
    assert rows == want
    assert "recompute is faster below 8 tokens a block" in p.figure.layout.title.text
    assert len(p.figure.layout.shapes) == 1  # the crossover band
    p.controls["copies"].value = "block"
    assert "swap is faster at every block size" in p.figure.layout.title.text and not p.figure.layout.shapes
    p.controls["copies"].value = "layer"


def test_beside_overlap_figure_and_size_labels(ui, runs):
    _, tf, _ = ui
    rs = [runs[OLD], runs[NEW]]
    fig = tf.beside_overlap([measured.beside_rows(r) for r in rs], [measured.overlap_rows(r) for r in rs], [OLD, NEW])
    bars = [t for t in fig.data if t.type == "bar"]
    assert [round(y, 2) for y in bars[0].y] == [1.37, 11.03, 29.32, 53.53, 55.35, 80.69]  # the newest run, %
    assert NEW in fig.layout.title.text and any(OLD in (t.name or "") for t in fig.data)
    assert [tf.size_label(b) for b in (4096, 32768, 2 << 20, 23040, 100)] == ["4 KiB", "32 KiB", "2 MiB", "22.5 KiB",
                                                                               "100 B"]
