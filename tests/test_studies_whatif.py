"""The what-if study (``workbench.studies.whatif``): a point is one ``whatif()`` run as a flat row, the sweep runs it
through the sweep runner, and the panels show the sweep's rows for the same parameters."""

from __future__ import annotations

import math
import random
import re

import pytest

from workbench import sweeps
from workbench.studies import whatif as wi
from workbench.sweeps import runner
from workbench.whatif import report
from workbench.whatif.serve import Knobs

N = 40  # requests a test run: a few hundredths of a second


def params(**kw):
    return {**wi.WHATIF.defaults(), "n": N, **kw}


def test_the_sweep_is_registered_and_its_default_point_has_every_plotted_column():
    s = sweeps.get("whatif")
    assert s is wi.WHATIF and s.notebook == "10_serving_whatif"
    row = s.point(**params())
    assert set(s.y) <= set(row) and not set(row) & {p.name for p in s.params}
    for k in s.y:
        assert isinstance(row[k], int | float) and math.isfinite(row[k]), (k, row[k])
    assert s.point(**params()) == row  # a pure function of its parameters
    assert row["step_s"] == pytest.approx(sum(row[f"step_{p}_s"] for p in wi.PARTS))
    assert all(s.column(k) is not None for k in row if not k.endswith("source") and k not in ("budget",
                                                                                              "profile_files"))


def test_the_choices_are_what_the_committed_runs_measured():
    prof = report.default_profile("h200")
    assert set(wi.SCHEMES) <= set(prof.schemes)
    for policy in wi.POLICIES:
        for keep in wi.KEEPS[1:]:
            row = wi.whatif_point(**params(keep=keep, policy=policy))
            assert f"{policy} at budget {keep:g}" in row["eviction_quality_source"]


def test_knobs_follow_the_controls():
    k = wi.knobs(64, wi.AUTO, "recompute", 16.0, "int4/token", 1.0, "snapkv")
    assert k == Knobs(block_size=64, kv_gib=None, preemption="recompute", host_gib=0.0, host_format=None)
    k = wi.knobs(16, 4.0, "swap", 16.0, "int4/token", 0.25, "snapkv")
    assert (k.kv_gib, k.host_gib, k.host_format, k.keep, k.policy) == (4.0, 16.0, "int4/token", 0.25, "snapkv")
    assert wi.knobs(16, 4.0, "swap", 16.0, wi.SAME, 1.0, "h2o").host_format is None


@pytest.mark.parametrize("change, match", [({"profile": "a100"}, "profile must be one of"),
                                           ({"trace": "lmsys"}, "trace must be one of"),
                                           ({"scheme": "int3/token"}, "scheme"),
                                           ({"model": "gpt-5"}, "model must be one of")])
def test_bad_parameters_are_refused_naming_them(change, match):
    with pytest.raises(ValueError, match=match):
        wi.run(**params(**change))


def test_a_point_under_memory_pressure_preempts_and_a_smaller_scheme_does_not():
    rng = random.Random(35)
    seed = rng.randrange(1000)
    fp16 = wi.whatif_point(**params(kv_gib=1.0, rate=64.0, n=120, seed=seed))
    int4 = wi.whatif_point(**params(kv_gib=1.0, rate=64.0, n=120, seed=seed, scheme="int4/token"))
    assert fp16["peak_share"] == 1.0 and fp16["preemptions"] > 0
    assert int4["kv_blocks"] > 3 * fp16["kv_blocks"] and int4["preemptions"] < fp16["preemptions"]
    assert int4["agreement"] < fp16["agreement"] == 1.0
    assert "model-quality-" in int4["quality_source"]


def test_the_host_columns_say_what_the_swapped_blocks_cost():
    plain = wi.whatif_point(**params())
    assert (plain["host_agreement"], plain["host_quality_source"]) == (1.0, "no host tier")
    same = wi.whatif_point(**params(preemption="swap"))
    assert same["host_mean_kl"] == 0.0 and same["host_quality_source"] == "the device's own bytes on the host"
    lossy = wi.whatif_point(**params(preemption="swap", host_format="int2/token"))
    assert lossy["host_mean_kl"] > 0 and "int2/token" in lossy["host_quality_source"]


def test_run_hands_out_copies_of_the_runs_it_keeps():
    out = wi.run(**params(seed=3))
    out["summary"]["throughput_tok_s"] = -1.0
    assert wi.run(**params(seed=3))["summary"]["throughput_tok_s"] > 0


