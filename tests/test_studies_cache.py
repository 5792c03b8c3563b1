"""The memory, sharing, coalescing and fragmentation studies (``workbench.studies.cache``): each panel's controls are
its study's parameters, and what it shows for some controls is what the sweep's point gives for the same
parameters, through the same function."""

from __future__ import annotations

import pytest

from workbench.studies import cache

pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from workbench.ui import panels  # noqa: E402


def moved(panel, values):
    for k, v in values.items():
        panel.controls[k].value = v
    return panel.compute()


def test_memory_panel_shows_the_sweeps_point():
    p = panels.memory_panel(num_requests=16, seed=3)
    assert list(p.controls) == list(cache.MEMORY.controls)
    r = moved(p, {"block_size": 64, "max_len": 4096, "kv_dtype": "int4"})
    row = cache.MEMORY.point(**p.values(), num_requests=16, seed=3)
    paged = next(v for k, v in r.items() if k.startswith("paged"))
    assert row["paged_gib"] == paged["total"] / 2**30 and row["paged_token_share"] == paged["token_share"]


def test_sharing_panel_shows_the_sweeps_point():
    p = panels.sharing_panel()
    assert list(p.controls) == list(cache.SHARING.controls)
    r = moved(p, {"num_requests": 6, "prefix_caching": False, "block_size": 8})
    row = cache.SHARING.point(**p.values())
    assert (row["blocks_used"], row["memory_saved"], row["cow_copies"]) == (r.blocks_used, r.memory_saved,
                                                                           r.cow_copies)


def test_coalescing_panel_shows_the_sweeps_point():
    p = panels.coalescing_panel(num_kv_heads=4)
    assert list(p.controls) == list(cache.COALESCING.controls)
    r = moved(p, {"layout": "vllm", "kind": "v", "pad": 8}).row()
    row = cache.COALESCING.point(**p.values(), num_kv_heads=4)
    assert {k: row[k] for k in row} == {k: r[k] for k in row}


def test_fragmentation_panel_shows_the_sweeps_point():
    p = panels.fragmentation_panel(num_requests=100)
    assert list(p.controls) == list(cache.FRAGMENTATION.controls)
    r = moved(p, {"strategy": "paged-adaptive", "compact_every": 32})
    row = cache.FRAGMENTATION.point(**p.values(), num_requests=100, model=cache.FRAGMENTATION.param("model").default)
    assert row["share_token_states"] == r["shares"]["token_states"] and row["preemptions"] == r["preemptions"]
