"""Notebook 09's figures, loader and panels: the conformance figures on made-up report rows, the loader of the
committed ``bench decode --impl`` runs on a fixture (``tests/fixtures/byok-decode-fake-*.json``, never a
measurement), and the panels headless (every control changes the figure; reports are cached per implementation and
level). The panels check fast pure-torch implementations, so no Triton kernel runs here."""

import json
import math
from pathlib import Path

import pytest
from panel_controls import control_values, next_value

from workbench import conformance
from workbench.conformance.builtin import reference_decode
from workbench.results import byok

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _row(i, passed=True, error=1e-4, tol=1e-2, reason="", **kw):
    row = {"case": f"decode/nhd/bs16/d64/hkv2/g4/fp16/lens=37,0,1,150/pad0/seed{i}", "passed": passed,
           "error": error, "tol": tol, "reason": reason, "seconds": 0.01, "layout": "nhd", "block_size": 16,
           "head_dim": 64, "num_kv_heads": 2, "group": 4, "kv_format": "fp16", "lens": [37, 0, 1, 150], "pad": 0,
           "seed": i, "shared": 0}
    row.update(kw)
    return row


ROWS = [_row(1), _row(2, kv_format="fp32", tol=1e-4, error=2e-7, block_size=1),
        _row(3, passed=False, error=0.9, reason="relative error 9.0e-01 > 1e-02; worst at sequence 3",
             kv_format="bf16"),
        _row(4, passed=False, error=math.inf, reason="non-finite output at [0, 0, 0]", block_size=128),
        _row(5, passed=False, error=None, reason="raised RuntimeError: boom", kv_format="fp32", tol=1e-4),
        _row(6, error=0.0, lens=[32, 16], layout="hnd")]


# ---- the figures ---------------------------------------------------------------------------------------------------
def test_error_figure_draws_every_case_against_its_tolerance():
    from workbench.figures import conformance as cf

    fig = cf.error_figure(ROWS, "kv_format", "t")
    by_name = {t.name: t for t in fig.data}
    assert len(by_name["tolerance"].x) == len(ROWS) and list(by_name["tolerance"].y) == [r["tol"] for r in ROWS]
    assert len(by_name["passed"].x) == 3 and len(by_name["failed: over tolerance"].x) == 1
    nofinite = next(t for n, t in by_name.items() if n.startswith("failed: no finite"))
    assert len(nofinite.x) == 2 and len(set(nofinite.y)) == 1  # NaN output and raised: both on the top line
    assert nofinite.y[0] > max(r["error"] for r in ROWS if r["error"] is not None and math.isfinite(r["error"]))
    assert min(by_name["passed"].y) > 0  # an error of exactly 0 sits on the floor of the log axis
    assert fig.layout.yaxis.type == "log"
    assert any("raised RuntimeError: boom" in h and "seed5" in h for h in nofinite.hovertext)
    # grouped by format in the suite's order, each tick saying how many failed
    assert list(fig.layout.xaxis.ticktext) == ["fp16<br>1/3 failed", "bf16<br>1/1 failed", "fp32<br>1/2 failed"]
    xs = dict(zip(by_name["tolerance"].x, [r["kv_format"] for r in ROWS], strict=True))
    assert max(x for x, f in xs.items() if f == "fp16") < min(x for x, f in xs.items() if f == "bf16")


@pytest.mark.parametrize("key", ["block_size", "layout", "head_dim", "group", "lens", "pad"])
def test_error_figure_groups_by_any_axis(key):
    from workbench.figures import conformance as cf

    fig = cf.error_figure(ROWS, key)
    counts = cf.failure_counts(ROWS, key)
    assert len(fig.layout.xaxis.ticktext) == len(counts)
    assert sum(n for _, n in counts.values()) == len(ROWS) and sum(b for b, _ in counts.values()) == 3
    if key == "block_size":
        assert list(counts) == [1, 16, 128]


def test_error_figure_refuses_an_unknown_axis():
    from workbench.figures import conformance as cf

    with pytest.raises(ValueError, match="color_by"):
        cf.error_figure(ROWS, "colour")


