"""The quantization error study (``workbench.quant.error_study``) and its data (``workbench.quant.synthetic``): the
synthetic K/V have the statistics they claim, the
metrics behave, the schemes rank as their bits say, the Pareto front is non-dominated, KIVI's comparison is
complete; and notebook 03's panel greys out what does not apply and redraws for everything else."""

import math

import pytest
import torch

from workbench.quant import SCHEMES, error_study, synthetic

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small tensors run faster on one thread


@pytest.fixture(scope="module")
def small():
    """Post-RoPE queries and keys, values: 3 layers x 256 tokens x 2 kv heads x 64, 2 query heads per kv head."""
    k, v = synthetic.synthetic_kv(3, 256, 2, 64, seed=3)
    k = synthetic.apply_rope(k)
    return synthetic.synthetic_queries(k, 16, 2, seed=4), k, v


def test_synthetic_keys_have_fixed_outlier_channels():
    k, _ = synthetic.synthetic_kv(2, 256, 3, 64, outlier_channels=4, outlier_scale=8.0)
    assert k.shape == (2, 256, 3, 64) and k.dtype == torch.float32
    body = k[:, 1:].abs()  # without the sink token
    per_channel = body.mean(dim=1)  # [L, H, D]
    top = per_channel.topk(4, dim=-1)
    ratio = top.values.mean(dim=-1) / per_channel.median(dim=-1).values
    assert bool(((ratio > 5) & (ratio < 12)).all()), ratio  # ~8x the typical channel
    # the same channels in every token: each token's 4 largest channels are (mostly) its head's outliers
    per_token = body.topk(4, dim=-1).indices  # [L, T, H, 4]
    hits = (per_token[..., :, None] == top.indices[:, None, :, None, :]).any(-1).float().mean()
    assert float(hits) > 0.9
    assert error_study.data_stats(torch.zeros(2, 1, 3, 64), k, k, outlier_channels=4)["outlier_ratio"] > 5
    flat, _ = synthetic.synthetic_kv(2, 256, 3, 64, outlier_channels=0)
    assert error_study.data_stats(torch.zeros(2, 1, 3, 64), flat, flat)["outlier_ratio"] < 3


def test_the_sink_draws_most_attention_and_attention_is_peaked():
    k, v = synthetic.synthetic_kv(2, 256, 3, 64)
    kp = synthetic.apply_rope(k)
    s = error_study.data_stats(synthetic.synthetic_queries(kp, 32, 3), kp, v)
    assert s["sink_mass"] > 0.3 and s["sink_mass"] > 20 * s["max_other_mass"]
    assert s["top1_mass"] > 0.4  # far from uniform (1/256)
    assert kp[:, 0].norm(dim=-1).mean() > 3 * kp[:, 1:].norm(dim=-1).mean()  # the sink's key norm is large
    no_sink, _ = synthetic.synthetic_kv(2, 256, 3, 64, sink=False)
    q = synthetic.synthetic_queries(synthetic.apply_rope(no_sink), 32, 3, sink_logit=0.0)
    assert error_study.data_stats(q, synthetic.apply_rope(no_sink), v)["sink_mass"] < 0.05


def test_values_grow_with_depth():
    _, v = synthetic.synthetic_kv(5, 128, 2, 32, value_growth=4.0)
    rms = error_study.data_stats(torch.zeros(5, 1, 2, 32), v, v)["value_rms"]
    assert all(b > a for a, b in zip(rms, rms[1:], strict=False))
    assert rms[-1] / rms[0] == pytest.approx(4.0, rel=0.1)


def test_synthetic_data_are_a_pure_function_of_the_arguments():
    a, b = synthetic.synthetic_kv(2, 64, 2, 16, seed=5), synthetic.synthetic_kv(2, 64, 2, 16, seed=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], synthetic.synthetic_kv(2, 64, 2, 16, seed=6)[0])
    with pytest.raises(ValueError, match="head_dim even"):
        synthetic.synthetic_kv(1, 4, 1, 7)
    with pytest.raises(ValueError, match="outlier_channels"):
        synthetic.synthetic_kv(1, 4, 1, 8, outlier_channels=9)


def test_rope_rotates_pairs_by_position():
    x = torch.randn(2, 10, 3, 16, generator=torch.Generator().manual_seed(0))
    r = synthetic.apply_rope(x)
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1))  # a rotation
    assert torch.equal(r[:, 0], x[:, 0])  # position 0 is unrotated
    # scores depend on relative position only: q at m, k at n is q at m + 5, k at n + 5
    q, k = x[0, :1], x[1, :1]
    s1 = (synthetic.apply_rope(q, [3]) * synthetic.apply_rope(k, [1])).sum()
    s2 = (synthetic.apply_rope(q, [8]) * synthetic.apply_rope(k, [6])).sum()
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)
    # channel 0 pairs with channel D/2 and turns by one radian per position
    e = torch.zeros(1, 1, 16)
    e[..., 0] = 1.0
    turned = synthetic.apply_rope(e, [1])
    torch.testing.assert_close(turned[0, 0, [0, 8]], torch.tensor([math.cos(1.0), math.sin(1.0)]))
    with pytest.raises(ValueError, match="positions must hold 10"):
        synthetic.apply_rope(x, [0, 1])


