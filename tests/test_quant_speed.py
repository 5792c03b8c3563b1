"""workbench.results.quant_speed (the error study joined with the measured decode run: bytes, error and speed per
scheme, the 3-way Pareto front) and its figure (workbench.figures.quant.speed_overview), on random rows."""

import json
import random
import re
import statistics

import pytest

from workbench.publish.notebook import Bound
from workbench.results import quant_speed
from workbench.results.quant_speed import format_speed_rows, run_label, speed_front, speed_rows
from workbench.ui import quant_panels

WORKLOADS = ("W1", "W2", "W3", "W4", "W5")


def _random_rows(seed: int, n: int = 14, untimed: int = 4, missing_workload: bool = True):
    """``n`` schemes (fp16 first) with random bytes and errors; all but ``untimed`` timed on W1-W5 with random
    speed-ups (one scheme on four workloads only when ``missing_workload``)."""
    rng = random.Random(seed)
    schemes = [{"scheme": "fp16", "title": "FP16", "family": "fp16", "bytes_per_token": 768.0,
                "attn_err": rng.uniform(1e-4, 1e-3)}]
    for i in range(1, n):
        fam = rng.choice(["int8", "int4", "fp8_e4m3"])
        schemes.append({"scheme": f"{fam}/s{i}", "title": f"scheme {i}", "family": fam,
                        "bytes_per_token": float(rng.choice([144, 240, 300, 384, 408, 432])),
                        "attn_err": rng.uniform(1e-3, 1.0)})
    timed = [s["scheme"] for s in schemes[: n - untimed]]
    decode = []
    for w_i, w in enumerate(WORKLOADS):
        scale = 4.0 if w == "W4" else 1.0  # a workload with 4x the kv heads: 4x the bytes, the same ratio
        for s in schemes:
            if s["scheme"] not in timed or (missing_workload and s["scheme"] == timed[1] and w_i == 2):
                continue
            decode.append({"workload": w, "scheme": s["scheme"], "gpu": "NVIDIA H200",
                           "speedup_vs_fp16": 1.0 if s["scheme"] == "fp16" else rng.uniform(0.3, 3.0),
                           "bw_fraction": rng.uniform(0.1, 1.0),
                           "bytes_per_token": scale * 4096 * s["bytes_per_token"] / 768})
    rng.shuffle(decode)
    return schemes, decode


def _dominates(a, b, tol):
    as_good = (a["bytes_per_token"] <= b["bytes_per_token"] and a["attn_err"] <= b["attn_err"]
               and a["speedup"] >= b["speedup"] * (1 - tol))
    better = (a["bytes_per_token"] < b["bytes_per_token"] or a["attn_err"] < b["attn_err"]
              or a["speedup"] > b["speedup"] * (1 + tol))
    return as_good and better


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tol", [0.0, 0.02, 0.2])
def test_speed_rows_join_medians_and_the_front_on_random_rows(seed, tol):
    schemes, decode = _random_rows(seed)
    rows = speed_rows(schemes, decode, tolerance=tol)
    assert [r["scheme"] for r in rows] == [s["scheme"] for s in schemes]  # order and every scheme kept
    for s, r in zip(schemes, rows, strict=True):
        assert {k: r[k] for k in s} == s  # the study's columns as they were
        mine = [d for d in decode if d["scheme"] == s["scheme"]]
        if not mine:
            assert (r["speedup"], r["speedup_min"], r["speedup_max"], r["bw_fraction"], r["bytes_limit"],
                    r["of_limit"], r["workloads"], r["on_front"]) == (None, None, None, None, None, None, 0, False)
            continue
        speeds = [d["speedup_vs_fp16"] for d in mine]
        assert r["speedup"] == pytest.approx(statistics.median(speeds))
        assert (r["speedup_min"], r["speedup_max"], r["workloads"]) == (min(speeds), max(speeds), len(speeds))
        assert r["bw_fraction"] == pytest.approx(statistics.median(d["bw_fraction"] for d in mine))
        assert r["bytes_vs_fp16"] == pytest.approx(s["bytes_per_token"] / 768)  # the same on every workload
        assert r["bytes_limit"] == pytest.approx(768 / s["bytes_per_token"])
        assert r["of_limit"] == pytest.approx(r["speedup"] / r["bytes_limit"])
    timed = [r for r in rows if r["speedup"] is not None]
    want = [r for r in timed if not any(_dominates(o, r, tol) for o in timed if o is not r)]
    assert [r["scheme"] for r in rows if r["on_front"]] == [r["scheme"] for r in want]
    front = speed_front(rows, tolerance=tol)
    assert sorted(r["scheme"] for r in front) == sorted(r["scheme"] for r in want)
    keys = [(r["bytes_per_token"], r["attn_err"], -r["speedup"]) for r in front]
    assert keys == sorted(keys)  # fewest bytes first
    if tol == 0:  # exact comparisons: every timed scheme off the front is beaten by one on it
        for r in timed:
            assert r["on_front"] or any(_dominates(f, r, 0) for f in front), r["scheme"]


