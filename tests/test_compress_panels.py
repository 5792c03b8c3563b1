"""Notebook 07's data and panels: the loaders of the committed compression runs (``workbench.results.compress``)
checked against the files themselves, then the panels and figures headless (``workbench.ui.compress_panels``,
``compress_figures``): they build, every control changes the figure and redraws fast, greyed-out controls change
nothing, and what they show is what the package computes.
"""

import importlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import pytest
from panel_controls import control_values, next_value

from workbench.compress import recall_study, sparsity_study
from workbench.results import compress as measured

RESULTS = Path(__file__).resolve().parents[1] / "data" / "results"
MODEL = "compression-model-cpu-x86_64-20261201T234402.json"
DELTA = "compression-delta-cpu-x86_64-20261201T234848.json"
PROMPTS = ["chat_question", "code", "prose", "numbers", "chat_instructions"]


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


def raw(name):
    return json.loads((RESULTS / name).read_text())


@pytest.fixture(scope="module")
def runs():
    quest = measured.runs("quest")  # the H200 runs: newer ones replace older ones, so no file name is assumed
    assert quest, "no committed quest-h200-*.json run in data/results"
    return {"model": measured.latest("model"), "delta": measured.latest("delta"), "quest": quest}


# ---- the loaders, against the committed files ----------------------------------------------------------------------
def test_runs_pick_the_committed_files_and_leave_quick_runs_out(runs, tmp_path):
    assert measured.run_name(runs["model"]) == MODEL and measured.run_name(runs["delta"]) == DELTA
    names = [measured.run_name(r) for r in runs["quest"]]
    assert all(n.startswith("quest-h200-") for n in names) and measured.run_name(measured.latest("quest")) == names[-1]
    assert all(r["info"]["gpu"] == "NVIDIA H200" and r["info"]["mode"] == "full" for r in runs["quest"])
    assert measured.latest("quest", tmp_path) is None and measured.runs("model", tmp_path) == []
    shutil.copy(RESULTS / MODEL, tmp_path / MODEL)
    other = MODEL.replace("2026", "2027")
    (tmp_path / other).write_text(json.dumps({**raw(MODEL), "mode": "smoke"}))
    assert [measured.run_name(r) for r in measured.runs("model", tmp_path)] == [MODEL]
    assert len(measured.runs("model", tmp_path, where={})) == 2


