"""A format per tier as a model (``workbench.tiers.format_cost``) and its quality rows
(``workbench.results.format_quality``): bytes equal a real cache's tier blocks, the pipelined batch time, the
break-even link, the committed quality rows, and the ``tier_formats`` study and panel built on them."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest

from workbench import quant, sweeps
from workbench.cache import PagedKVCache
from workbench.core import kv_spec
from workbench.core.kv_spec import ModelSpec
from workbench.results import format_quality
from workbench.studies import tiers as tier_studies
from workbench.tiers import format_cost as fc
from workbench.tiers import formats
from workbench.tiers.link import LinkModel, latest_link_model

RESULTS = Path(__file__).resolve().parents[1] / "data" / "results"
QUALITY = "model-quality-cpu-x86_64-20261205T001604.json"
SMOL = kv_spec.model("smollm2-135m")


def shape(L, H, D):
    return ModelSpec("test", L, H, D, H)


# ---- bytes: what a live cache's tier blocks hold ------------------------------------------------------------------
def _random_cases(seed=7):
    """Every format (and bf16, fp32) twice, on random shapes, block sizes and device casts."""
    rng = random.Random(seed)
    for name in 2 * (*fc.TIER_FORMATS, "fp8_e5m2/token", "int8_asym/token", "int2/kivi", "fp32", "bf16"):
        yield (rng.randint(1, 3), rng.choice((1, 2, 3, 4)), rng.choice((16, 32, 64)), rng.choice((1, 2, 4, 8, 16, 32)),
               rng.choice(("fp16", "bf16")), name)


@pytest.mark.parametrize("L,H,D,bs,device,name", list(_random_cases()))
def test_block_bytes_and_decision_equal_a_real_caches(L, H, D, bs, device, name):
    cache = PagedKVCache(num_layers=L, num_kv_heads=H, head_dim=D, num_pages=2, page_tokens=bs, kv_dtype=device,
                         ops="torch")
    try:
        live = formats.tier_format(cache, name, "format")
    except ValueError as e:  # the model refuses what the cache refuses, with the same reason
        with pytest.raises(ValueError, match="cannot store") as got:
            fc.tier_format(name, shape(L, H, D), bs, device)
        assert str(e).split(": ", 1)[1] == str(got.value).split(": ", 1)[1]
        return
    model = fc.tier_format(name, shape(L, H, D), bs, device)
    assert model == live, (name, device, model, live)
    assert fc.block_bytes(shape(L, H, D), bs, model, device) == formats.block_bytes(cache, live, bs)
    assert fc.block_bytes(shape(L, H, D), bs, fc.TierFormat(), device) == formats.block_bytes(cache, formats.DEVICE, bs)


def test_smollm2_bytes_a_token():
    t = fc.format_table(SMOL, 16, ("fp16", "int8/token", "int4/token"), batch=4, link=64.0)
    per = {r["format"]: r["bytes_per_token"] for r in t.rows}
    assert per["fp16"] == 30 * 2 * 3 * 64 * 2  # 23040: every layer's K and V
    # int8: 64 code bytes + one fp32 scale a token-head; int4: 32 + fp16 scale and zero per 32 channels
    assert per["int8/token"] == 30 * 2 * 3 * (64 + 4) and per["int4/token"] == 30 * 2 * 3 * (32 + 2 * 2 * 2)


# ---- the batch model ----------------------------------------------------------------------------------------------
def test_pipelined_batch_on_a_flat_link():
    rng = random.Random(3)
    for _ in range(20):
        bs, batch, gbps = rng.choice((1, 4, 16, 64)), rng.choice((1, 7, 64)), rng.uniform(1, 5000)
        frac = rng.uniform(0.05, 1.0)
        name = rng.choice(("int8/token", "int4/token", "int2/token", "fp8_e5m2/token"))
        t = fc.Transcode(frac)
        r = fc.format_cost(SMOL, bs, name, batch=batch, link=gbps, transcode=t)
        dev = fc.block_bytes(SMOL, bs, fc.TierFormat()) * batch
        fmt = r["block_bytes"] * batch
        assert r["batch_bytes"] == fmt and r["ratio"] == dev / fmt
        code = (dev + fmt) / (frac * fc.H200_COPY_GBPS * 1e9)
        copy = fmt / (gbps * 1e9)
        for d in ("down", "up"):
            assert r[f"{d}_transcode_s"] == pytest.approx(code, rel=1e-12)
            assert r[f"{d}_copy_s"] == pytest.approx(copy, rel=1e-12)
            assert r[f"{d}_s"] == pytest.approx(max(copy, code), rel=1e-12)
            assert r[f"{d}_tokens_per_s"] == pytest.approx(batch * bs / max(copy, code), rel=1e-12)
            assert r[f"{d}_speedup"] == pytest.approx(dev / (gbps * 1e9) / max(copy, code), rel=1e-12)
            assert r[f"{d}_hidden"] == pytest.approx(min(1.0, copy / code), rel=1e-12)
        # below the break-even the format is faster, above it slower; below hidden_below the transcode is hidden
        below = fc.format_cost(SMOL, bs, name, batch=batch, link=0.99 * r["down_pays_below_gbps"], transcode=t)
        above = fc.format_cost(SMOL, bs, name, batch=batch, link=1.01 * r["down_pays_below_gbps"], transcode=t)
        assert below["down_speedup"] > 1 > above["down_speedup"]
        hid = fc.format_cost(SMOL, bs, name, batch=batch, link=0.99 * r["down_hidden_below_gbps"], transcode=t)
        assert hid["down_hidden"] == 1.0
        assert fc.format_cost(SMOL, bs, name, batch=batch, link=1.01 * r["down_hidden_below_gbps"],
                              transcode=t)["down_hidden"] < 1.0
    # encode and decode apart: each direction its own transcode
    slow, fast = fc.Transcode(0.01), fc.Transcode(1.0)
    r = fc.format_cost(SMOL, 16, "int4/token", batch=64, link=55.0, transcode=(slow, fast))
    assert r["down_transcode_s"] == pytest.approx(100 * r["up_transcode_s"]) and r["down_hidden"] < r["up_hidden"]
    assert r["down_pays_below_gbps"] == pytest.approx(r["up_pays_below_gbps"] / 100)


def test_device_format_is_the_reference_and_a_larger_format_never_pays():
    r = fc.format_cost(SMOL, 16, "fp16", batch=64, link=latest_link_model())
    assert (r["transcodes"], r["lossy"], r["down_transcode_s"], r["up_transcode_s"], r["ratio"]) == (
        False, False, 0.0, 0.0, 1.0)
    assert r["down_speedup"] == r["up_speedup"] == 1.0 and r["down_hidden"] == 1.0
    assert r["down_pays_below_gbps"] == r["up_hidden_below_gbps"] == 0.0
    big = fc.format_cost(SMOL, 16, "fp32", batch=64, link=55.0)
    assert big["transcodes"] and not big["lossy"] and big["ratio"] == 0.5  # fp32 holds fp16 exactly, twice the bytes
    assert big["down_pays_below_gbps"] == 0.0 and big["down_speedup"] < 1 and big["down_hidden_below_gbps"] > 0
    assert fc.format_cost(SMOL, 16, "bf16", batch=4, link=55.0)["lossy"]
    fp8 = fc.format_cost(SMOL, 16, "fp8_e4m3/tensor", batch=4, link=55.0, device="fp8_e4m3/tensor")
    assert not fp8["transcodes"] and fp8["bytes_per_token"] == 30 * 2 * 3 * 64  # a static device keeps its bytes


def test_curves_are_the_links_own():
    link = latest_link_model()
    for tier, (path, down, up) in fc.TIERS.items():
        r = fc.format_cost(SMOL, 32, "int4/token", batch=16, link=link, tier=tier)
        assert r["down_copy_s"] == link.seconds(r["batch_bytes"], path, down)
        assert r["up_copy_s"] == link.seconds(r["batch_bytes"], path, up)
        assert r["down_link_gbps"] == pytest.approx(link.gbps(r["batch_bytes"], path, down))
    # on the host link int4 moves about 3x fp16's tokens/s in large batches, less in small ones (smaller transfers)
    big = fc.format_cost(SMOL, 64, "int4/token", batch=256, link=link)["down_speedup"]
    small = fc.format_cost(SMOL, 16, "int4/token", batch=4, link=link)["down_speedup"]
    assert 3.0 < big < 3.2 and 1.5 < small < big


def test_format_table_skips_what_cannot_store_the_block_size():
    t = fc.format_table(SMOL, 16, batch=64, link=LinkModel.default())
    assert set(t.skipped) == {"int4/kivi"}
    assert t.skipped["int4/kivi"] == "its groups of 32 tokens do not tile a block of 16"
    assert [r["format"] for r in t.rows] == [f for f in fc.TIER_FORMATS if f not in t.skipped]
    assert t.row("int4/token") is t.rows[[r["format"] for r in t.rows].index("int4/token")] and t.row("x") is None
    assert not fc.format_table(SMOL, 32, batch=64, link=55.0).skipped
    with pytest.raises(ValueError, match="needs static scales"):  # not a shape problem: raised, not skipped
        fc.format_table(SMOL, 16, ("fp16", "int8/tensor"), batch=4, link=55.0)


@pytest.mark.parametrize("call,match", [
    (lambda: fc.format_cost("smol", 16, "fp16", batch=1, link=55.0), "shape must be"),
    (lambda: fc.format_cost(SMOL, 0, "fp16", batch=1, link=55.0), "block_size must be"),
    (lambda: fc.format_cost(SMOL, 16, "fp16", batch=True, link=55.0), "batch must be"),
    (lambda: fc.format_cost(SMOL, 16, "fp16", batch=1, link=float("nan")), "link must be"),
    (lambda: fc.format_cost(SMOL, 16, "fp16", batch=1, link="host"), "link must be"),
    (lambda: fc.format_cost(SMOL, 16, "int9", batch=1, link=55.0), "format: quantization scheme must be"),
    (lambda: fc.format_cost(SMOL, 16, "fp8_e4m3/tensor", batch=1, link=55.0), "format must be a cast"),
    (lambda: fc.format_cost(SMOL, 16, "fp16", batch=1, link=55.0, tier="ssd"), "tier must be"),
    (lambda: fc.format_cost(SMOL, 16, "fp16", batch=1, link=55.0, device="fp17"), "device:"),
    (lambda: fc.format_cost(SMOL, 16, "fp16", batch=1, link=55.0, transcode=0.5), "transcode must be"),
    (lambda: fc.format_cost(SMOL, 16, "fp16", batch=1, link=55.0, transcode=(fc.Transcode(),)), "transcode must be"),
    (lambda: fc.format_table(SMOL, 16, batch=1, link=55.0, measured=[1]), "measured must be"),
    (lambda: fc.measured_transcodes([], ""), "source must be"),
    (lambda: fc.Transcode(0.0), "fraction must be"), (lambda: fc.Transcode(0.5, -1.0), "copy_gbps must be"),
    (lambda: fc.Transcode(0.5, source=""), "source must be"), (lambda: fc.Transcode(0.5, floor_s=-1e-3), "floor_s"),
    (lambda: fc.Transcode(0.5, floor_s=math.inf), "floor_s"),
    (lambda: fc.format_table(SMOL, 16, "fp16", batch=1, link=55.0), "formats must be"),
    (lambda: fc.block_bytes(SMOL, 16, "int4/token"), "fmt must be a TierFormat"),
])
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_copy_bandwidth_is_the_committed_h200_runs():
    doc = json.loads((RESULTS / "quant-decode-h200-20261205T021116.json").read_text())
    assert fc.H200_COPY_GBPS == pytest.approx(doc["copy_gbps"], rel=1e-3)
    assert fc.Transcode().source == "assumed"
    assert fc.TIER_FORMATS[0] == "fp16" and all(not quant.get(f).needs_static_scales for f in fc.TIER_FORMATS)


# ---- quality rows -------------------------------------------------------------------------------------------------
def test_quality_is_the_newest_runs_scheme_rows(tmp_path):
    shutil.copy(RESULTS / QUALITY, tmp_path / QUALITY)  # a run without tier rows (model_quality before issue 34)
    q = format_quality.quality_costs(tmp_path)
    assert (q.kind, q.source) == ("scheme", QUALITY) and "stand-in" in q.describe()
    rows = {r["scheme"]: r for r in reversed(json.loads((RESULTS / QUALITY).read_text())["rows"])}  # first wins
    for name in fc.TIER_FORMATS:
        r, got = rows[name], q.get(name)
        assert got == format_quality.Quality(r["agreement"], r["mean_kl"], r["perplexity"] / r["ref_perplexity"] - 1)
    assert q.get("fp16") == format_quality.Quality(1.0, 0.0, 0.0)
    here = format_quality.quality_costs()  # data/results: tier rows once a run with them is there
    assert here.source in {p.name for p in RESULTS.glob(format_quality.PATTERN)}
    if here.kind == "tier":
        assert set(fc.TIER_FORMATS) <= set(here.by_format) and here.get("fp16").mean_kl == 0.0
        assert here.describe().startswith("tier rows, ")


def test_tier_rows_win_when_a_run_has_them(tmp_path):
    doc = json.loads((RESULTS / QUALITY).read_text())
    shutil.copy(RESULTS / QUALITY, tmp_path / QUALITY)
    rng = random.Random(5)
    tier_rows = [{**r, "host_format": r["scheme"], "scheme": "fp16", "agreement": rng.random(),
                  "mean_kl": rng.random()} for r in doc["rows"] if r["scheme"] in ("int4/token", "int8/token")]
    tier_rows.append({**doc["rows"][0], "section": "tier", "scheme": "int2/token", "agreement": 0.25})
    newer = {**doc, "meta": {**doc["meta"], "date": "2026-12-06T00:00:00Z"}, "rows": doc["rows"] + tier_rows}
    (tmp_path / "model-quality-cpu-x86_64-20261206T000000.json").write_text(json.dumps(newer))
    q = format_quality.quality_costs(tmp_path)
    assert (q.kind, q.source) == ("tier", "model-quality-cpu-x86_64-20261206T000000.json")
    assert set(q.by_format) == {"int4/token", "int8/token", "int2/token"}
    by = {r["host_format"]: r for r in tier_rows[:2]}
    assert q.get("int4/token").mean_kl == by["int4/token"]["mean_kl"] and q.get("int2/token").agreement == 0.25
    assert format_quality.costs_of_run({"rows": newer["rows"]}, "scheme")["fp16"].mean_kl == 0.0  # tier rows apart
    smoke = {**newer, "mode": "smoke", "meta": {**doc["meta"], "date": "2026-12-07T00:00:00Z"}}
    (tmp_path / "model-quality-cpu-x86_64-20261207T000000.json").write_text(json.dumps(smoke))
    assert format_quality.quality_costs(tmp_path).source == "model-quality-cpu-x86_64-20261206T000000.json"
    empty = format_quality.quality_costs(tmp_path / "none")
    assert (empty.by_format, empty.source, empty.describe()) == ({}, "", "no committed model_quality run")
    with pytest.raises(ValueError, match="results_dir must be"):
        format_quality.quality_costs(3)
    with pytest.raises(ValueError, match="kind must be"):
        format_quality.costs_of_run({"rows": []}, "both")


# ---- the study and its panel --------------------------------------------------------------------------------------
def test_study_point_is_the_tables_row_with_its_quality():
    s = sweeps.get("tier_formats")
    assert s is tier_studies.FORMAT_PER_TIER and s.param("format").choices == fc.TIER_FORMATS
    rng = random.Random(11)
    for _ in range(6):
        params = {**s.defaults(), "format": rng.choice(("fp16", "int8/token", "int4/token", "int2/token")),
                  "block_size": rng.choice((16, 64)), "batch": rng.choice((4, 64)),
                  "link": rng.choice(("host", "disk", "flat")), "transcode": rng.choice((0.1, 0.5))}
        row = s.point(**params)
        table, _ = tier_studies.formats_table(**{k: v for k, v in params.items() if k != "format"})
        want = table.row(params["format"])
        assert {k: row[k] for k in want if k != "format"} == {k: v for k, v in want.items() if k != "format"}
        measured = tier_studies.measured_transcodes().get(params["format"])  # a committed run's, else assumed
        assert row["quality_source"] == tier_studies.quality_table().source
        assert row["transcode_source"] == (measured[0].source if measured else "assumed")
    with pytest.raises(ValueError, match="int4/kivi cannot store 16-token blocks"):
        s.point(**{**s.defaults(), "format": "int4/kivi"})


def test_format_panel_shows_the_studys_rows():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from workbench.ui.tier_panels import format_panel

    s = tier_studies.FORMAT_PER_TIER
    p = format_panel()
    assert list(p.controls) == list(s.controls) and p.controls["bandwidth_gbps"].disabled
    for change in ({}, {"format": "int2/token", "block_size": 64}, {"link": "flat", "bandwidth_gbps": 4096},
                   {"format": "fp16", "link": "disk", "model": "llama3-8b"}):
        for name, value in change.items():
            p.controls[name].value = value
        r = p.compute()
        row = s.point(**p.values())
        shown = next(x for x in r["rows"] if x["format"] == p.values()["format"])
        assert shown["down_tokens_per_s"] == row["down_tokens_per_s"] and shown["mean_kl"] == row["mean_kl"]
        assert p.status.value == "" and p.controls["bandwidth_gbps"].disabled == (p.values()["link"] != "flat")
    p.reset()
    p.controls["format"].value = "int4/kivi"  # cannot store 16-token blocks: said, not an error
    assert p.status.value == "" and p.headline().startswith("int4/kivi cannot store 16-token blocks")
    ringed = [c for c in p.figure.data[0].marker.line.color if c != "rgba(0,0,0,0)"]
    assert not ringed and "int4/kivi" not in list(p.figure.data[0].x)
    p.reset()
    row = s.point(**p.values())  # the default: the transcode as the newest committed run measured it
    assert p.headline().startswith(f"int4/token: {row['down_speedup']:.2f}x fp16 down")
    assert all(math.isfinite(y) for y in p.figure.data[0].y)
    assert p.controls["transcode"].disabled == bool(tier_studies.measured_transcodes())
    p.controls["transcode_from"].value = "assumed"  # what a kernel at the slider's fraction would buy
    assert not p.controls["transcode"].disabled
    assert "assumed" in p.compute()["setup"]["subtitle"]


def test_measured_transcodes_are_the_largest_rows_bandwidth_and_the_least_time():
    rng = random.Random(2)
    rows, want, floor = [], {}, {}
    for fmt in ("int8/token", "int4/token"):
        for op in ("encode", "decode"):
            fr = [rng.uniform(0.2, 0.9) for _ in range(3)]
            size = rng.sample([1 << 20, 1 << 24, 1 << 28], 3)  # bytes, in random order
            us = [rng.uniform(300.0, 3000.0) for _ in range(3)]
            want[(fmt, op)] = fr[size.index(max(size))]  # the fraction of the batch that moved the most bytes
            floor[(fmt, op)] = min(us) * 1e-6
            rows += [{"section": "formats", "kind": "transcode", "format": fmt, "op": op, "frac_copy": f,
                      "gbps": f * 4000.0, "bytes": b, "time_us": t} for f, b, t in zip(fr, size, us, strict=True)]
    rows += [{"section": "formats", "kind": "transcode", "format": "int2/token", "op": "encode", "frac_copy": 0.5,
              "gbps": 2000.0},  # decode unmeasured: left out
             {"section": "formats", "kind": "transcode", "format": "fp8_e4m3/token", "op": "encode",
              "frac_copy": None, "gbps": None},  # a smoke run's row
             {"section": "link", "format": "int4/token", "frac_copy": 0.1}]
    got = fc.measured_transcodes(rows, "tiers-h200-x.json")
    assert set(got) == {"int8/token", "int4/token"}
    for fmt, (down, up) in got.items():
        assert (down.fraction, up.fraction) == (want[(fmt, "encode")], want[(fmt, "decode")])
        assert (down.floor_s, up.floor_s) == pytest.approx((floor[(fmt, "encode")], floor[(fmt, "decode")]))
        assert down.copy_gbps == pytest.approx(4000.0) and down.source == up.source == "tiers-h200-x.json"
    assert fc.measured_transcodes(rows[-3:], "x") == {}
    t = fc.format_table(SMOL, 16, ("fp16", "int4/token", "int2/token"), got, batch=64, link=55.0)
    assert t.row("int4/token")["down_transcode_s"] == fc.format_cost(SMOL, 16, "int4/token", batch=64, link=55.0,
                                                                    transcode=got["int4/token"])["down_transcode_s"]
    assert t.row("int2/token")["up_transcode_s"] == fc.format_cost(SMOL, 16, "int2/token", batch=64,
                                                                  link=55.0)["up_transcode_s"]  # the assumed one


def test_a_transcode_takes_its_floor_at_least():
    rng = random.Random(5)
    for _ in range(30):
        frac, floor = rng.uniform(0.05, 1.0), rng.choice((0.0, rng.uniform(1e-5, 2e-3)))
        t = fc.Transcode(frac, floor_s=floor)
        read, written = rng.randint(1, 1 << 30), rng.randint(1, 1 << 30)
        assert t.seconds(read, written) == pytest.approx(max(floor, (read + written) / (frac * fc.H200_COPY_GBPS
                                                                                        * 1e9)), rel=1e-12)
    # a small batch on the host link: the floor, not the bytes, sets the format's time (and it can lose to fp16)
    slow = fc.format_cost(SMOL, 16, "int4/token", batch=4, link=55.0, transcode=fc.Transcode(0.3, floor_s=6e-4))
    assert slow["down_transcode_s"] == 6e-4 and slow["down_speedup"] < 1
