"""The what-if figures (``workbench.figures.whatif``): pure functions of ``whatif()`` output and the study's rows,
on random rows and a real run; titles that fit, sources in the hovers and the table."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("plotly")

from workbench.figures import whatif as wf  # noqa: E402
from workbench.figures.titles import TITLE_CHARS  # noqa: E402
from workbench.studies import whatif as wi  # noqa: E402

SCHEMES = ("fp16", "int8/token", "int4/token")
RATES = (2.0, 8.0, 32.0)


def random_rows(seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for s in SCHEMES:
        agreement, kl = rng.uniform(0.1, 1.0), rng.uniform(1e-4, 2.0)
        for r in RATES:
            rows.append({"scheme": s, "rate": r, "throughput_tok_s": rng.uniform(100, 9000),
                         "ttft_p50_s": rng.uniform(0.01, 5.0), "tpot_p50_s": rng.uniform(0.004, 0.02),
                         "preemptions": rng.randrange(50), "agreement": agreement, "mean_kl": kl,
                         "ppl_change": rng.uniform(0, 0.5), "quality_source": f"model-quality-x-{seed}.json: {s}"})
    return rows


SETUP = {"title": "a what-if " * 12, "subtitle": "line one<br>" + "a long second line " * 9}


def test_the_frontier_has_a_curve_per_scheme_and_a_quality_point_each():
    rows = random_rows(1)
    fig = wf.frontier_figure(rows, "int8/token", SETUP)
    curves = [t for t in fig.data if t.mode == "lines+markers"]
    assert sorted({t.name for t in curves}) == sorted(SCHEMES) and len(curves) == 2 * len(SCHEMES)
    assert {t.name: t.line.width for t in curves} == {"fp16": 2, "int8/token": 4, "int4/token": 2}
    ttft = next(t for t in curves if t.name == "fp16" and t.yaxis == "y")
    fp16 = sorted((r for r in rows if r["scheme"] == "fp16"), key=lambda r: r["rate"])
    assert list(ttft.y) == pytest.approx([1e3 * r["ttft_p50_s"] for r in fp16])
    quality = fig.data[-1]
    assert len(quality.x) == len(SCHEMES) and all("model-quality-x-1.json" in h for h in quality.hovertext)
    top = {r["scheme"]: r for r in rows if r["rate"] == max(RATES)}
    assert sorted(quality.x) == sorted(r["throughput_tok_s"] for r in top.values())
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis3.title.text == wf.QUALITY["agreement"]
    assert all(len(line) <= TITLE_CHARS for line in fig.layout.title.text.split("<br><sup>")[0].split("<br>"))


def test_the_frontier_shows_kl_on_a_log_axis_and_refuses_bad_arguments():
    rows = random_rows(2)
    fig = wf.frontier_figure(rows, "fp16", SETUP, quality="mean_kl")
    assert fig.layout.yaxis3.type == "log" and fig.layout.yaxis3.title.text == wf.QUALITY["mean_kl"]
    rows = [{**r, "mean_kl": 0.0} if r["scheme"] == "fp16" else r for r in rows]
    assert wf.frontier_figure(rows, "fp16", SETUP, "mean_kl").layout.yaxis3.title.text.endswith("(0 not drawn)")
    with pytest.raises(ValueError, match="quality must be one of"):
        wf.frontier_figure(random_rows(2), "fp16", SETUP, quality="perplexity")
    with pytest.raises(ValueError, match="at least one"):
        wf.frontier_figure([], "fp16", SETUP)


def test_log_ticks_cover_random_values_a_few_a_decade():
    rng = random.Random(3)
    values = [10 ** rng.uniform(-1, 4) for _ in range(20)]
    ticks = wf.log_ticks(values)
    assert min(ticks) <= min(values) * 2 and max(ticks) >= max(values) / 2
    assert all(f"{t:.0e}"[0] in "125" for t in ticks) and ticks == sorted(ticks)
    assert wf.log_ticks([0.0, -1.0, math.nan]) == []


@pytest.fixture(scope="module")
def out():
    return wi.run(**{**wi.WHATIF.defaults(), "n": 60, "kv_gib": 1.0, "rate": 32.0, "seed": 9})


def test_memory_is_the_runs_timeline_under_its_budget(out):
    fig = wf.memory_figure(out, SETUP)
    used, budget = fig.data
    assert list(used.y) == out["memory"]["blocks"] and list(used.x) == pytest.approx(out["memory"]["time_s"])
    assert set(budget.y) == {out["memory"]["kv_blocks"]} and "1 GiB given" in budget.hovertext
    assert fig.layout.yaxis.range[1] >= max(out["memory"]["blocks"])


def test_the_why_is_the_steps_parts_with_their_sources(out):
    fig = wf.why_figure(out, SETUP)
    bars = [t for t in fig.data if t.type == "bar"]
    decode = {t.name: t.x[0] for t in bars if t.y[0].startswith("decode")}
    assert decode == pytest.approx({p["name"]: 1e3 * p["seconds"] for p in out["why"]["decode"]})
    weights = next(t for t in bars if t.name == "weights")
    assert "quant-decode-h200" in weights.hovertext[0] and "assumed" in weights.hovertext[0]
    table = next(t for t in fig.data if t.type == "table")
    parts = len(out["why"]["decode"]) + len(out["why"]["prefill"])
    assert len(table.cells.values[0]) == parts and "fitted" in table.cells.values[4]
    assert any(f.endswith(".json") for f in table.cells.values[5])


def test_the_run_page_holds_memory_why_and_table_without_a_scrolling_table(out):
    fig = wf.run_figure(out, SETUP)
    assert {t.type for t in fig.data} == {"scatter", "bar", "table"}
    table = next(t for t in fig.data if t.type == "table")
    rows = len(table.cells.values[0]) + 1  # the header
    domain = table.domain.y
    plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    assert (domain[1] - domain[0]) * plot_px >= rows * wf.TABLE_ROW_PX  # every row shows
    assert wf.sources_line(out).startswith("profile: quant-decode-h200")


def test_quality_line_names_each_file_once():
    rows = random_rows(4)
    assert wf.quality_line(rows) == "quality: SmolLM2-135M on real text, model-quality-x-4.json"
    assert wf.scheme_colors(["b", "a", "b"]) == {"b": wf.PALETTE[0], "a": wf.PALETTE[1]}
