"""The quant, prefetch and preemption sweeps: each point is what its notebook panel computes for the same controls,
so a terminal sweep and the panel cannot drift apart."""

from __future__ import annotations

import math

import pytest

from workbench import sweeps
from workbench.sweeps import runner

SWEEPS = ("quant", "prefetch", "preemption")


@pytest.mark.parametrize("name", SWEEPS)
def test_default_point_has_every_plotted_column_and_repeats(name):
    s = sweeps.get(name)
    row = s.point(**s.defaults())
    assert set(s.y) <= set(row)
    assert not set(row) & {p.name for p in s.params}
    for k in s.y:
        assert isinstance(row[k], bool) or math.isfinite(row[k]), (k, row[k])
    assert s.point(**s.defaults()) == row


def panel_values(panel, values):
    for k, v in values.items():
        panel.controls[k].value = v
    return panel.compute()


def test_quant_point_is_the_panels_selection():
    from workbench.ui.quant_panels import quant_panel

    s = sweeps.get("quant")
    params = {**s.defaults(), "family": "int8", "granularity": "head", "outlier": 4}
    row = s.point(**params)
    panel = quant_panel(num_layers=params["num_layers"], num_tokens=params["num_tokens"],
                        num_kv_heads=params["num_kv_heads"], head_dim=params["head_dim"],
                        group=params["gqa_group"], num_queries=params["num_queries"], seed=params["seed"],
                        decode_rows=[])
    r = panel_values(panel, {k: params[k] for k in ("family", "granularity", "group", "residual", "key_mode",
                                                       "outlier")})
    for k in ("attn_err", "k_err", "v_err", "topk", "bytes_per_token"):
        assert row[k] == pytest.approx(r["selected"][k], rel=1e-9)
    assert row["on_front"] == (r["selected"]["title"] in {f["title"] for f in r["front"]})


def test_prefetch_point_is_the_panels_chosen_row():
    from workbench.tiers.link import LinkModel
    from workbench.ui.tier_panels import prefetch_panel

    s = sweeps.get("prefetch")
    params = {**s.defaults(), "strategy": "sequential", "device_blocks": 16, "link": "default", "steps": 48}
    row = s.point(**params)
    panel = prefetch_panel(prompt_tokens=params["prompt_tokens"], steps=params["steps"],
                           block_size=params["block_size"], token_bytes=params["token_bytes"], topk=params["topk"],
                           drift=params["drift"], link=LinkModel.default(), seed=params["seed"])
    r = panel_values(panel, {k: params[k] for k in ("pattern", "strategy", "device_blocks", "host_blocks", "window",
                                                       "depth", "compute_us", "path")})
    chosen = next(x for x in r["rows"] if x["strategy"] == "sequential")
    for k in ("hit_rate", "stall_s", "slowdown", "h2d_bytes"):
        assert row[k] == pytest.approx(chosen[k], rel=1e-9)
    assert row["replayed"] == "sequential" and row["link_source"] == LinkModel.default().source


def test_preemption_point_is_one_block_size_of_the_panels_curve(tmp_path):
    from workbench.tiers.link import LinkModel
    from workbench.ui.tier_panels import preemption_panel

    result = runner.run("preemption", {"block_size": [4, 64], "copies": ["layer"], "link": ["default"]},
                        out=tmp_path, progress=False)
    assert result.ran == 2 and result.csv_path.is_file()
    panel = preemption_panel(link=LinkModel.default(), block_sizes=(4, 64))
    curve = {r["block_size"]: r for r in panel_values(panel, {"copies": "layer"})["rows"]}
    for row in result.rows:
        for k in ("swap_per_block_s", "swap_batched_s", "recompute_s"):
            assert row[k] == pytest.approx(curve[row["block_size"]][k], rel=1e-9)