def test_conformance_figure_adds_the_failures_table_only_when_a_case_failed():
    import plotly.graph_objects as go

    from workbench.figures import conformance as cf

    fig = cf.conformance_figure(ROWS, "kv_format", "t")
    tables = [t for t in fig.data if isinstance(t, go.Table)]
    assert len(tables) == 1
    cases = tables[0].cells.values[0]
    assert len(cases) == 3 and all("<br>" in c or len(c) <= 44 for c in cases)  # long ids broken at slashes
    assert [c.replace("<br>", "") for c in cases] == [r["case"] for r in ROWS if not r["passed"]]
    assert list(tables[0].cells.values[1]) == ["9.00e-01", "inf", "raised"]
    ok = cf.conformance_figure([r for r in ROWS if r["passed"]], "kv_format", "t")
    assert not any(isinstance(t, go.Table) for t in ok.data)
    assert any("all 3 cases passed" in a.text for a in ok.layout.annotations)
    many = [_row(i, passed=False, error=1.0, reason="bad") for i in range(12)]
    rows = cf.failure_rows(many, limit=8)
    assert len(rows) == 9 and rows[-1]["case"] == "... and 4 more"


def test_replay_lines_name_the_case_and_how_a_shell_finds_the_impl():
    from workbench.figures import conformance as cf

    lines = cf.replay_lines("mine", ROWS[2])
    assert any(ROWS[2]["case"] in ln and "conformance.replay('mine'" in ln for ln in lines)
    assert any("--load" in ln for ln in lines)
    assert not any("--load" in ln for ln in cf.replay_lines("starter", ROWS[2]))


# ---- the loader, on the fixture ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run():
    found = byok.runs(FIXTURES)
    assert [byok.run_name(r) for r in found] == ["byok-decode-fake-20000101T000000.json"]
    return found[0]


def test_no_run_says_how_to_make_one(tmp_path):
    assert byok.runs(tmp_path) == []
    assert byok.describe([]) == byok.NO_RUNS and "bench decode --impl" in byok.NO_RUNS


def test_bandwidth_names_every_row_without_a_bar(run):
    bw = byok.bandwidth(run, "eager")
    assert list(bw.workloads) == ["W1", "W2", "W3", "W4", "W5"] and bw.copy_gbps == 4000.0
    assert bw.impls[:3] == ["ours", "mine", "starter"]  # ours, yours, the starter, then the peers
    assert set(bw.absent) == {"flashinfer", "vllm_triton"}
    assert not any(b["impl"] in bw.absent for b in bw.bars)
    assert {(i, w, s) for i, w, s, _ in bw.failed} == {("mine", "W4", "check_failed"), ("flex_paged", "W4", "error")}
    assert next(why for i, _, _, why in bw.failed if i == "mine") == "rel err 0.31"
    assert bw.untimed == []
    assert all(b["frac"] > 0 for b in bw.bars)
    # the sweep rows (W1 by layout and page size) are another section
    assert len(bw.bars) == 5 * 6 - 2 and bw.value("ours", "W1")["frac"] == 0.95
    graph = byok.bandwidth(run, "graph")
    assert graph.untimed == [("gather_sdpa", "W2")] and graph.value("gather_sdpa", "W2") is None
    assert graph.value("ours", "W1")["frac"] == pytest.approx(0.95 / 0.9)
    rel = byok.relative_to_ours(bw, "W2")
    assert rel["ours"] == 1.0 and rel["starter"] == pytest.approx(0.08 / 0.90)
    assert "FAKE-GPU" in byok.describe([run]) and "flashinfer" in byok.describe([run])
    with pytest.raises(ValueError, match="timing"):
        byok.bandwidth(run, "slow")