def test_frontier_rows_are_the_sweeps_points():
    rows = wi.frontier(("fp16", "int8/token"), (2.0, 32.0), **{k: v for k, v in params().items()
                                                              if k not in ("scheme", "rate")})
    assert [(r["scheme"], r["rate"]) for r in rows] == [("fp16", 2.0), ("fp16", 32.0), ("int8/token", 2.0),
                                                       ("int8/token", 32.0)]
    for r in rows:
        assert {k: v for k, v in r.items() if k not in ("scheme", "rate")} == \
            wi.whatif_point(**params(scheme=r["scheme"], rate=r["rate"]))
    with pytest.raises(ValueError, match="non-empty"):
        wi.frontier((), (2.0,), **{k: v for k, v in params().items() if k not in ("scheme", "rate")})


def test_a_tiny_sweep_runs_through_the_runner_in_process(tmp_path):
    result = runner.run("whatif", {"scheme": ["fp16", "int4/token"], "rate": [2.0, 8.0], "n": [N], "seed": [5]},
                        out=tmp_path, progress=False)
    assert result.ran == 4 and not result.failed and result.csv_path.is_file() and result.json_path.is_file()
    for row in result.rows:  # the tidy row is the point's, the parameters beside it
        want = wi.whatif_point(**{p.name: row[p.name] for p in wi.WHATIF.params})
        assert all(row[k] == want[k] or (isinstance(want[k], float) and math.isnan(want[k])) for k in want)
    again = runner.run("whatif", {"scheme": ["fp16", "int4/token"], "rate": [2.0, 8.0], "n": [N], "seed": [5]},
                       out=tmp_path, progress=False)
    assert again.ran == 0 and again.reused == 4


def test_why_table_names_each_parts_kind_and_files():
    out = wi.run(**params(scheme="int4/token", rate=16.0))
    rows = wi.why_table(out)
    assert [r["part"] for r in rows] == list(wi.PARTS)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    kinds = {r["part"]: r["kind"] for r in rows}
    assert kinds == {"weights": "measured + assumed", "attention": "measured", "write": "measured",
                     "overhead": "fitted"}
    assert all(r["files"].endswith(".json") for r in rows)
    assert [r["part"] for r in wi.why_table(out, "prefill")] == ["prefill", "overhead"]
    with pytest.raises(ValueError, match="step must be"):
        wi.why_table(out, "decode_at")


def test_sources_are_read_for_their_files_and_kinds():
    rng = random.Random(7)
    name = f"quant-decode-h200-2026{rng.randrange(10**8):08d}.json"
    assert wi.files_of(f"12 MB at 0.8 ({name}; {name})") == [name]
    assert wi.kind_of(f"x ({name}: fp16 decode)") == "measured"
    assert wi.kind_of(f"x ({name}; assumed: 0.8)") == "measured + assumed"
    assert wi.kind_of(f"32 layers x 35 us (fitted: {name} batch 1)") == "fitted"
    assert wi.kind_of("assumed: H200 datasheet") == "assumed" and wi.kind_of("4 GiB given") == "given"
    assert wi.trace_label("sharegpt_synth") == "ShareGPT-like" and wi.trace_label("mine") == "mine"


def test_inputs_give_every_number_a_kind_and_a_source():
    rows = wi.inputs("h200", ("fp16", "int4/token"))
    assert {r["input"] for r in rows} >= {"copy_gbps", "launch_us", "gemv_frac", "decode_frac int4/token",
                                         "write_frac fp16", "host link"}
    assert all(r["kind"] in ("measured", "fitted", "assumed") and r["source"] and r["note"] for r in rows)
    kinds = {r["input"]: r["kind"] for r in rows}
    assert kinds["launch_us"] == "fitted" and kinds["copy_gbps"] == "measured" and kinds["hbm_gib"] == "assumed"
    text = wi.inputs_text("h200", ("int8/token",))
    assert "quant-decode-h200-" in text and "decode int8/token (of copy)" in text
    assert max(len(line) for line in text.splitlines()) <= 105
    rng = random.Random(17)
    name = f"tiers-h200-2026{rng.randrange(10**4):04d}T{rng.randrange(10**6):06d}.json"
    assert wi.bench_of(f"{name}: link") == "tiers: link"


