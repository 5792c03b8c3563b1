"""The studies of notebooks 07 and 08 (``workbench.studies.compress`` and ``shared_prefix``): every default
point runs, gives the columns it plots, in range and the same twice, and what it gives is what the package computes
the way the panel calls it (so the sweep and the panel cannot drift apart)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from workbench import sweeps
from workbench.studies import compress as cc
from workbench.studies import shared_prefix as csp
from workbench.sweeps import grid

NAMES = ("sparsification", "quest", "scenario", "forks")


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread, as the points run (and the panels' tests): the direct calls give the same bits."""


@pytest.fixture(scope="module")
def defaults():
    return {name: sweeps.get(name).point(**sweeps.get(name).defaults()) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_default_point_is_flat_complete_finite_and_deterministic(name, defaults):
    s = sweeps.get(name)
    row = defaults[name]
    assert s.notebook in ("07_compression", "08_shared_prefix") and s.panel.endswith("_panel")
    assert set(s.y) <= set(row) and not set(row) & {p.name for p in s.params}
    for k, v in row.items():
        assert isinstance(v, int | float | str | bool), (k, v)
        if isinstance(v, float):
            assert math.isfinite(v), (k, v)
    assert 4 <= len(grid.points(grid.check_values(s, {}))) <= 24  # the default sweep: a handful to ~20 points
    assert s.point(**s.defaults()) == row


def test_study_modules_import_no_ui_library_but_to_draw():
    """The core without UI libraries: a study module never imports ``workbench.ui`` or ipywidgets, and imports its
    figures (``workbench.figures``, so plotly) only inside its ``draw`` functions."""
    from workbench.sweeps import catalog

    for module in catalog.MODULES:
        tree = ast.parse(Path(module.__file__).read_text())
        every = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        every |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in every if m.startswith(("workbench.ui", "ipywidgets"))], module.__name__
        top = {n.module for n in tree.body if isinstance(n, ast.ImportFrom)}
        top |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        assert not [m for m in top if m.startswith(("workbench.figures", "plotly"))], module.__name__
        for f in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and not n.name.startswith("draw")):
            inner = {n.module for n in ast.walk(f) if isinstance(n, ast.ImportFrom)}
            assert not [m for m in inner if m.startswith(("workbench.figures", "plotly"))], (module.__name__, f.name)


