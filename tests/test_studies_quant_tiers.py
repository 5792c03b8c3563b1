"""The quant, prefetch and preemption studies (``workbench.studies.quant``, ``tiers``): each is declared once, and its
panel and its sweep compute through the same function, so what the panel shows for some controls is the sweep's row
for the same parameters."""

from __future__ import annotations

import math

import pytest

from workbench import sweeps
from workbench.quant.names import STUDY_FAMILIES
from workbench.studies import quant, tiers
from workbench.sweeps import runner
from workbench.tiers import prefetch
from workbench.tiers.link import LinkModel

SWEEPS = ("quant", "prefetch", "preemption", "tier_formats")


@pytest.mark.parametrize("name", SWEEPS)
def test_default_point_has_every_plotted_column_and_repeats(name):
    s = sweeps.get(name)
    row = s.point(**s.defaults())
    assert set(s.y) <= set(row)
    assert not set(row) & {p.name for p in s.params}
    for k in s.y:
        assert isinstance(row[k], bool) or math.isfinite(row[k]), (k, row[k])
    assert s.point(**s.defaults()) == row


def test_names_are_declared_once():
    assert sweeps.get("quant") is quant.QUANT and quant.QUANT.param("family").choices == STUDY_FAMILIES
    assert tuple(tiers.STRATEGIES) == tuple(prefetch.PREFETCH) == tuple(tiers.SHORT)
    assert sweeps.get("prefetch").param("strategy").choices == tuple(prefetch.PREFETCH)
    assert sweeps.get("prefetch") is tiers.PREFETCH and sweeps.get("preemption") is tiers.PREEMPTION


def panel_values(panel, values):
    for k, v in values.items():
        panel.controls[k].value = v
    return panel.compute()


def test_quant_panel_controls_are_the_studys_and_show_its_point():
    pytest.importorskip("ipywidgets")
    from workbench.ui.quant_panels import quant_panel

    s = quant.QUANT
    params = {**s.defaults(), "family": "int8", "granularity": "head", "outlier": 4}
    panel = quant_panel(num_layers=params["num_layers"], num_tokens=params["num_tokens"],
                        num_kv_heads=params["num_kv_heads"], head_dim=params["head_dim"],
                        group=params["gqa_group"], num_queries=params["num_queries"], seed=params["seed"],
                        decode_rows=[])
    assert list(panel.controls) == list(s.controls)
    assert panel.values() == {k: s.param(k).default for k in s.controls}
    r = panel_values(panel, {k: params[k] for k in s.controls})
    row = s.point(**params)
    want = {k: row[k] for k in ("scheme", "title", "bytes_per_token", "k_err", "v_err", "attn_err", "topk")}
    assert {k: r["selected"][k] for k in want} == want  # one function, the same numbers
    assert row["on_front"] == (r["selected"]["title"] in {f["title"] for f in r["front"]})
    assert row["front_size"] == len(r["front"])


def test_prefetch_panel_rows_are_the_sweeps_points():
    pytest.importorskip("ipywidgets")
    from workbench.ui.tier_panels import prefetch_panel

    s = tiers.PREFETCH
    params = {**s.defaults(), "device_blocks": 16, "link": "default", "steps": 48}
    panel = prefetch_panel(prompt_tokens=params["prompt_tokens"], steps=params["steps"],
                           block_size=params["block_size"], token_bytes=params["token_bytes"], topk=params["topk"],
                           drift=params["drift"], link=LinkModel.default(), seed=params["seed"])
    assert list(panel.controls) == list(s.controls)
    r = panel_values(panel, {k: params[k] for k in s.controls})
    assert [x["strategy"] for x in r["rows"]] == list(tiers.STRATEGIES)
    for shown in r["rows"]:  # every bar is the sweep's point for its strategy
        row = s.point(**{**params, "strategy": shown["strategy"]})
        assert {k: shown[k] for k in ("hit_rate", "stall_s", "slowdown", "h2d_bytes", "prefetch_wasted")} == \
            {k: row[k] for k in ("hit_rate", "stall_s", "slowdown", "h2d_bytes", "prefetch_wasted")}
        assert row["replayed"] == shown["strategy"] and row["link_source"] == LinkModel.default().source


def test_prefetch_score_on_a_trace_without_scores_replays_none():
    params = {**tiers.PREFETCH.defaults(), "pattern": "full", "strategy": "score", "link": "default", "steps": 16}
    row = tiers.PREFETCH.point(**params)
    assert row["replayed"] == "none"
    assert row == {**tiers.PREFETCH.point(**{**params, "strategy": "none"}), "replayed": "none"}


def test_preemption_sweep_rows_are_the_panels_curve(tmp_path):
    pytest.importorskip("ipywidgets")
    from workbench.ui.tier_panels import preemption_panel

    result = runner.run("preemption", {"block_size": [4, 64], "copies": ["layer"], "link": ["default"]},
                        out=tmp_path, progress=False)
    assert result.ran == 2 and result.csv_path.is_file()
    panel = preemption_panel(link=LinkModel.default(), block_sizes=(4, 64))
    assert list(panel.controls) == list(tiers.PREEMPTION.controls)
    curve = {r["block_size"]: r for r in panel_values(panel, {"copies": "layer"})["rows"]}
    for row in result.rows:
        for k in ("swap_per_block_s", "swap_batched_s", "recompute_s"):
            assert row[k] == curve[row["block_size"]][k]