def test_the_validation_text_quotes_the_step_and_the_paper_in_short_lines():
    text = wi.validation_text(n=60)
    lines = text.splitlines()
    assert "model-decode-h200-" in lines[0] and "fitted here" in lines[1] and "error" in lines[2]
    assert "paper 1.7-2.7x" in text and "paper 2.7-8x" in text
    assert max(len(line) for line in lines) <= 105


def test_brief_and_the_frontier_table_fit_a_line():
    rng = random.Random(13)
    rates = sorted(rng.sample(wi.RATES, 3))
    rows = wi.frontier(("fp16", "int4/token"), rates, **{k: v for k, v in params(kv_gib=1.0).items()
                                                         if k not in ("scheme", "rate")})
    table = wi.frontier_table(rows).splitlines()
    assert len(table) == 4 and table[2].startswith("fp16") and table[3].startswith("int4/token")
    assert table[2].split("|")[-1].split() == [str(r["preemptions"]) for r in rows[:3]]
    assert max(len(line) for line in table) <= 100
    lines = wi.brief(wi.run(**params(scheme="int4/token", kv_gib=1.0, keep=0.25))).splitlines()
    assert "tokens/s" in lines[0] and lines[1].endswith("K/V 0.461, evicted prompts 0.903")
    assert max(len(line) for line in lines) <= 100


def test_the_summary_is_short_lines_of_three_significant_digits():
    rng = random.Random(11)
    out = wi.run(**params(scheme="int8/token", rate=rng.choice(wi.RATES), kv_gib=2.0, preemption="swap",
                          host_format="int4/token", keep=0.5, policy="snapkv", seed=rng.randrange(100)))
    text = wi.summary(out)
    assert "int8/token K/V" in text and "snapkv keeping 50%" in text and "int4/token on the host" in text
    assert max(len(line) for line in text.splitlines()) <= 105
    for m in re.finditer(r"(?<![\w.-])\d[\d,]*\.\d+", text):  # a float (not a count, a file name's date)
        assert len(m.group().replace(",", "").replace(".", "").lstrip("0")) <= 3, m.group()


def test_the_run_panel_shows_the_sweeps_point():
    pytest.importorskip("ipywidgets")
    from workbench.ui.whatif_panels import run_panel

    panel = run_panel(n=N, scheme="int4/token")
    assert list(panel.controls) == list(wi.WHATIF.controls)
    assert panel.controls["host_gib"].disabled and panel.controls["policy"].disabled
    panel.controls["keep"].value = 0.25
    panel.controls["preemption"].value = "swap"
    assert not panel.controls["policy"].disabled and not panel.controls["host_gib"].disabled
    r = panel.compute()
    assert r["out"] == wi.run(**params(**panel.values()))
    row = wi.whatif_point(**params(**panel.values()))
    assert r["out"]["summary"]["throughput_tok_s"] == row["throughput_tok_s"]
    assert "int4/token K/V" in panel.headline() and not panel.status.value
    panel.reset()
    assert panel.values()["keep"] == 1.0 and panel.values()["scheme"] == "int4/token"


def test_the_frontier_panel_draws_the_sweeps_points():
    pytest.importorskip("ipywidgets")
    from workbench.ui.whatif_panels import frontier_panel

    panel = frontier_panel(("fp16", "int4/token"), (2.0, 32.0), n=N, kv_gib=2.0)
    assert panel.values()["scheme"] == "int4/token" and panel.values()["kv_gib"] == 2.0
    rows = panel.compute()["rows"]
    assert [(r["scheme"], r["rate"]) for r in rows] == [("fp16", 2.0), ("fp16", 32.0), ("int4/token", 2.0),
                                                       ("int4/token", 32.0)]
    for r in rows:
        assert r["throughput_tok_s"] == wi.whatif_point(**params(scheme=r["scheme"], rate=r["rate"],
                                                                 kv_gib=2.0))["throughput_tok_s"]
    panel.controls["quality"].value = "mean_kl"
    assert panel.figure.layout.yaxis3.title.text == "mean KL against fp16 (0 not drawn)"  # fp16 is 0
    with pytest.raises(ValueError, match="not its controls"):
        frontier_panel(("fp16",), (2.0,), n=N, host_gib=4.0)
    with pytest.raises(ValueError, match="rate: expected one of"):
        frontier_panel(("fp16",), (3.0,), n=N)