def test_metrics_are_zero_for_identical_inputs_and_positive_otherwise(small):
    q, k, v = (t[0] for t in small)
    assert error_study.reconstruction_error(k, k.clone()) == 0.0
    assert error_study.attention_error(q, k, v, k.clone(), v.clone()) == 0.0
    assert error_study.topk_agreement(q, k, k.clone()) == 1.0
    noisy = k + 0.05 * k.std() * torch.randn(k.shape, generator=torch.Generator().manual_seed(1))
    assert 0.03 < error_study.reconstruction_error(k, noisy) < 0.07
    assert error_study.attention_error(q, k, v, noisy, v) > 0
    assert error_study.attention_error(q, k, v, k, v * 1.01) == pytest.approx(0.01, rel=1e-4)  # linear in v
    assert 0.5 < error_study.topk_agreement(q, k, noisy) < 1.0
    assert error_study.topk_agreement(q, k, -k, top_k=4) < 0.1  # reversed scores: the top is the bottom
    assert error_study.reconstruction_error(k, torch.full_like(k, float("nan"))) == math.inf
    with pytest.raises(ValueError, match="do not match"):
        error_study.attention_error(q[..., :3, :], k, v, k, v)


def test_gqa_query_heads_read_their_own_kv_head():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(4, 6, 8, generator=g), torch.randn(20, 3, 8, generator=g), torch.randn(20, 3, 8, generator=g)
    out = error_study.attention(q, k, v)
    for h in range(6):
        p = (q[:, h] @ k[:, h // 2].T / math.sqrt(8)).softmax(-1)
        torch.testing.assert_close(out[:, h], p @ v[:, h // 2])


def test_evaluate_rows_and_the_ranking_of_the_bits(small):
    q, k, v = small
    rows = error_study.evaluate_all(None, q, k, v)
    assert len(rows) == len(SCHEMES) * 3
    r = rows[0]
    assert set(r) == {"scheme", "title", "family", "layer", "bytes_per_token", "quantized_tokens", "k_err", "v_err",
                      "attn_err", "topk"}
    by = {s["scheme"]: s for s in error_study.summarize(rows)}
    assert by["fp32"]["attn_err"] == 0 and by["fp32"]["topk"] == 1
    for name, s in by.items():
        assert s["bytes_per_token"] == SCHEMES[name].bytes_per_token(2, 64, context=256), name
        assert s["layers"] == 3
    # fp16 << fp8 << int4 << int2, in K and V reconstruction and in attention
    order = ["fp16", "fp8_e4m3/token", "int4/token", "int2/token"]
    for key in ("k_err", "v_err", "attn_err"):
        errs = [by[n][key] for n in order]
        assert errs[0] * 10 < errs[1] < errs[2] < errs[3], (key, errs)
        assert errs[1] * 1.5 < errs[2] and errs[2] * 2 < errs[3], (key, errs)
    assert by["fp8_e4m3/tensor"]["attn_err"] < by["fp8_e5m2/tensor"]["attn_err"]  # one more mantissa bit
    assert by["int8/token"]["k_err"] < by["int8/tensor"]["k_err"]  # finer scales, outliers contained
    assert by["fp16"]["topk"] == 1.0 and by["int2/token"]["topk"] < by["int8/token"]["topk"]
    one = error_study.evaluate("int4/kivi", q, k, v)
    assert [x["layer"] for x in one] == [0, 1, 2] and one[0]["quantized_tokens"] == 128  # 256 - 128 residual


def test_pareto_front_is_non_dominated_and_dominates_the_rest(small):
    q, k, v = small
    rows = error_study.summarize(error_study.evaluate_all(None, q, k, v))
    front = error_study.pareto_front(rows)

    def dominates(a, b):
        return (a["bytes_per_token"] <= b["bytes_per_token"] and a["attn_err"] <= b["attn_err"]
                and (a["bytes_per_token"] < b["bytes_per_token"] or a["attn_err"] < b["attn_err"]))

    assert not any(dominates(a, b) for a in rows for b in front)
    assert all(any(dominates(a, b) for a in front) for b in rows if b not in front)
    assert [r["bytes_per_token"] for r in front] == sorted(r["bytes_per_token"] for r in front)
    names = {r["scheme"] for r in front}
    assert {"fp32", "int2/token"} <= names and "bf16" not in names  # bf16: fp16's bytes, more error
    pts = [{"bytes_per_token": x, "attn_err": y} for x, y in [(1, 5), (2, 3), (2, 4), (3, 3), (4, 1), (4, 1)]]
    assert error_study.pareto_front(pts) == [pts[0], pts[1], pts[4], pts[5]]


def test_kivi_comparison_covers_both_key_modes_before_and_after_rope():
    k, v = synthetic.synthetic_kv(2, 256, 2, 64, seed=8)
    q = synthetic.synthetic_queries(synthetic.apply_rope(k), 16, 2, seed=9)
    rows = error_study.kivi_comparison(q, k, v)
    assert {(r["bits"], r["keys"], r["key_mode"]) for r in rows} == {
        (b, keys, mode) for b in (2, 4) for keys in ("pre-RoPE", "post-RoPE") for mode in ("channel", "token")}
    assert all("R0" in r["scheme"] for r in rows)  # no fp16 residual: only the key mode differs
    summary = error_study.kivi_summary(rows)
    assert len(summary) == 4 and all(s["ratio"] == s["token"] / s["channel"] for s in summary)
    two_pre = next(s for s in summary if s["bits"] == 2 and s["keys"] == "pre-RoPE")
    assert two_pre["ratio"] > 1.2  # KIVI's finding on keys with outlier channels: per-channel wins at 2 bits
    # RoPE is orthogonal: a pre-RoPE scheme's key error is the same measured on either side of it
    from workbench import quant

    pre = next(r for r in rows if r["bits"] == 4 and r["keys"] == "pre-RoPE" and r["key_mode"] == "token")
    s = quant.get("int4/kivi", residual=0, key_mode="token")
    direct = sum(error_study.reconstruction_error(k[i], s.roundtrip(k[i])) for i in range(2)) / 2
    assert pre["k_err"] == pytest.approx(direct, rel=1e-4)
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        error_study.kivi_comparison(q, k, v, bits=(3,))


def test_scheme_for_maps_the_panel_knobs():
    assert error_study.scheme_for("fp8_e5m2", "head") is SCHEMES["fp8_e5m2/head"]
    assert error_study.scheme_for("int8_asym", "tensor") is SCHEMES["int8_asym/token"]
    assert error_study.scheme_for("bf16", "token") is SCHEMES["bf16"]
    s = error_study.scheme_for("int2", group=128, residual=64, key_mode="token", head_dim=64)
    assert (s.bits, s.group, s.value_group, s.residual, s.key_mode) == (2, 128, 64, 64, "token")
    assert error_study.scheme_for("int4", group=16, head_dim=80).value_group == 16
    assert error_study.scheme_for("int4", group=32, head_dim=80).value_group == 16  # 80 = 16 x 5
    with pytest.raises(ValueError, match="family must be one of"):
        error_study.scheme_for("int3")


# ---- the panel of notebook 03 (the browser test moves the same controls in Chromium) -------------------------------
def _panel(decode_rows=()):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from workbench.ui.quant_panels import quant_panel

    return quant_panel(num_layers=2, num_tokens=128, num_kv_heads=2, head_dim=64, group=2, num_queries=8,
                       decode_rows=list(decode_rows))


def _shown(panel):
    from workbench.ui.plot_view import figure_json

    fig = figure_json(panel.figure)
    return fig["data"], [a.get("text") for a in fig["layout"].get("annotations", [])], fig["layout"]["title"]


def test_panel_greys_out_what_does_not_apply_and_redraws_for_the_rest():
    panel = _panel()
    c = panel.controls
    assert not c["key_mode"].disabled and c["granularity"].disabled  # int4 by default
    assert any("no H200 results yet" in (t or "") for t in _shown(panel)[1])
    moves = [("group", 64), ("residual", 96), ("key_mode", "token"), ("group", 128), ("outlier", 3),
             ("family", "fp8_e4m3"), ("granularity", "token"), ("family", "int8"), ("granularity", "head"),
             ("family", "fp16"), ("family", "bf16"), ("family", "int8_asym"), ("family", "int2")]
    for name, value in moves:
        before = _shown(panel)
        assert not c[name].disabled, name
        c[name].value = value
        assert panel.status.value == "", panel.status.value
        assert _shown(panel) != before, f"{name} -> {value} changed nothing"
    c["family"].value = "fp16"
    assert all(c[n].disabled for n in ("granularity", "group", "residual", "key_mode"))
    c["family"].value = "int8"
    assert not c["granularity"].disabled and c["group"].disabled


def test_panel_draws_measured_decode_rows_and_marks_the_choice():
    rows = [{"workload": w, "scheme": s, "time_us": 100.0, "speedup_vs_fp16": x, "bw_fraction": 0.9,
             "bytes_per_token": b, "rel_err": 1e-3, "gpu": "NVIDIA H200", "date": "2026-12-01T00:00:00Z",
             "commit": "abc"} for w in ("W1", "W2") for s, b, x in
            [("fp16", 768, 1.0), ("fp8_e4m3/tensor", 384, 1.8), ("int4/kivi", 240, 2.9)]]
    panel = _panel(rows)
    heat = next(t for t in panel.figure.data if t.type == "heatmap")
    assert list(heat.y) == ["fp16", "fp8_e4m3/tensor", "int4/kivi"] and list(heat.x) == ["W1", "W2"]
    assert [s.y0 for s in panel.figure.layout.shapes if s.type == "rect"] == [1.5]  # int4/kivi marked
    panel.controls["family"].value = "fp16"
    assert [s.y0 for s in panel.figure.layout.shapes if s.type == "rect"] == [-0.5]


def test_decode_rows_keep_the_shipped_launch():
    pytest.importorskip("ipywidgets")
    from workbench.ui.quant_panels import best_decode_rows

    rows = [{"section": "decode", "workload": "W1", "scheme": "fp16", "variant": "heuristic", "time_us": 10.0},
            {"section": "decode", "workload": "W1", "scheme": "fp16", "variant": "warps2", "time_us": 8.0},  # tuned
            {"section": "decode", "workload": "W1", "scheme": "int4/kivi", "variant": "heuristic"},  # failed
            {"section": "decode", "workload": "W2", "scheme": "fp16", "time_us": 9.0},  # no variant: the default
            {"section": "write", "scheme": "fp16", "time_us": 1.0}]
    got = [(r["workload"], r["scheme"], r["time_us"]) for r in best_decode_rows(rows)]
    assert got == [("W1", "fp16", 10.0), ("W2", "fp16", 9.0)]


def test_a_later_run_of_some_schemes_replaces_their_rows(tmp_path):
    """A --schemes run after the last full run re-measures its schemes (fp16, each run's baseline, stays the full
    run's); one before it, a smoke run or another GPU's is left out."""
    pytest.importorskip("ipywidgets")
    import json

    from workbench.ui.quant_panels import h200_decode_rows, h200_decode_run, h200_decode_updates

    def run(name, date, schemes=None, gpu="NVIDIA H200", smoke=False, t=1.0):
        rows = [{"section": "decode", "workload": "W1", "scheme": s, "variant": "heuristic", "time_us": t,
                 "commit": name} for s in (schemes or ["fp16", "int8/token", "int4/kivi"])]
        doc = {"meta": {"gpu": gpu, "date": date}, "smoke": smoke, "tune": False, "rows": rows,
               **({"schemes": schemes} if schemes else {})}
        (tmp_path / f"quant-decode-{name}.json").write_text(json.dumps(doc))

    run("old-update", "2026-12-01T00:00:00Z", ["fp16", "int8/token"], t=5.0)
    run("full", "2026-12-02T00:00:00Z")
    run("update", "2026-12-03T00:00:00Z", ["fp16", "int8/token"], t=2.0)
    run("smoke", "2026-12-04T00:00:00Z", ["int4/kivi"], smoke=True, t=3.0)
    run("h100", "2026-12-04T00:00:00Z", ["int4/kivi"], gpu="NVIDIA H100 80GB HBM3", t=4.0)
    assert h200_decode_run(tmp_path)["path"].name == "quant-decode-full.json"
    assert [u["path"].name for u in h200_decode_updates(tmp_path)] == ["quant-decode-update.json"]
    got = [(r["scheme"], r["commit"], r["time_us"]) for r in h200_decode_rows(tmp_path)]
    assert got == [("fp16", "full", 1.0), ("int8/token", "update", 2.0), ("int4/kivi", "full", 1.0)]


def test_a_labelled_variant_is_studied_under_its_label(small):
    """bench quant_decode's one-group-a-head variants join the study under the benchmark's names: more bytes of
    scales for int4/token's groups of 32 than one group a head, and less error."""
    from workbench.quant import one_group_a_head

    q, k, v = small
    rows = error_study.summarize(error_study.evaluate_all(["int4/token", one_group_a_head("int4/token@head", 64)], q,
                                                          k, v))
    by = {r["scheme"]: r for r in rows}
    assert list(by) == ["int4/token", "int4/token@head"]
    assert by["int4/token@head"]["bytes_per_token"] < by["int4/token"]["bytes_per_token"]
    assert by["int4/token@head"]["attn_err"] > by["int4/token"]["attn_err"]