# ---- notebook 07 -------------------------------------------------------------------------------------------------
def test_sparsification_row_is_the_study_score_of_the_panel_setting(defaults):
    from workbench.compress import sparsity_study
    from workbench.model import capture

    row = defaults["sparsification"]
    assert 0 <= row["error"] < 1 and 0 < row["memory"] <= 1 and 0 <= row["attention_read"] <= 1
    assert row["blocks_kept"] <= row["blocks_full"] and row["frees"]
    caps = capture.load()
    cap = caps[0]  # the panel's first prompt, its middle saved layer
    assert cap.name == "chat_question" and capture.SAVED_LAYERS[len(capture.SAVED_LAYERS) // 2] == 18
    want = sparsity_study.score_policies([cap], ["h2o"], [0.25], 16, ["keep"], held_out=8,
                                options={"h2o": {"sinks": 4, "window": 16}}, per_head=False)
    at = {r["layer"]: r for r in want}
    assert row["error"] == at["all"]["error"] and row["layer_error"] == at[18]["error"]
    assert (row["blocks_kept"], row["blocks_full"], row["tokens_kept"]) == (9, 10, at["all"]["tokens_kept"])
    _, bk = sparsity_study.kept_tokens(cap, "h2o", 0.25, 16, "keep", 4, 16)
    assert row["attention_read"] == float((cap.attn_last[18] * bk.mask).sum(-1).mean())
    point = sweeps.get("sparsification").point
    compact = point(**{**sweeps.get("sparsification").defaults(), "partial": "compact"})
    assert compact["blocks_kept"] == 3 and compact["error"] > row["error"]  # what the panel's test pins
    threshold = point(**{**sweeps.get("sparsification").defaults(), "policy": "threshold", "budget": 0.5})
    assert threshold["applied_budget"] == sparsity_study.threshold_of(0.5) == 0.05
    quest = point(**{**sweeps.get("sparsification").defaults(), "policy": "quest"})
    assert not quest["frees"] and quest["memory"] < 1


def test_compress_names_are_the_packages_and_the_moved_helpers_stay_importable():
    from workbench.compress import policies, sparsity_study
    from workbench.model import capture

    assert cc.POLICIES == tuple(n for n in policies.NAMES if n != "full")
    assert cc.PROMPTS == tuple(p.name for p in capture.PROMPTS)
    assert cc.SPARSIFICATION.param("layer").choices is capture.SAVED_LAYERS
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from workbench.ui import compress_panels as cp

    p = cp.sparsification_panel()
    assert list(p.controls) == list(cc.SPARSIFICATION.controls) and cp.SHOWN_POLICIES is cc.POLICIES
    assert [o[1] for o in p.controls["budget"].options] == list(cc.BUDGETS)
    for name in ("score_rows", "policy_options", "threshold_of", "kept_tokens", "HELD_OUT", "THRESHOLD_SCALE"):
        assert getattr(cp, name) is getattr(sparsity_study, name), name


def test_sparsification_panel_shows_the_sweeps_point():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from workbench.ui import compress_panels as cp

    s = sweeps.get("sparsification")
    p = cp.sparsification_panel()
    for change in ({}, {"policy": "snapkv", "partial": "compact", "layer": 6}, {"policy": "quest", "budget": 0.1}):
        for name, value in change.items():
            p.controls[name].value = value
        r, row = p.compute(), s.point(**p.values())
        assert (r["current"]["error"], r["current"]["blocks_kept"]) == (row["error"], row["blocks_kept"])
        assert r["setup"]["map_title"].endswith(f"{row['attention_read']:.0%} of it read")


def test_quest_row_is_the_recall_and_the_speedups_the_panel_shows(defaults):
    from workbench.compress import recall_study
    from workbench.model import capture
    from workbench.results import compress as measured

    row = defaults["quest"]
    for k in ("recall", "recall_per_head", "recall_oracle", "read"):
        assert 0 < row[k] <= 1, k
    assert row["recall"] <= row["recall_oracle"] + 1e-9 and row["speedup_graph"] > 0
    (want,) = recall_study.quest_recall_curves(capture.load(), (16,), (0.2,))
    assert {k: row[k] for k in ("recall", "recall_per_head", "recall_oracle", "pages", "read", "samples")} == \
        {k: want[k] for k in ("recall", "recall_per_head", "recall_oracle", "pages", "read", "samples")}
    newest = measured.runs("quest")[-1]
    assert row["run_name"] == measured.run_name(newest) and row["timed_page_size"] == 16
    speed = measured.quest_speedups(newest, 8, 16)
    assert row["best_speedup_graph"] == max(r["speedup_graph"] for r in speed)
    assert row["timed_share"] in {r["share"] for r in speed}
    assert row["speedup_graph"] == next(r for r in speed if r["share"] == row["timed_share"])["speedup_graph"]
    # 8-token pages were not timed: the panel draws the nearest timed size, and says so in its title
    point = sweeps.get("quest").point(page_size=8, share=0.2, batch=8, quest_run=row["run_name"])
    assert point["timed_page_size"] == 16 and point["best_speedup_graph"] == row["best_speedup_graph"]
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    pytest.importorskip("anywidget")
    from workbench.ui import compress_panels as cp

    recall = recall_study.quest_recall_curves(capture.load(), (8, 16), (0.2,))
    assert point["recall"] == recall[0]["recall"] and recall[1] == want
    r = cp.quest_panel(runs=[newest], recall=recall, page_size=8, share=0.2).compute()
    assert [x["speedup_graph"] for x in r["speedups"][row["run_name"]]] == [x["speedup_graph"] for x in speed]
    assert r["setup"]["speed_title"].endswith(f"pages of 16 (8 not timed): up to {point['best_speedup_graph']:.2f}x")
    with pytest.raises(ValueError, match="quest_run: expected latest or one of"):
        sweeps.get("quest").point(page_size=16, share=0.2, batch=8, quest_run="nope.json")


# ---- notebook 08 -------------------------------------------------------------------------------------------------
def test_scenario_row_is_the_study_scenario_the_panel_builds(defaults):
    from workbench.shared_prefix import scenarios
    from workbench.shared_prefix.decode import cost_model

    row = defaults["scenario"]
    assert row["plain_mb"] > row["cascade_mb"] > 0 and row["predicted_speedup"] > 0 and row["plain_us"] > 0
    sc = scenarios.scenario(1024, 8, 128, num_q_heads=32, num_kv_heads=8, rows_per_tile=64, groups=1, fork=0,
                        model=cost_model("NVIDIA H200", "graph"))
    assert (row["path"], row["predicted_speedup"]) == (sc.choice.path, sc.speedup)
    assert (row["plain_mb"], row["cascade_mb"]) == (sc.choice.bytes["plain"] / 1e6, sc.choice.bytes["cascade"] / 1e6)
    assert row["block_reads_plain"] == sum(len(p["blocks"]) for p in scenarios.program_reads(sc, "plain", 1000))
    big = sweeps.get("scenario").point(**{**sweeps.get("scenario").defaults(), "prefix": 32768, "sharers": 64,
                                          "groups": 8})
    assert big["cascade_chosen"] and big["predicted_speedup"] > 1 and big["fork_groups"] == 8
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    pytest.importorskip("anywidget")
    from workbench.ui import shared_prefix_panels as spp

    p = spp.scenario_panel(prefix=32768, sharers=64)
    assert list(p.controls) == list(csp.SCENARIO.controls)
    assert p.controls["prefix"].options == csp.PREFIXES and p.controls["sharers"].options == csp.SHARERS
    for name, value in (("groups", 8), ("timing", "eager")):
        p.controls[name].value = value
    got = p.compute()["sc"]
    eager = sweeps.get("scenario").point(**{**sweeps.get("scenario").defaults(), "prefix": 32768, "sharers": 64,
                                            "groups": 8, "timing": "eager"})
    assert (eager["path"], eager["predicted_speedup"], eager["cascade_mb"]) == \
        (got.choice.path, got.speedup, got.choice.bytes["cascade"] / 1e6)
    assert eager["programs_cascade"] >= sum(1 for x in p.compute()["shared"] if x["kind"] != "more")


def test_forks_row_is_the_lifetime_saving_of_a_panel_bar(defaults):
    from workbench.sim import forks

    row = defaults["forks"]
    assert 0 < row["saving_pct"] < 100 and row["paper_low_pct"] < row["paper_high_pct"]
    assert row["saving_pct"] == 100 * forks.lifetime_saving("alpaca", "parallel", 2, p_top=0.25, requests=200)
    assert csp.FORKS.param("n").choices is forks.WIDTHS and csp.FORKS.param("p_top").default == forks.DEFAULT_P_TOP
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    pytest.importorskip("anywidget")
    from workbench.ui import shared_prefix_panels as spp

    p = spp.forks_panel(requests=20)
    assert tuple(p.controls["p_top"].options) == csp.P_TOPS and p.controls["p_top"].value == forks.DEFAULT_P_TOP
    bars = {r["n"]: r["saving_pct"] for r in p.compute()["rows"]}  # as built: alpaca, parallel sampling
    point = sweeps.get("forks").point
    assert bars == {n: point(trace="alpaca", mode="parallel", p_top=0.25, n=n, requests=20)["saving_pct"]
                    for n in forks.WIDTHS}


def test_runner_runs_a_small_forks_grid_and_resumes(tmp_path):
    values = {"trace": ["alpaca"], "mode": ["parallel", "beam"], "n": [2], "requests": [50]}
    run = sweeps.run("forks", values, out=tmp_path, progress=False)
    assert (run.ran, run.reused, run.failed) == (2, 0, [])
    assert [r["mode"] for r in run.rows] == ["parallel", "beam"] and all(r["requests"] == 50 for r in run.rows)
    assert run.rows[1]["saving_pct"] > run.rows[0]["saving_pct"]  # beams share far more than samples
    assert run.json_path.exists() and run.csv_path.exists()
    loaded = sweeps.load(run.json_path)
    assert loaded.sweep == "forks" and [r["saving_pct"] for r in loaded.rows] == [r["saving_pct"] for r in run.rows]
    again = sweeps.run("forks", values, out=tmp_path, progress=False)
    assert (again.ran, again.reused) == (0, 2)