def test_loaders_import_without_plotly_or_widgets(monkeypatch):
    """The GPU image has no plotly: the loaders must not need it (test_packaging walks every module the same way)."""
    for name in ("plotly", "ipywidgets", "anywidget"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    monkeypatch.delitem(sys.modules, "workbench.results.compress")
    fresh = importlib.import_module("workbench.results.compress")
    assert fresh is not measured and fresh.run_name(fresh.latest("delta")) == DELTA


def test_model_rows_are_the_files_summary_and_rows(runs):
    run, doc = runs["model"], raw(MODEL)
    assert measured.model_prompts(run) == PROMPTS
    mean = measured.model_rows(run)
    assert [(r["policy"], r["budget"], r["partial"]) for r in mean] == \
        [(r["policy"], r["budget"], r["partial"]) for r in doc["summary"]]
    assert mean[0]["policy"] == "full" and mean[0]["perplexity"] == mean[0]["ref_perplexity"]
    snap = next(r for r in mean if (r["policy"], r["budget"], r["partial"]) == ("snapkv", 0.5, "compact"))
    assert (round(snap["agreement"], 3), round(snap["memory_kept"], 3), round(snap["perplexity"], 2)) == \
        (0.877, 0.505, 2.89)
    code = measured.model_rows(run, "code")
    want = [r for r in doc["rows"] if r["prompt"] == "code"]
    assert len(code) == len(want) == 23 and code[1]["kept_share"] == want[1]["kept_tokens"] / want[1]["prompt_tokens"]
    curves = measured.model_curves(mean)
    assert len(curves) == 8 and ("full", "-") not in curves
    assert all([r["memory_kept"] for r in c] == sorted(r["memory_kept"] for r in c) for c in curves.values())


def test_delta_ratios_are_bytes_weighted_over_the_files_rows(runs):
    run, doc = runs["delta"], raw(DELTA)
    assert measured.delta_layers(run) == [0, 6, 12, 18, 24, 29] and measured.delta_prompts(run) == PROMPTS
    rows = [r for r in doc["rows"] if r["section"] == "ratio" and r["dtype"] == "fp16" and r["config"] == "shuffle"]
    by_layer = measured.ratio_by_layer(run, "fp16", "shuffle")
    for layer in (0, 18):
        for kind in measured.KINDS:
            rs = [r for r in rows if r["layer"] == layer and r["kind"] == kind]
            got = by_layer[layer][kind]
            assert got["n"] == 5 and got["ratio"] == pytest.approx(sum(r["raw_bytes"] for r in rs) /
                                                                  sum(r["bytes"] for r in rs))
    # the study's own choice of the best stages per kind is what the summary computes
    summary = {(r["config"], r["kind"]): r["ratio"] for r in measured.ratio_summary(run, "fp16", ["shuffle"])}
    for kind in measured.KINDS:
        config, ratio = doc["choice"]["best_per_kind"][f"fp16/{kind}"]
        assert config == "shuffle" and summary[("shuffle", kind)] == pytest.approx(ratio)
    by_prompt = measured.ratio_by_prompt(run, 0, "fp16", "shuffle")
    assert list(by_prompt) == PROMPTS and by_prompt["code"]["k"]["ratio"] == next(
        r["ratio"] for r in rows if r["layer"] == 0 and r["prompt"] == "code" and r["kind"] == "k")
    int8 = next(r for r in measured.quant_summary(run) if r["scheme"] == "int8/token" and r["kind"] == "k")
    assert round(int8["ratio"], 2) == 2.4 and int8["plain_ratio"] == pytest.approx(32 / 17)


def test_break_even_folds_the_files_rows_like_its_verdicts(runs):
    run, doc = runs["delta"], raw(DELTA)
    assert list(measured.delta_chunks(run)) == ["block16/1layer", "block16/30layers", "seq/30layers"]
    verdicts = [v for v in doc["verdicts"] if v["config"] == "delta+shuffle" and v["level"] == 3]
    for chunk in measured.delta_chunks(run):
        got = {r["link"]: r for r in measured.break_even(run, chunk)}
        assert list(got) == list(measured.links(run))
        for v in (v for v in verdicts if v["chunk"] == chunk):
            r = got[v["link"]]
            for key in ("needed_serial", "needed_overlap"):
                assert r[key] == (math.inf if v[key] is None else v[key])
            assert r["wins"] is v["wins"] is False and r["cpu_gbps"] == v["cpu_gbps"]
    assert measured.break_even(run, "block16/30layers", config="zstd") == []  # the study left zstd out
    assert got["disk_write"]["link_gbps"] == 1.19


def test_quest_speedups_and_recall_are_the_files(runs):
    for run in runs["quest"]:
        doc = raw(measured.run_name(run))
        timing = [r for r in doc["rows"] if r["section"] == "timing"]
        assert measured.quest_batches(run) == sorted({r["batch"] for r in timing}, reverse=True)
        assert 16 in measured.quest_page_sizes(run)
        for batch in measured.quest_batches(run):
            for ps in measured.quest_page_sizes(run):
                rows = measured.quest_speedups(run, batch, ps)
                mine = [r for r in timing if r["batch"] == batch and r.get("page_size", 16) == ps]
                want = sorted((r for r in mine if r["impl"] == "quest"), key=lambda r: r["budget_tokens"])
                assert [r["budget_tokens"] for r in rows] == [r["budget_tokens"] for r in want]
                assert [(r["speedup"], r["speedup_graph"]) for r in rows] == \
                    [(r["speedup"], r["speedup_graph"]) for r in want]
                full = next(r for r in mine if r["impl"] == "full")
                assert all(r["full_us_graph"] == full["time_us_graph"] and r["page_size"] == ps for r in rows)
                assert all(r["share"] == r["budget_tokens"] / r["context"] for r in rows)
                assert all(set(r["parts"]) == set(measured.QUEST_PARTS) for r in rows)
        recall = measured.quest_recall_real(run)
        want = sorted((r for r in doc["rows"] if r["section"] == "recall_real" and r["reduce"] == "sum"),
                      key=lambda r: r["budget_pages"])
        assert [r["recall"] for r in recall] == [r["recall"] for r in want]
    # the recall measured with the H200 run is on this repository's captures: 3 pages of 16 hold 0.671
    first = next(measured.quest_recall_real(r) for r in runs["quest"] if measured.quest_recall_real(r))
    assert [r["budget_pages"] for r in first] == [3, 4, 6, 8] and round(first[0]["recall"], 3) == 0.671
    # on the H200, batch 8: Quest's CUDA graph beats full decode at every budget
    assert all(r["speedup_graph"] > 2 for r in measured.quest_speedups(runs["quest"][-1], 8))


@pytest.mark.parametrize("call, argument", [
    (lambda r: measured.runs("tiers"), "kind"),
    (lambda r: measured.model_rows(r["model"], "poem"), "prompt"),
    (lambda r: measured.ratio_by_layer(r["delta"], "fp8"), "dtype"),
    (lambda r: measured.ratio_by_layer(r["delta"], "fp16", "gzip"), "config"),
    (lambda r: measured.ratio_by_prompt(r["delta"], 3), "layer"),
    (lambda r: measured.break_even(r["delta"], "block64"), "chunk"),
    (lambda r: measured.break_even(r["delta"], "seq/30layers", mode="twice"), "mode"),
    (lambda r: measured.quest_speedups(r["quest"][-1], 4), "batch"),
    (lambda r: measured.quest_speedups(r["quest"][-1], 8, 12), "page_size"),
])
def test_bad_arguments_name_the_argument(runs, call, argument):
    with pytest.raises(ValueError, match=argument):
        call(runs)


# ---- panels and figures, headless ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ui():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    pytest.importorskip("anywidget")
    from workbench.ui import compress_panels
    from workbench.ui.plot_view import figure_json

    return compress_panels, figure_json


@pytest.fixture(scope="module")
def captures():
    from workbench.model import capture

    caps = capture.load()
    return [caps[0], caps[2]]  # chat_question (151 tokens) and prose (185): the panels' costs scale with the length


@pytest.fixture(scope="module")
def panels(ui, captures, runs):
    cp, _ = ui
    recall = recall_study.quest_recall_curves(captures, page_sizes=(8, 16), shares=(0.1, 0.2, 0.3))
    return {"sparsification": cp.sparsification_panel(captures),
            "quest": cp.quest_panel(runs=runs["quest"], recall=recall, share=0.2),
            "model": cp.model_panel(runs["model"]), "delta": cp.delta_panel(runs["delta"])}


def _shown(panel, figure_json):
    return json.dumps(figure_json(panel.figure), sort_keys=True)


@pytest.mark.parametrize("name", ["sparsification", "quest", "model", "delta"])
def test_every_control_changes_the_figure_and_redraws_fast(ui, panels, name):
    _, figure_json = ui
    panel = panels[name]
    assert len(panel.controls) <= 8
    for key, control in panel.controls.items():
        if control.disabled:
            continue
        first = control.value
        value = next_value(control) if "Slider" in type(control).__name__ else next(
            v for v in control_values(control) if v != first)
        before = _shown(panel, figure_json)
        start = time.perf_counter()
        control.value = value
        took = time.perf_counter() - start
        assert panel.status.value == "", (key, value, panel.status.value)
        assert _shown(panel, figure_json) != before, f"{name}: {key} -> {value!r} changed nothing"
        assert panel.view.figure == figure_json(panel.figure)  # the page gets the whole new figure
        assert took < 2.0, f"{name}: {key} -> {value!r} took {took:.2f} s"
        control.value = first
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.plotly.v1+json" in bundle and "run the notebook" in bundle["text/plain"]


def test_sparsification_panel_greys_out_what_does_not_apply_and_it_changes_nothing(ui, panels):
    _, figure_json = ui
    p = panels["sparsification"]
    c = p.controls
    assert list(c) == ["policy", "budget", "window", "sinks", "block_size", "partial", "prompt", "layer"]
    assert [v for v in control_values(c["policy"])] == ["streaming", "h2o", "snapkv", "threshold", "quest"]
    assert "threshold" in c["budget"].description  # its budget is the threshold: the label says so
    for policy, grey in [("h2o", []), ("snapkv", []), ("threshold", []), ("streaming", ["window"]),
                         ("quest", ["window", "sinks"])]:
        c["policy"].value = policy
        assert [k for k, w in c.items() if w.disabled] == grey, policy
        for key in grey:  # a greyed-out control changes nothing (set from Python all the same)
            before = _shown(p, figure_json)
            old = c[key].value
            c[key].value = next_value(c[key])
            assert _shown(p, figure_json) == before, (policy, key)
            c[key].value = old
    c["policy"].value = "h2o"


def test_sparsification_panel_shows_what_the_study_computes(ui, panels, captures):
    cp, _ = ui
    p = panels["sparsification"]
    assert (p.controls["policy"].value, p.controls["budget"].value, p.controls["partial"].value) == \
        ("h2o", 0.25, "keep")
    whole = p.compute()["current"]
    p.controls["partial"].value = "compact"
    r = p.compute()
    want = sparsity_study.score_policies([captures[0]], ["h2o"], [0.25], 16, ["compact"], held_out=8,
                                options={"h2o": {"sinks": 4, "window": 16}})[-1]
    assert want["layer"] == "all" and r["current"]["error"] == want["error"]
    assert r["current"]["blocks_kept"] == want["blocks_kept"] == 3 and want["blocks_full"] == 10
    keep, bk = cp.kept_tokens(captures[0], "h2o", 0.25, 16, "compact", 4, 16)
    assert bk.blocks == want["blocks_kept"] and int(keep.sum()) == want["tokens_kept"]
    assert r["states"] == [2 if k else 0 for k in keep.tolist()] and len(r["attention"]) == 9
    assert set(r["curves"]) == set(cp.SHOWN_POLICIES)
    assert [x["slider_budget"] for x in r["curves"]["snapkv"]] == list(cp.CURVE_BUDGETS)
    assert [x["budget"] for x in r["curves"]["threshold"]] == [cp.threshold_of(b) for b in cp.CURVE_BUDGETS]
    assert not any(x["frees"] for x in r["curves"]["quest"]) and all(x["frees"] for x in r["curves"]["h2o"])
    fig = p.figure
    ring = next(t for t in fig.data if t.name == "this setting")
    assert (ring.x[0], ring.y[0]) == (0.3, want["error"])
    assert "holds 3 of 10 blocks of 16, error 0.214" in fig.layout.title.text.replace("<br>", " ")  # wrapped title
    assert len(fig.layout.shapes) > 0  # the tokens no longer read, washed out on the map
    # kept whole, the same chosen tokens hold 9 of the 10 blocks: the study's "keep" rule
    kept = sparsity_study.score_policies([captures[0]], ["h2o"], [0.25], 16, ["keep"], held_out=8,
                                         options={"h2o": {"sinks": 4, "window": 16}})[-1]["blocks_kept"]
    assert whole["blocks_kept"] == kept
    assert whole["blocks_kept"] == 9 and whole["error"] < r["current"]["error"]
    p.controls["partial"].value = "keep"


def test_quest_recall_is_quest_recall_over_the_keys_before_the_queries(ui, captures):
    from workbench.compress.page_selection import quest_recall

    cp, _ = ui
    cap = captures[0]
    (row,) = recall_study.quest_recall_curves([cap], page_sizes=(16,), shares=(0.3,))
    n = cap.k.shape[1] - 16  # 135 keys, 9 pages: 30% -> 3 pages
    assert row["pages"] == 3 and row["read"] == pytest.approx((2 * 16 + n - 8 * 16) / n)
    got = [float(quest_recall(cap.q_last[i], cap.k[i, :n], 16, 3, sm_scale=cap.sm_scale).shared.mean())
           for i in range(6)]
    assert row["recall"] == pytest.approx(sum(got) / 6) and row["samples"] == 6


def test_quest_panel_draws_the_measured_speedups_of_the_nearest_timed_page_size(panels, runs):
    p = panels["quest"]
    newest = runs["quest"][-1]
    assert p.controls["run"].value == measured.run_name(newest) and p.controls["batch"].value == 8
    for page_size in (16, 8):  # 8-token pages were not timed: the nearest timed size (16) is drawn
        p.controls["page_size"].value = page_size
        lines = {t.name: list(t.y) for t in p.figure.data if t.name and t.name.startswith("H200, ")}
        want = measured.quest_speedups(newest, 8, 16)
        assert lines["H200, CUDA graph"] == [r["speedup_graph"] for r in want]
        assert lines["H200, eager"] == [r["speedup"] for r in want]
        best = max(r["speedup_graph"] for r in want)
        assert f"pages of 16{' (8 not timed)' if page_size == 8 else ''}: up to {best:.2f}x" in \
            p.figure.layout.annotations[1].text
    p.controls["page_size"].value = 16


def test_delta_panel_computes_zstd_break_even_as_the_study_does(ui, panels, runs):
    from workbench.bench.compression_delta import measured_links
    from workbench.compress import delta_study

    p = panels["delta"]
    r = p.compute()
    assert r["break_even"] == measured.break_even(runs["delta"], "block16/30layers")
    # the live path, on a stage combination the study did compute, gives the study's rows
    live = measured.fold_break_even(delta_study.break_even_rows(
        measured.throughput(runs["delta"], "block16/30layers", "fp16", "delta+shuffle"), links=measured_links(),
        config="delta+shuffle", level=3))
    for a, b in zip(live, r["break_even"], strict=True):
        assert a["link"] == b["link"] and a["needed_serial"] == pytest.approx(b["needed_serial"], rel=1e-3)
    p.controls["stages"].value = "zstd"
    z = p.compute()
    assert len(z["break_even"]) == 6 and not any(x["wins"] for x in z["break_even"])
    assert "computed here" in p.figure.layout.title.text
    p.controls["stages"].value = "delta+shuffle"


def test_model_panel_filters_by_partial_and_prompt(panels, runs):
    p = panels["model"]
    assert len(p.compute()["curves"]) == 8
    p.controls["partial"].value = "keep"
    assert {k[1] for k in p.compute()["curves"]} == {"keep"}
    p.controls["prompt"].value = "code"
    r = p.compute()
    assert r["full"]["perplexity"] == measured.model_rows(runs["model"], "code")[0]["perplexity"]
    p.controls["partial"].value, p.controls["prompt"].value = "both", ""


def test_figure_helpers(ui):
    from workbench.figures import compress as cf

    assert cf._runs([True, True, False, True]) == [(0, 1), (3, 3)] and cf._runs([False]) == []
    assert cf.stage_words("shuffle") == "byte shuffle + zstd"
