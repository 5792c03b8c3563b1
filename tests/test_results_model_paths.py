"""The model runner's decode-path rows of the committed ``bench model_decode`` runs (``workbench.results.model_paths``,
notebooks 08 and 07): the loaders find the H100 runs and their numbers, the tables print the lines the notebooks
check within their width, a bad section is refused by name, and the figure has a bar a configuration."""

import json

import pytest

from workbench.figures import model as model_figures
from workbench.results import model_paths

CASCADE = "model-decode-h100-80gb-hbm3-20261205T172918.json"
QUEST = "model-decode-h100-80gb-hbm3-20261205T173624.json"


@pytest.fixture(scope="module")
def cascade():
    return model_paths.latest("cascade")


@pytest.fixture(scope="module")
def quest():
    return model_paths.latest("quest")


def test_latest_finds_the_newest_run_holding_the_section(cascade, quest):
    assert model_paths.run_name(cascade) == CASCADE
    assert model_paths.run_name(quest) == QUEST  # the newer cascade-less run is the quest one, and the other way
    assert all(model_paths.run_name(r) != QUEST for r in model_paths.runs("cascade"))
    assert cascade["info"]["gpu"] == quest["info"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert quest["info"]["rope_positions"] == 33024


def test_the_cascade_rows_hold_the_committed_numbers(cascade):
    rows = {r["shared_prefix"]: r for r in model_paths.section_rows(cascade, "cascade")}
    assert list(rows) == ["off", "auto", "shared"]
    assert [round(rows[m]["tokens_per_s"], 1) for m in rows] == [262.6, 258.8, 192.8]
    assert round(rows["off"]["step_ms"], 2) == 30.46
    assert {m: round(x, 3) for m, x in model_paths.speedups(cascade, "cascade").items()} == {
        "off": 1.0, "auto": 0.985, "shared": 0.734}
    assert rows["auto"]["paths"] == {"plain": 7650} and rows["shared"]["paths"] == {"shared": 7650}
    assert all(r["tokens_equal_plain"] for r in rows.values())


def test_the_quest_rows_hold_the_committed_numbers(quest):
    got = {model_paths.label(r): (round(r["tokens_per_s"], 2 if r["batch"] == 1 else 1),
                                  round(model_paths.speedup(r), 2), r["agree_to_divergence"])
           for r in model_paths.section_rows(quest, "quest")}
    assert got == {"batch 1, full": (23.38, 1.0, 1.0), "batch 1, quest 64": (16.39, 0.7, 0.0),
                   "batch 1, quest 128": (18.23, 0.78, 0.0), "batch 4, full": (109.3, 1.0, 1.0),
                   "batch 4, quest 64": (83.2, 0.76, 0.0), "batch 4, quest 128": (83.9, 0.77, 0.0)}


def test_the_cascade_table_names_the_file_and_rounds_as_meant(cascade):
    text = model_paths.format_rows(cascade, "cascade")
    lines = text.splitlines()
    assert lines[0].startswith(f"{CASCADE} (NVIDIA H100 80GB HBM3)")
    assert "8 greedy samples forked from one 4096-token prompt" in lines[1]
    assert lines[2].split() == ["shared_prefix", "tokens/s", "ms/step", "vs", "plain", "paths", "attend", "µs",
                                "share", "same", "tokens", "agree"]
    assert lines[3].split() == ["off", "263", "30.5", "1.00", "plain", "7650", "228", "0.22", "yes", "1.00"]
    assert lines[4].split() == ["auto", "259", "30.9", "0.99", "plain", "7650", "179", "0.17", "yes", "1.00"]
    assert lines[5].split() == ["shared", "193", "41.5", "0.73", "shared", "7650", "266", "0.19", "yes", "1.00"]
    assert max(len(line) for line in lines) <= model_paths.LINE_CHARS


def test_the_quest_table_names_the_file_and_keeps_the_note(quest):
    text = model_paths.format_rows(quest, "quest")
    lines = text.splitlines()
    assert lines[0].startswith(f"{QUEST} (NVIDIA H100 80GB HBM3)")
    assert lines[3].split() == ["1", "full", "-", "23.4", "42.8", "1.00", "plain", "7650", "365", "0.26", "1.00",
                                "1.00"]
    assert lines[4].split()[:6] == ["1", "quest", "64", "16.4", "61.0", "0.70"]
    assert lines[6].split()[:6] == ["4", "full", "-", "109", "36.6", "1.00"]
    assert lines[8].split()[:6] == ["4", "quest", "128", "83.9", "47.7", "0.77"]
    assert "RoPE table extended to 33024 positions" in text
    assert "not a quality claim" in " ".join(lines)  # the file's note, wrapped
    assert max(len(line) for line in lines) <= model_paths.LINE_CHARS


def test_sig3_prints_plain_digits():
    assert [model_paths.sig3(x) for x in (262.627, 23.377, 109.34, 1234.5, 0.98541, 99.96, 0.0)] == [
        "263", "23.4", "109", "1230", "0.985", "100", "0"]


def test_a_bad_section_is_refused_by_name(cascade, tmp_path):
    for call in (lambda: model_paths.latest("decode"), lambda: model_paths.runs("beams"),
                 lambda: model_paths.format_rows(cascade, "nope")):
        with pytest.raises(ValueError, match="section must be one of"):
            call()
    with pytest.raises(ValueError, match="section 'quest': no bench model_decode run"):
        model_paths.latest("quest", tmp_path)  # an empty folder
    with pytest.raises(ValueError, match="section 'quest': run .* has no such rows"):
        model_paths.format_rows(cascade, "quest")


def test_smoke_runs_are_left_out(tmp_path):
    row = {"section": "cascade", "shared_prefix": "off"}
    for name, extra in (("model-decode-cpu-20261201T000000.json", {"mode": "smoke"}),
                        ("model-decode-cpu-20261201T000001.json", {})):
        doc = {"meta": {"gpu": "cpu", "date": name[-20:-5]}, **extra, "rows": [row]}
        (tmp_path / name).write_text(json.dumps(doc))
    assert [model_paths.run_name(r) for r in model_paths.runs("cascade", tmp_path)] == [
        "model-decode-cpu-20261201T000001.json"]


@pytest.mark.parametrize("section", ["cascade", "quest"])
def test_the_figure_has_a_bar_a_configuration(section, cascade, quest):
    run = cascade if section == "cascade" else quest
    rows = model_paths.section_rows(run, section)
    fig = model_figures.decode_paths(run, section)
    assert all(t.type == "bar" for t in fig.data)
    assert sum(len(t.y) for t in fig.data) == len(rows)
    bars = {(x, y): text for t in fig.data for x, y, text in zip(t.x, t.y, t.text, strict=True)}
    assert sorted(bars.values()) == sorted(f"{model_paths.speedup(r):.2f}x" for r in rows)
    assert sorted(y for _, y in bars) == sorted(r["tokens_per_s"] for r in rows)
    title = fig.layout.title.text
    assert "NVIDIA H100 80GB HBM3" in title and model_paths.run_name(run) in title
    if section == "quest":
        assert {x for x, _ in bars} == {"batch 1", "batch 4"} and fig.layout.barmode == "group"
        assert [t.name for t in fig.data] == ["full cache", "Quest, 64 pages (1024 tokens)",
                                              "Quest, 128 pages (2048 tokens)"]