def test_front_keeps_ties_and_drops_what_is_beaten():
    def row(name, b, e, s):
        return {"scheme": name, "bytes_per_token": b, "attn_err": e, "speedup": s}

    rows = [row("a", 384, 0.05, 1.4), row("a2", 384, 0.05, 1.4),  # equal in all three: both on it
            row("b", 384, 0.06, 1.4),  # as many bytes, as fast, more error: beaten by a
            row("c", 384, 0.05, 1.1),  # beaten on speed alone
            row("d", 240, 0.10, 0.7), row("e", 240, 0.10, 0.71),  # 0.71 vs 0.7: equal within 2%
            row("f", 144, 0.9, None),  # not timed: on no front ...
            row("g", 144, 0.95, 0.7)]  # ... and beats nothing (g would be beaten by f at any speed >= 0.7)
    assert [r["scheme"] for r in speed_front(rows)] == ["g", "e", "d", "a", "a2"]  # fewest bytes, least error, fastest
    assert [r["scheme"] for r in speed_front(rows, tolerance=0)] == ["g", "e", "a", "a2"]  # 0.71 > 0.7 exactly
    assert [r["scheme"] for r in speed_front(rows, tolerance=0.3)] == ["g", "e", "d", "a", "a2", "c"]  # 1.4 ~ 1.1
    assert speed_front([]) == []
    assert [r["scheme"] for r in speed_front(rows, less=("bytes_per_token",), more=())] == ["f", "g"]


def test_a_scheme_equal_in_bytes_and_speed_with_more_error_is_off_the_front():
    schemes = [{"scheme": "fp16", "bytes_per_token": 768.0, "attn_err": Bound(7.6e-4)},
               {"scheme": "bf16", "bytes_per_token": 768.0, "attn_err": Bound(6.1e-3)},
               {"scheme": "int8/head", "bytes_per_token": 384.0, "attn_err": 0.035}]  # not in the run
    decode = [{"workload": w, "scheme": s, "speedup_vs_fp16": x, "bytes_per_token": 4096.0}
              for w, x in zip(WORKLOADS, (0.996, 0.998, 1.003, 1.003, 1.004), strict=True)
              for s, x in (("fp16", 1.0), ("bf16", x))]
    rows = speed_rows(schemes, decode)
    assert [r["on_front"] for r in rows] == [True, False, False]  # bf16's 0.3% is noise, its error is not
    assert rows[1]["speedup"] == 1.003 and rows[2]["speedup"] is None
    assert [r["on_front"] for r in speed_rows(schemes, decode, tolerance=0)] == [True, True, False]
    assert speed_rows(schemes, []) == [{**s, "speedup": None, "speedup_min": None, "speedup_max": None,
                                        "bw_fraction": None, "bytes_vs_fp16": None, "bytes_limit": None,
                                        "of_limit": None, "workloads": 0, "on_front": False} for s in schemes]
    no_fp16 = [d for d in decode if d["scheme"] != "fp16"]  # no baseline in the run: no byte ratio
    assert speed_rows(schemes, no_fp16)[1]["bytes_limit"] is speed_rows(schemes, no_fp16)[1]["of_limit"] is None


