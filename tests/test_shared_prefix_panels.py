"""Notebook 08's data and panels: the study functions (``workbench.shared_prefix.scenarios``), the loaders of the
committed ``bench shared_prefix`` runs against the files, and the panels headless: they build, every control changes
the figure, and what they show is what the package computes."""

import json
from pathlib import Path

import pytest
from panel_controls import control_values, next_value

from workbench.results import shared_prefix as measured
from workbench.shared_prefix import scenarios

RESULTS = Path(__file__).resolve().parents[1] / "data" / "results"
NEW = "shared-prefix-h200-20261202T064526.json"


def test_tables_hold_what_the_scenario_says():
    tables, lens, n = scenarios.build_tables(100, 6, 40, 16, groups=2, fork=50)
    assert len(tables) == 6 and lens == [190] * 6 and n == max(b for t in tables for b in t) + 1
    assert all(t[:6] == tables[0][:6] for t in tables)  # 6 full prompt blocks shared by all
    assert tables[0][6:9] == tables[2][6:9] and tables[0][6] != tables[3][6]  # (4 + 50) // 16 = 3 fork blocks
    with pytest.raises(ValueError, match="groups"):
        scenarios.build_tables(10, 2, 1, 16, groups=3)
    with pytest.raises(ValueError, match="suffix"):
        scenarios.build_tables(10, 2, -1, 16)


