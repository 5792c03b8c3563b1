"""The pure row-shaping helpers of workbench.results.decode that notebook 02 and the decode results panel share."""

import pytest

from workbench.core.kv_spec import dtype_size
from workbench.results import decode


def row(**kw):
    base = dict(workload="W1", impl="ours", variant="", layout="nhd", block_size=16, kv_dtype="fp16", time_us=10.0,
                time_us_graph=9.0, frac_copy_bw=0.5, frac_copy_bw_graph=0.6, BLOCK_N=32, gpu="NVIDIA H200",
                date="2026-11-29T12:20:44Z", commit="f4d1c843d0e5")
    return {**base, **kw}


ROWS = [
    row(impl="sdpa", time_us=30.0),
    row(time_us=12.0, variant="slow"),
    row(time_us=11.0, variant="fast"),
    row(workload="W2", time_us=5.0),
    row(sweep="layout", layout="vllm", block_size=32, kv_dtype="fp8_e4m3"),
    row(sweep="layout", layout="hnd", block_size=16),
    row(sweep="layout", layout="nhd", block_size=128),
    row(sweep="align", layout="nhd", block_stride_pad=8),
    row(sweep="align", layout="hnd", block_stride_pad=0),
    row(sweep="align", layout="nhd", kv_dtype="fp8_e4m3", block_stride_pad=None),
    row(sweep="fp8", kv_dtype="fp8_e4m3"),
]


def test_best_rows_flattens_best_per_workload_in_order():
    best = decode.best_per_workload(ROWS)
    flat = decode.best_rows(best)
    assert [(r["workload"], r["impl"]) for r in flat] == [("W1", "sdpa"), ("W1", "ours"), ("W2", "ours")]
    assert flat[1]["variant"] == "fast"
    assert decode.headline_rows(ROWS) == flat + decode.sweep_rows(ROWS, "fp8")
    assert decode.best_rows({}) == []


def test_layout_sweep_adds_one_series_per_layout_and_dtype():
    got = decode.layout_sweep(ROWS)
    assert [r["series"] for r in got] == [f"{r['layout']} {r['kv_dtype']}" for r in decode.sweep_rows(ROWS, "layout")]
    assert {r["series"] for r in got} == {"vllm fp8_e4m3", "hnd fp16", "nhd fp16"}
    assert all(r["sweep"] == "layout" for r in got)
    assert "series" not in ROWS[4], "the input rows are not changed"


def test_align_sweep_adds_pad_bytes_and_the_coalescing_model():
    got = decode.align_sweep(ROWS)
    model = decode.with_coalescing(decode.sweep_rows(ROWS, "align"))
    assert len(got) == 3 and all(r["sweep"] == "align" for r in got)
    for g, m in zip(got, model, strict=True):
        assert g == {**m, "pad_bytes": int(m.get("block_stride_pad") or 0) * int(dtype_size(m["kv_dtype"]))}
        assert 0 < g["model_k_line_eff"] <= 1
    assert sorted(r["pad_bytes"] for r in got) == [0, 0, 16]  # 8 fp16 elements; None counts as no padding


def test_shaping_matches_the_notebooks_former_expressions_on_the_committed_run():
    rows = decode.load_decode(where={"gpu": "NVIDIA H200", "mode": "full"}, latest=True)
    if not rows:
        pytest.skip("no committed H200 decode run")
    old_layout = [{**r, "series": f"{r['layout']} {r['kv_dtype']}"} for r in decode.sweep_rows(rows, "layout")]
    old_align = [{**r, "pad_bytes": int(r.get("block_stride_pad") or 0) * int(dtype_size(r["kv_dtype"]))}
                 for r in decode.with_coalescing(decode.sweep_rows(rows, "align"))]
    best = decode.best_per_workload(rows)
    assert decode.layout_sweep(rows) == old_layout
    assert decode.align_sweep(rows) == old_align
    assert decode.best_rows(best) == [r for impls in best.values() for r in impls.values()]


def test_run_label():
    assert decode.run_label(ROWS) == "NVIDIA H200 2026-11-29T12:20:44Z commit f4d1c843d0e5"


def test_decode_results_panel_draws_the_shared_rows():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from workbench.figures import cache as figures
    from workbench.ui.panels import decode_results_panel

    panel = decode_results_panel(ROWS)
    panel.controls["view"].value = "layouts"
    want = figures.sweep_lines(decode.layout_sweep(ROWS), "block_size", "series", x_title="block size (tokens)")
    assert [(t.name, tuple(t.x), tuple(t.y)) for t in panel.figure.data] == \
        [(t.name, tuple(t.x), tuple(t.y)) for t in want.data]
    panel.controls["view"].value = "alignment"
    panel.controls["timing"].value = "graph"
    want = figures.sweep_lines(decode.align_sweep(ROWS), "pad_bytes", "layout", y="frac_copy_bw_graph",
                               model="model_k_line_eff", model_title="model: K tile line eff.")
    assert [(t.name, tuple(t.x), tuple(t.y)) for t in panel.figure.data] == \
        [(t.name, tuple(t.x), tuple(t.y)) for t in want.data]