def test_bad_input_is_refused_by_name():
    schemes, decode = _random_rows(0)
    with pytest.raises(ValueError, match=r"schemes\[1\] lacks the columns \['attn_err'\]"):
        speed_rows([schemes[0], {"scheme": "x", "bytes_per_token": 1.0}], decode)
    with pytest.raises(ValueError, match=r"decode\[0\] lacks the columns \['speedup_vs_fp16'\]"):
        speed_rows(schemes, [{"workload": "W1", "scheme": "fp16"}])
    with pytest.raises(ValueError, match="appear more than once"):
        speed_rows([schemes[0], schemes[0]], decode)
    with pytest.raises(ValueError, match=r"\('W1', 'fp16'\) appears twice"):
        speed_rows(schemes, decode + [d for d in decode if (d["workload"], d["scheme"]) == ("W1", "fp16")])
    with pytest.raises(ValueError, match="schemes: a list of rows"):
        speed_rows(schemes[0], decode)
    with pytest.raises(ValueError, match="tolerance must be in"):
        speed_rows(schemes, decode, tolerance=1.5)
    with pytest.raises(ValueError, match="name no column"):
        speed_front([], less=(), more=())
    with pytest.raises(ValueError, match=r"rows\[0\]: a dict expected"):
        format_speed_rows([1])


@pytest.mark.parametrize("value, shown", [(0.095500305, "0.096"), (0.0954999, "0.096"), (0.09544, "0.095"),
                                          (0.0999, "0.10"), (1.9953, "2.0"), (3.2e-5, "3.2e-05"), (0.0, "0.0"),
                                          (Bound(7.6e-4), "< 1e-03")])
def test_errors_show_two_digits_rounded_from_the_stable_three(value, shown):
    row = {"scheme": "x", "bytes_per_token": 1.0, "attn_err": value, "speedup": None, "speedup_min": None,
           "speedup_max": None, "bw_fraction": None, "bytes_limit": None, "of_limit": None, "on_front": False}
    assert format_speed_rows([row])[0]["attn_err"] == shown