@pytest.mark.parametrize("groups", [1, 4])
def test_program_reads_cover_every_block_of_every_sequence(groups):
    sc = scenarios.scenario(1000, 12, 70, groups=groups, fork=300 if groups > 1 else 0, rows_per_tile=16)
    bs = sc.geo.block_size
    need = {i: t[: -(-n // bs)] for i, (t, n) in enumerate(zip(sc.tables, sc.lens, strict=True))}
    plain = scenarios.program_reads(sc, "plain", max_programs=1000)
    assert [p["blocks"] for p in plain] == list(need.values())
    shared = scenarios.program_reads(sc, "shared", max_programs=1000)
    got = {i: [] for i in need}
    for s, e, rows in sc.choice.segments:
        for r in rows:
            got[r] += sc.tables[r][s:e]
    for i, p in enumerate(p for p in shared if p["kind"] == "suffix"):
        got[i] += p["blocks"]
    assert got == need  # each sequence's blocks once: its segments in order, then its suffix
    tiles = [p for p in shared if p["kind"] == "shared"]
    assert len(tiles) == sum(sc.geo.tiles(len(r)) for *_, r in sc.choice.segments)
    assert sum(p["rows"] for p in tiles) == sum(len(r) * sc.geo.group for *_, r in sc.choice.segments)
    capped = scenarios.program_reads(sc, "shared", max_programs=5)
    assert len(capped) == 5 and capped[-1]["kind"] == "more"


def test_scenario_reads_less_through_the_cascade_and_the_selector_follows_the_model():
    small, big = scenarios.scenario(128, 4, 128), scenarios.scenario(32768, 64, 128)
    assert small.choice.path == "plain" and big.choice.path == "shared" and big.speedup > 5
    assert big.choice.bytes["cascade"] < big.choice.bytes["plain"] / 10


def test_batching_study_groups_sharers():
    r = scenarios.batching_study(8, 8, 1024, 64, 16, seed=3)
    assert r["grouped"] < r["arrival"] < r["plain"]
    assert sorted(i for b in r["grouping"] for i in b) == list(range(64))


# ---- the loaders, against the committed file -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def run():
    found = {measured.run_name(r): r for r in measured.runs()}
    assert NEW in found
    return found[NEW]


def test_crossover_map_is_the_files_rows(run):
    rows = json.loads((RESULTS / NEW).read_text())["rows"]
    cmap = measured.crossover(run, "32/8", 128)
    assert cmap.prefixes == [128, 1024, 8192, 32768] and cmap.sharers == [1, 4, 16, 64, 256]
    want = next(r for r in rows if r["section"] == "map" and r["impl"] == "cascade" and r["gqa"] == "32/8"
                and r["prefix"] == 32768 and r["sharers"] == 64 and r["suffix"] == 128)
    assert cmap.speedup[3][3] == want["speedup_graph"] and cmap.speedup[0][0] is None  # one sharer: no cascade
    assert all(ok for row in cmap.right for ok in row if ok is not None)  # the committed picks were right
    assert measured.headline(run, "32/32")[128] == pytest.approx(30.3, abs=0.1)
    curves = measured.times_by_sharers(run, "32/32", 32768, 128)
    assert set(curves) == {"plain", "cascade", "sdpa"} and len(curves["sdpa"]) == 4  # 256 sharers: no SDPA copy
    g = measured.growth(run, "32/8")
    assert len(g["plain"]) == 40 and len(g["cascade"]) == 32
    with pytest.raises(ValueError, match="timing"):
        measured.crossover(run, "32/8", 128, "slow")


# ---- the panels ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", ["scenario_panel", "crossover_panel", "batching_panel", "growth_panel", "forks_panel"])
def test_every_control_changes_the_figure(make):
    from workbench.ui import shared_prefix_panels as spp

    panel = getattr(spp, make)(requests=50) if make == "forks_panel" else getattr(spp, make)()
    for name, control in panel.controls.items():
        if control.disabled:
            continue
        if len(control_values(control)) < 2:
            continue
        before = panel.figure.to_json()
        control.value = next_value(control)
        assert panel.status.value == "", (name, panel.status.value)
        if name not in ("run",):  # one committed run of each kind: the same figure
            assert panel.figure.to_json() != before, name


# ---- what a user reads off the panels (issue 30, item 8) -------------------------------------------------------------
def _title_lines(text):
    import re

    return [re.sub(r"<[^>]+>", "", line) for line in text.split("<br>")]


def test_scenario_maps_say_what_they_leave_out_and_end_at_their_data():
    """08: with fork groups the title ran off the right edge; the maps showed 24 of 64 sequences without saying so, on
    an x axis to the pool's last block (4,095) while the rows shown end near 1,450; '1 heads'; 'all layers' one'."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    from workbench.ui import shared_prefix_panels as spp

    panel = spp.scenario_panel()
    c = panel.controls

    @settings(max_examples=12, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no slow shrink
    @given(st.sampled_from(c["prefix"].options), st.sampled_from(c["sharers"].options), st.sampled_from(
        c["suffix"].options), st.sampled_from(c["gqa"].options), st.sampled_from(c["groups"].options))
    def check(prefix, sharers, suffix, gqa, groups):
        panel.set(prefix=prefix, sharers=sharers, suffix=suffix, gqa=gqa, groups=groups)  # one redraw, not five
        assert panel.status.value == ""  # the figure is these values' (a failed redraw keeps the last one)
        fig, r = panel.figure, panel.compute()
        lay, maps = fig.layout, [d for d in fig.data if d.type == "heatmap"]
        assert all(len(line) <= 120 for line in _title_lines(lay.title.text)), lay.title.text  # wrapped, not cut
        assert lay.margin.t >= 20 * (lay.title.text.count("<br>") + 1)
        assert "all layers' one" not in lay.yaxis.title.text and "one layer" in lay.yaxis.title.text
        for path, row in (("plain", 2), ("shared", 3)):
            reads, heat = r[path], maps[row - 2]
            labels = list(getattr(lay, f"yaxis{row}").ticktext)
            assert len(labels) == len(reads) and not any(" 1 heads" in t for t in labels)  # every row labelled
            more = [p for p in reads if p["kind"] == "more"]
            title = fig.layout.annotations[row - 1].text
            if more:
                total = len(reads) - 1 + more[0]["programs"]
                assert f"{len(reads) - 1} of {total} shown" in title and labels[-1].startswith("+")
            else:
                assert "shown" not in title
            last = max(b for p in (*r["plain"], *r["shared"]) for b in p["blocks"])
            lo, hi = getattr(lay, f"xaxis{row}").range
            width = heat.x[1] - heat.x[0] if len(heat.x) > 1 else 1  # blocks a column (binned past 240 columns)
            at = last // width * width  # where the last block read is drawn
            assert lo < 0 <= at <= hi <= at + width and heat.x[-1] == at

    check()


def test_crossover_numbers_read_on_their_cells_and_picks_frame_them():
    """08: circles sat on the numbers, dark text on dark blue, and the blank one-sharer column was unexplained."""
    from workbench.figures import shared_prefix as spf
    from workbench.ui import shared_prefix_panels as spp

    panel = spp.crossover_panel()
    for gqa in panel.controls["gqa"].options:
        panel.controls["gqa"].value = gqa
        fig = panel.figure
        heat, text = fig.data[0], fig.data[1]
        assert heat.texttemplate is None and text.mode == "text"  # the numbers are a text trace of their own
        cells = dict(zip(zip(text.x, text.y, strict=True), zip(text.text, text.textfont.color, strict=True),
                         strict=True))
        for i, p in enumerate(heat.y):
            for j, s in enumerate(heat.x):
                z = heat.z[i][j]
                label, colour = cells[(s, p)]
                if z is None:
                    assert "no<br>sharing" == label  # one sharer shares nothing: said, not blank
                else:
                    depth = z / spf.ZMAX if z > 0 else z / spf.ZMIN
                    assert colour == ("white" if depth > 0.45 else "#222"), (p, s, z, colour)
        on_map = [d for d in fig.data if d.xaxis in (None, "x")]
        assert not any(getattr(d, "mode", None) == "markers" for d in on_map) and fig.layout.shapes  # frames
        for shape in fig.layout.shapes:
            assert shape.x1 - shape.x0 < 1 and shape.y1 - shape.y0 < 1  # inside its cell, around the number
    panel.reset()