def test_check_reports_read_the_files_the_cli_writes(tmp_path):
    rows = [_row(1), _row(2, passed=False, error=1.0, reason="bad")]
    doc = {"meta": {"gpu": "FAKE-GPU", "date": "2000-01-01T00:00:00Z"}, "impl": "broken_gqa", "op": "decode",
           "backend": "compiled (FAKE-GPU)", "seconds": 1.5, "passed": False, "cases": rows}
    (tmp_path / "byok-check-broken_gqa-decode-pairwise-fake-20000101.json").write_text(json.dumps(doc))
    (tmp_path / "byok-check-ours-decode-pairwise-warm-fake-20000101.json").write_text(
        json.dumps({**doc, "impl": "ours", "passed": True, "cases": rows[:1]}))
    (tmp_path / "byok-check-unparsable.json").write_text("{}")
    got = {(r["impl"], r["tag"]): r for r in byok.check_reports(tmp_path)}
    assert set(got) == {("broken_gqa", ""), ("ours", "warm")}
    r = got[("broken_gqa", "")]
    assert (r["op"], r["level"], r["cases"], r["failed"], r["passed"]) == ("decode", "pairwise", 2, 1, False)
    assert got[("ours", "warm")]["passed"]
    assert r["commit"] == "" and byok.provenance(r) == "FAKE-GPU (compiled), 2000-01-01"
    assert byok.provenance({**r, "commit": "abc1234"}) == "FAKE-GPU (compiled), commit abc1234, 2000-01-01"


def _report(impl, op="decode", level="pairwise", tag="", rows=(), name=None):
    rows = list(rows)
    return {"path": Path(name or f"byok-check-{impl}-{op}-{level}{'-' + tag if tag else ''}-fake-20000101.json"),
            "impl": impl, "op": op, "level": level, "tag": tag, "backend": "compiled (FAKE-GPU)", "seconds": 1.25,
            "cases": len(rows), "failed": sum(not r["passed"] for r in rows),
            "passed": all(r["passed"] for r in rows), "gpu": "NVIDIA FAKE", "commit": "abc1234",
            "date": "2000-01-01T00:00:00Z", "rows": rows}


EXACT = [_row(i, error=0.0, tol=0.0, case=f"write/nhd/bs16/d64/hkv1/g1/fp16/lens=0/pad0/seed{i}") for i in (1, 2)]
COMMITTED = [_report("ours", "write", "full", rows=EXACT), _report("ours", rows=ROWS[:2], tag="cold"),
             _report("broken_gqa", rows=ROWS), _report("ours", rows=ROWS[:2], tag="warm"),
             _report("starter", rows=ROWS[:2]), _report("empty", rows=[])]


def test_report_choices_list_decode_first_starter_broken_then_ours():
    choices = byok.report_choices(COMMITTED)
    # decode first (the starter, its broken versions, ours warm then cold), then the write op; none without rows
    assert [v for _, v in choices] == [COMMITTED[i]["path"].name for i in (4, 2, 3, 1, 0)]
    assert choices[1][0] == "FAKE: broken_gqa decode, pairwise: 6 cases, 3 failed"
    assert choices[2][0] == "FAKE: ours decode, pairwise (warm): 2 cases, all passed"
    assert [v for _, v in byok.report_choices(COMMITTED, ops=("write",))] == [COMMITTED[0]["path"].name]
    assert byok.find_report(COMMITTED, choices[1][1])["impl"] == "broken_gqa"
    with pytest.raises(KeyError, match="no committed report"):
        byok.find_report(COMMITTED, "byok-check-nothing.json")


def test_committed_title_and_replay_say_where_it_was_measured():
    from workbench.figures import conformance as cf

    r = COMMITTED[2]
    where = byok.provenance(r)
    title = cf.committed_title(r, where)
    assert "broken_gqa decode, pairwise cases on the GPU: 3 of 6 cases failed" in title
    assert "NVIDIA FAKE (compiled), commit abc1234, 2000-01-01" in title and "report's" in title
    lines = cf.replay_lines("broken_gqa", cf.first_failure(r["rows"]), where)
    assert lines[0] == f"first failure  {ROWS[2]['case']}"
    assert any(ln.startswith("measured on    NVIDIA FAKE") and "commit abc1234" in ln and "replay it on this machine"
               in ln for ln in lines)
    assert not any("measured" in ln for ln in cf.replay_lines("broken_gqa", ROWS[2]))
    write = cf.replay_lines("ours", EXACT[0])
    assert any("check ours --op write --case" in ln for ln in write)  # the shell's default op is decode