def test_run_label_and_the_printed_precision():
    schemes, decode = _random_rows(3)
    assert run_label(decode) == "H200, median W1-W5" and run_label([]) == ""
    assert run_label([{**decode[0], "workload": "W2"}]) == "H200, median W2"
    rows = speed_rows([{**schemes[0], "attn_err": Bound(schemes[0]["attn_err"])}, *schemes[1:]], decode)
    shown = format_speed_rows(rows)
    assert shown[0]["attn_err"] == "< 1e-03" and shown[0]["speedup"] == "1.00 (1.00-1.00)"
    for r, s in zip(rows[1:], shown[1:], strict=True):
        assert float(s["attn_err"]) == pytest.approx(r["attn_err"], rel=0.051)
        assert len(s["attn_err"].split("e")[0].replace(".", "").lstrip("0")) == 2, s["attn_err"]
        assert s["bytes_per_token"] == str(round(r["bytes_per_token"]))
        assert s["on_front"] == ("*" if r["on_front"] else "")
        if r["speedup"] is None:
            assert s["speedup"] == s["bw_fraction"] == s["bytes_limit"] == s["of_limit"] == "-"
        else:
            assert re.fullmatch(r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", s["speedup"]), s["speedup"]
            assert all(re.fullmatch(r"\d+\.\d\d", s[c]) for c in ("bw_fraction", "bytes_limit", "of_limit"))


def test_the_committed_run_joins_by_scheme_name():
    run = quant_panels.h200_decode_run()
    decode = quant_panels.h200_decode_rows()
    names = list(dict.fromkeys(r["scheme"] for r in decode))
    rng = random.Random(1)
    schemes = [{"scheme": n, "bytes_per_token": float(rng.randint(100, 800)), "attn_err": rng.random()}
               for n in [*names, "int8/head"]]
    rows = {r["scheme"]: r for r in speed_rows(schemes, decode)}
    w = [r["speedup_vs_fp16"] for r in decode if r["scheme"] == "fp8_e4m3/tensor"]
    assert rows["fp8_e4m3/tensor"]["speedup"] == pytest.approx(statistics.median(w))
    assert rows["fp8_e4m3/tensor"]["bytes_limit"] == pytest.approx(2.0)  # one byte a value, static scales
    assert rows["int8/head"]["speedup"] is None and run_label(decode).startswith(run["info"]["gpu"][7:])


def test_the_newest_run_is_the_one_joined(tmp_path):
    def write(name, date, speed, **extra):
        rows = [{"section": "decode", "workload": "W1", "scheme": s, "variant": "heuristic", "time_us": 1.0,
                 "speedup_vs_fp16": x} for s, x in (("fp16", 1.0), ("int4/token", speed))]
        meta = {"gpu": "NVIDIA H200", "date": date}
        (tmp_path / name).write_text(json.dumps({"meta": meta, "tune": False, **extra, "rows": rows}))

    write("quant-decode-h200-20261205T021116.json", "2026-12-05T02:11:16Z", 0.67)
    write("quant-decode-h200-20261206T101010.json", "2026-12-06T10:10:10Z", 3.4)  # a later run ...
    write("quant-decode-h200-20261207T101010.json", "2026-12-07T10:10:10Z", 9.9, smoke=True)  # ... smoke: not
    run = quant_panels.h200_decode_run(tmp_path)
    assert run["path"].name == "quant-decode-h200-20261206T101010.json"
    schemes = [{"scheme": "int4/token", "bytes_per_token": 240.0, "attn_err": 0.15}]
    assert speed_rows(schemes, quant_panels.h200_decode_rows(tmp_path))[0]["speedup"] == 3.4


# ---- the figure --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_speed_overview_draws_every_scheme_the_front_and_the_limit(seed):
    pytest.importorskip("plotly")
    from workbench.figures.quant import NO_DECODE, speed_overview

    schemes, decode = _random_rows(seed)
    reference = {"scheme": "fp32", "family": "fp32", "bytes_per_token": 1536.0, "attn_err": 0.0}  # no log point
    rows = speed_rows([*schemes, reference], decode)
    fig = speed_overview(rows, run_label(decode), "quant-decode-h200-x.json")
    assert 1536.0 not in [x for t in fig.data if t.xaxis == "x" for x in t.x]
    by = {t.name: t for t in fig.data}
    timed = [r for r in rows if r["speedup"] is not None]
    colored = next(t for t in fig.data if t.marker.colorbar.title.text)
    assert list(colored.marker.color) == [r["speedup"] for r in timed]
    assert "speed-up over fp16" in colored.marker.colorbar.title.text and "H200, median W1-W5" in \
        colored.marker.colorbar.title.text
    assert len(by["3-way front"].x) == sum(r["on_front"] for r in rows) and len(by["not timed"].x) == 4
    limit = by["limit: fp16 bytes / bytes read"]
    assert all(y == pytest.approx(1 / x) for x, y in zip(limit.x, limit.y, strict=True))
    assert min(limit.x) < min(r["bytes_vs_fp16"] for r in timed) and max(limit.x) > 1
    fams = [t for t in fig.data if t.legend == "legend2" and t.mode == "markers"]
    assert sorted(y for t in fams for y in t.y) == sorted(r["speedup"] for r in timed)
    r = timed[1]
    hover = next(h for t in fig.data for h in (t.hovertext or ()) if h.startswith(r["title"] + "<br>"))
    assert f"{r['speedup']:.2f}" in hover and f"{r['bytes_per_token']:.0f} B" in hover
    for ax in (fig.layout.xaxis, fig.layout.yaxis, fig.layout.xaxis2, fig.layout.yaxis2):
        assert " " in ax.title.text and not re.fullmatch(r"[A-Za-z0-9]+(_[A-Za-z0-9]+)+", ax.title.text)
    assert f"{sum(r['on_front'] for r in rows)} of {len(timed)} timed" in fig.layout.title.text
    assert NO_DECODE not in [a.text for a in fig.layout.annotations]

    empty = speed_overview(speed_rows(schemes, []), "")
    assert NO_DECODE in [a.text for a in empty.layout.annotations]
    assert "no scheme timed" in empty.layout.title.text and [t.name for t in empty.data] == ["not timed"]
    with pytest.raises(ValueError, match="rows is empty"):
        speed_overview([], "")


def test_module_constants_name_the_front_columns():
    assert quant_speed.LESS == ("bytes_per_token", "attn_err") and quant_speed.MORE == ("speedup",)
    assert 0 < quant_speed.SPEED_TOLERANCE < 0.05