def test_an_exact_report_draws_its_tolerance_on_the_floor():
    from workbench.figures import conformance as cf

    fig = cf.conformance_figure(EXACT, "block_size", "t")
    by_name = {t.name: t for t in fig.data}
    floor = min(by_name["passed"].y)
    assert list(by_name["tolerance"].y) == [floor, floor] and floor > 0
    assert all(h == "tolerance 0 (exact)" for h in by_name["tolerance"].hovertext)
    assert list(fig.layout.yaxis.ticktext) == ["0 (exact)"] and "exact" in fig.layout.yaxis.title.text
    assert any("all 2 cases passed" in a.text for a in fig.layout.annotations)


def test_bandwidth_figure_never_draws_an_absent_peer(run):
    import plotly.graph_objects as go

    from workbench.figures import conformance as cf

    bw = byok.bandwidth(run, "graph")
    fig = cf.bandwidth_figure(bw, "W4", "t")
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    drawn = {t.name for t in bars if t.name}
    assert drawn == set(bw.impls) and not drawn & set(bw.absent)
    assert all(y > 0 for t in bars for y in (t.y if t.orientation != "h" else t.x))
    right = next(t for t in bars if t.orientation == "h")
    assert "mine" not in right.y and "flex_paged" not in right.y  # both failed on W4
    assert "flashinfer" in fig.layout.title.text and "vllm_triton" in fig.layout.title.text
    notes = " ".join(a.text for a in fig.layout.annotations)
    assert "mine on W4" in notes and "gather_sdpa on W2" in notes and "flashinfer (absent)" in notes
    with pytest.raises(ValueError, match="workload"):
        cf.bandwidth_figure(bw, "W9", "t")


# ---- the panels ----------------------------------------------------------------------------------------------------
def _fast(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, out):
    """The float64 reference behind the decode op (no Triton): a correct implementation that checks fast."""
    return reference_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, None, None, None, out)


def _wrong_scale(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, out):
    """Ignores the softmax scale the suite passes."""
    return _fast(q, k_cache, v_cache, layout, block_table, seq_lens, q.shape[-1] ** -0.5, out)


@pytest.fixture
def impls():
    names = ["test_fast", "test_wrong_scale"]
    conformance.register("decode", names[0], _fast, layouts=("nhd", "hnd"))
    conformance.register("decode", names[1], _wrong_scale, layouts=("nhd", "hnd"))
    yield names
    for n in names:
        conformance.unregister("decode", n)


def test_conformance_panel_caches_reports_and_every_control_changes_the_figure(impls):
    from workbench.ui import conformance_panels as cpanels

    seeded = conformance.check(impls[1], level="smoke")
    panel = cpanels.conformance_panel(impls, reports={impls[1]: seeded}, impl=impls[1], committed=COMMITTED)
    assert panel.cache.runs == 0  # the seeded report is shown as it is
    assert "failed" in panel.figure.layout.title.text and seeded.first_failure.case.id in panel.replay.value
    for name, control in panel.controls.items():
        if name == "source":
            continue  # test_conformance_panel_shows_committed_reports_as_measured
        before = panel.figure.to_json()
        control.value = next_value(control)
        assert panel.status.value == "", (name, panel.status.value)
        assert panel.figure.to_json() != before, name
    runs = panel.cache.runs
    assert runs == 2  # the other implementation at smoke, then at pairwise
    for name, control in panel.controls.items():  # back through every value: all from the cache
        for value in control_values(control) if name != "source" else []:
            control.value = value
    assert panel.cache.runs == runs + 1  # the seeded one at pairwise was new
    panel.controls["impl"].value, panel.controls["level"].value = impls[0], "smoke"
    assert "all" in panel.replay.value and "passed" in panel.replay.value
    conformance.register("decode", impls[0], _fast, layouts=("nhd",))  # registered again (an edited kernel)
    panel.controls["color_by"].value = "layout"
    assert panel.cache.runs == runs + 2 and "hnd" not in " ".join(panel.figure.layout.xaxis.ticktext)


def test_conformance_panel_shows_committed_reports_as_measured(impls):
    from workbench.ui import conformance_panels as cpanels

    panel = cpanels.conformance_panel(impls, impl=impls[0], committed=COMMITTED)
    local = panel.figure.to_json()
    source = panel.controls["source"]
    assert control_values(source)[0] == cpanels.HERE and len(control_values(source)) == 1 + 5
    assert source.options[0][0].startswith("this machine (")
    assert not panel.controls["impl"].disabled and not panel.controls["level"].disabled
    runs = panel.cache.runs
    shown = set()
    for _, name in source.options[1:]:  # every committed report: drawn at once, nothing runs
        source.value = name
        assert panel.status.value == "", (name, panel.status.value)
        assert panel.controls["impl"].disabled and panel.controls["level"].disabled  # the report's own
        assert "committed report: NVIDIA FAKE (compiled), commit abc1234" in panel.figure.layout.title.text
        shown.add(panel.figure.to_json())
    assert panel.cache.runs == runs and len(shown) == 5 and local not in shown
    source.value = COMMITTED[2]["path"].name  # broken_gqa: its failures, and where they were measured
    assert "3 of 6 cases failed" in panel.figure.layout.title.text
    assert ROWS[2]["case"] in panel.replay.value and "measured on    NVIDIA FAKE" in panel.replay.value
    assert "conformance.replay(&#x27;broken_gqa&#x27;" in panel.replay.value
    before = panel.figure.to_json()
    panel.controls["color_by"].value = next_value(panel.controls["color_by"])  # grouping still applies
    assert panel.figure.to_json() != before and panel.cache.runs == runs
    source.value = COMMITTED[0]["path"].name  # the write op, exact: passes, nothing to replay
    assert "all 2 cases passed on NVIDIA FAKE" in panel.replay.value
    source.value = cpanels.HERE  # back: this machine's report, from the cache, controls live again
    assert not panel.controls["impl"].disabled and panel.cache.runs == runs
    assert impls[0] in panel.figure.layout.title.text and "committed" not in panel.figure.layout.title.text


def test_conformance_panel_draws_every_committed_report():
    """The GPU session's reports in data/results: each one a choice, drawn without running anything."""
    from workbench.ui import conformance_panels as cpanels

    committed = byok.check_reports()
    panel = cpanels.conformance_panel(["reference"], committed=committed)
    names = control_values(panel.controls["source"])[1:]
    assert len(names) == sum(bool(r["rows"]) for r in committed)
    for name in names:
        panel.controls["source"].value = name
        assert panel.status.value == "", (name, panel.status.value)
    assert panel.cache.runs == 1  # the reference, once, when the panel was made


def test_decode_choices_put_yours_first(impls):
    from workbench.ui import conformance_panels as cpanels

    conformance.register("decode", "mine", _fast, layouts=("nhd",))
    try:
        names = cpanels.decode_choices()
        assert names[0] == "mine" and set(impls) <= set(names)
        assert names.index("starter") < names.index("ours") < names.index("reference")
        assert max(names.index(n) for n in impls) < names.index("starter")
    finally:
        conformance.unregister("decode", "mine")


def test_bandwidth_panel_moves_with_its_controls(run):
    from workbench.ui import conformance_panels as cpanels

    panel = cpanels.bandwidth_panel([run])
    for name, control in panel.controls.items():
        if len(control_values(control)) < 2:
            continue  # one run: one option
        before = panel.figure.to_json()
        control.value = next_value(control)
        assert panel.status.value == "", (name, panel.status.value)
        assert panel.figure.to_json() != before, name
    with pytest.raises(ValueError, match="byok-decode"):
        cpanels.bandwidth_panel([])
