"""The package functions notebooks 06 (a real model through the paged cache) and 09 (write your own kernel) call
instead of computing or formatting in their cells: on hand-made data, fakes and one exported case (no model file,
no kernel run)."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from workbench import conformance
from workbench.cache import PagedKVCache
from workbench.conformance import exchange, implementations, judge, starter, suite
from workbench.conformance.problems import Case
from workbench.figures import conformance as cf
from workbench.model import agreement, inspect
from workbench.model.capture import PROMPTS, prompts_by_name
from workbench.model.runner import Generation
from workbench.results import byok

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

FIXTURES = Path(__file__).resolve().parent / "fixtures"


class FakeTokenizer:
    def chat(self, user, system=None):
        return [1, 2, 3] + [100 + ord(c) % 50 for c in user]

    def encode(self, text):
        return [100 + ord(c) % 50 for c in text]

    def decode(self, ids, skip_special=False):
        return "-".join(map(str, ids))


def snap(index, event, tables, lengths, bs=4):
    ids = [(i, 0) for i in range(len(tables))]
    return inspect.Snapshot(index, event, tuple(ids), tuple(tuple(t) for t in tables),
                            tuple(tuple(range(n)) for n in lengths), bs, 0)


# ---- notebook 06 ---------------------------------------------------------------------------------------------------
def test_common_prefix():
    assert inspect.common_prefix([1, 2, 3, 4], [1, 2, 9], [1, 2, 3]) == 2
    assert inspect.common_prefix([1, 2], [1, 2, 3]) == 2 and inspect.common_prefix([5], [6]) == 0
    assert inspect.common_prefix() == 0 and inspect.common_prefix([7, 8]) == 2


def test_describe_layout_and_prompts():
    cfg = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=3, head_dim=64, num_attention_heads=9,
                          kv_bytes_per_token=2 * 2 * 2 * 3 * 64)
    cache = PagedKVCache(2, 3, 64, 4, page_tokens=16, kv_dtype="fp16")
    text = inspect.describe_layout(cfg, cache, 16)
    assert text.splitlines()[0].startswith("2 layers x 3 kv heads x 64 dims (9 query heads): 384 B of K")
    assert f"pool {tuple(cache.pool.shape)}" in text and f"{cache.block_stride(16) * 2} B per layer and plane" in text
    tok = FakeTokenizer()
    prompts = [list(range(20)), list(range(18)) + [99, 98, 97]]
    lines = inspect.describe_prompts(tok, "first\n\n second \n", prompts, 16).splitlines()
    assert lines[0] == "'first'           : 20 tokens = 1 full blocks + 4 tokens in block 1"
    assert lines[1].startswith("'second'") and "21 tokens" in lines[1]
    assert lines[2] == f"the prompts agree on their first 18 tokens: {tok.decode(list(range(16)))!r} fills block 0"
    with pytest.raises(ValueError, match="one token list per non-empty line"):
        inspect.describe_prompts(tok, "one line", prompts)


def test_describe_tokens_and_same_tokens():
    tok = FakeTokenizer()
    a = Generation(prompts=[[1], [2]], tokens={(0, 0): [5, 6], (0, 1): [5, 7], (1, 0): [8]})
    assert inspect.describe_tokens(tok, a.tokens).splitlines() == ["(0, 0) [5, 6] '5-6'", "(0, 1) [5, 7] '5-7'",
                                                                   "(1, 0) [8] '8'"]
    base = Generation(prompts=[[1], [2]], tokens={(0, 0): [5, 6], (1, 0): [8]})
    assert inspect.same_tokens(a, base)  # sample 0 of each prompt; sample 1 is not in the baseline
    assert not inspect.same_tokens(a, Generation(prompts=[[1]], tokens={(0, 0): [5, 9]}))
    assert not inspect.same_tokens(Generation(prompts=[[1]], tokens={}), base)
    assert not inspect.same_tokens(a, Generation(prompts=[], tokens={}))  # nothing to compare is no evidence


def test_format_timeline_keeps_the_first_steps_prefills_forks_and_the_last():
    snaps = [snap(0, "prefill", [[0, 1]], [6]), snap(1, "fork", [[0, 1], [0, 1]], [6, 6]),
             snap(2, "step", [[0, 2], [0, 1]], [7, 7]), snap(3, "step", [[0, 2], [0, 1]], [8, 8]),
             snap(4, "step", [[0, 2, 3], [0, 1, 4]], [9, 9])]
    lines = inspect.format_timeline(snaps, upto=2).splitlines()
    assert lines[0].split()[:3] == ["#", "event", "seqs"]
    assert [ln.split()[0] for ln in lines[1:]] == ["0", "1", "2", "4"]  # step 3 left out
    row = inspect.timeline(snaps)[2]
    assert lines[3].split()[:8] == ["2", "step", "2", "14", str(row["blocks_in_use"]), str(row["blocks_unshared"]),
                                    str(row["shared_blocks"]), str(row["cow_copies"])]
    assert lines[3].endswith("[[0, 2], [0, 1]]")
    assert len(inspect.format_timeline(snaps, upto=10).splitlines()) == 6


def test_agreement_results_and_their_lines(monkeypatch):
    calls = []

    def fake(model, tok, tokens, new_tokens, scheme, ref, ops, calibration):
        calls.append((scheme, ref, ops, calibration))
        return {"scheme": scheme, "bytes": 240.0, "equal": 3, "new_tokens": new_tokens,
                "first_divergence": None if scheme == "int4/token" else 3}

    monkeypatch.setattr(agreement, "agreement_result", fake)
    results = agreement.agreement_results("m", "t", [1, 2], 4, ["int4/token", "int2/token"], "REF", "torch", "CAL",
                                        prompt="code")
    assert list(results) == [("int4/token", "code"), ("int2/token", "code")]
    assert calls == [("int4/token", "REF", "torch", "CAL"), ("int2/token", "REF", "torch", "CAL")]
    assert agreement.format_agreement(results).splitlines() == [
        "int4/token        240 B/token/layer: 3 of 4 tokens equal, first divergence None",
        "int2/token        240 B/token/layer: 3 of 4 tokens equal, first divergence 3"]


def _layer(i, ratios_pre, ratios_post, tops, sink0):
    return {"layer": i, "k_pre": {"ratio": ratios_pre, "top3": [[t, 0, 1] for t in tops]},
            "k": {"ratio": ratios_post, "top3": [[t, 0, 1] for t in tops]}, "sink0": sink0, "sink4": sink0 + 0.01}


STATS = {"layers": [_layer(0, [2.0, 4.0], [2.0, 3.0], [22, 5], 0.0), _layer(1, [5.0, 3.0], [4.5, 3.0], [55, 56], 0.6),
                    _layer(2, [8.0, 2.5], [6.0, 2.5], [1, 23], 0.3)]}


def test_kv_stats_summary_and_table():
    s = inspect.kv_stats_summary(STATS, (22, 23, 55, 56))
    assert s == {"layer_heads": 6, "top_in_channels": 4, "ratio_min": 2.0, "ratio_max": 8.0,
                 "rope_drop_median": 0.05, "rope_drop_max": 0.25, "sink0_max": 0.6, "sink0_max_layer": 1}
    assert inspect.kv_stats_summary(STATS)["top_in_channels"] == 0
    lines = inspect.format_kv_stats(STATS, every=2).splitlines()
    assert [ln.split()[0] for ln in lines[1:]] == ["0", "2"]  # every 2nd layer; the last (2) only once
    assert lines[1].split() == ["0", "2.0", "4.0", "22", "5", "2.0", "3.0", "0.00", "0.01"]
    assert [ln.split()[0] for ln in inspect.format_kv_stats(STATS, every=4).splitlines()[1:]] == ["0", "2"]


def test_kv_stats_or_capture_reads_the_file_else_captures_one(tmp_path, monkeypatch):
    from workbench.model import capture

    assert inspect.kv_stats_or_capture(None, [], "x") == inspect.kv_stats_sources()  # the committed stats.json
    monkeypatch.setattr(capture, "capture_kv", lambda model, tokens, name: ("captured", model, tuple(tokens), name))
    monkeypatch.setattr(capture, "kv_stats", lambda cap: {"layers": [cap], "tokens": len(cap[2])})
    got = inspect.kv_stats_or_capture("M", [4, 5], "code", path=tmp_path)  # no stats.json there
    assert got == {"code (captured now)": {"layers": [("captured", "M", (4, 5), "code")], "tokens": 2}}


def test_prompts_by_name():
    tok = FakeTokenizer()
    got = prompts_by_name(tok)
    assert list(got) == [p.name for p in PROMPTS]
    chat = next(p for p in PROMPTS if p.kind == "chat")
    text = next(p for p in PROMPTS if p.kind != "chat")
    assert got[chat.name] == tok.chat(chat.text) and got[text.name] == tok.encode(text.text)
    assert prompts_by_name(tok, PROMPTS[:1]) == {PROMPTS[0].name: tok.chat(PROMPTS[0].text)}


# ---- notebook 09 ---------------------------------------------------------------------------------------------------
CASE = "decode/nhd/bs16/d64/hkv2/g4/fp16/lens=37,0,1,150/pad0/seed1"


def _report(name, failed_lens=()):
    results = []
    for i, lens in enumerate(["37,0,1,150", "32,16", "37,0,1,150"]):
        case = Case.parse(CASE.replace("lens=37,0,1,150", f"lens={lens}").replace("seed1", f"seed{i}"))
        bad = lens in failed_lens
        results.append(judge.CaseResult(case, not bad, math.inf if bad else 1e-4, 1e-2,
                                        "non-finite output" if bad else ""))
    return suite.Report(name, "decode", "interpreter", results)


def test_caught_summary():
    reports = {"broken_mask": _report("broken_mask", ["37,0,1,150"]), "fine": _report("fine")}
    lines = cf.caught_summary(reports, ["lens", "kv_format"]).splitlines()
    assert lines[0] == "broken_mask: 2 of 3 cases failed; by context lengths: lens 37,0,1,150 2/2, lens 32,16 0/1"
    assert lines[1] == "  first caught by decode/nhd/bs16/d64/hkv2/g4/fp16/lens=37,0,1,150/pad0/seed0"
    assert lines[2] == "  why: non-finite output"
    assert lines[3] == "fine: 0 of 3 cases failed; by format: fp16 0/3" and lines[4] == "  no case caught it"
    with pytest.raises(ValueError, match="one axis per report"):
        cf.caught_summary(reports, ["lens"])
    with pytest.raises(ValueError, match="not one of"):
        cf.caught_summary(reports, ["lens", "colour"])


def test_check_mistakes_registers_each_and_checks_it_quietly(monkeypatch):
    checked = []
    monkeypatch.setattr(suite, "check_quietly", lambda name, level: checked.append((name, level)) or _report(name))
    try:
        got = starter.check_mistakes({"gqa": "group", "mask": "lens"}, level="pairwise", formats=("fp16",))
        assert list(got) == ["broken_gqa", "broken_mask"] and checked == [("broken_gqa", "pairwise"),
                                                                          ("broken_mask", "pairwise")]
        impl = conformance.get("broken_gqa", "decode")
        assert impl.origin == "user" and "'gqa' bug" in impl.description and "fp16" in impl.claims()
        assert got["broken_mask"].impl == "broken_mask"
        with pytest.raises(ValueError, match="mistakes must be among"):
            starter.check_mistakes(["none"])
    finally:
        for name in ("broken_gqa", "broken_mask"):
            if name in conformance.names("decode"):
                implementations.unregister("decode", name)


def test_format_check_reports():
    reports = [{"impl": "starter", "op": "decode", "level": "pairwise", "tag": "", "cases": 33, "passed": True,
                "failed": 0, "seconds": 14.04, "backend": "compiled (H200)"},
               {"impl": "ours", "op": "write", "level": "full", "tag": "cold", "cases": 4, "passed": False,
                "failed": 2, "seconds": None, "backend": "interpreter"}]
    assert byok.format_check_reports(reports).splitlines() == [
        "     starter decode  pairwise          33 cases: all passed  in 14.0 s, compiled (H200)",
        "        ours write   full (cold)        4 cases: 2 failed    in ? s, interpreter"]
    assert byok.format_check_reports([]) == ""


def test_format_bandwidth_on_the_fixture():
    run = byok.runs(FIXTURES)[0]
    bw = byok.bandwidth(run, "graph")
    lines = byok.format_bandwidth(bw).splitlines()
    assert lines[0].split() == bw.impls
    assert len(lines) == 1 + len(bw.workloads) + 1
    w2 = lines[2].split()
    assert w2[0] == "W2" and w2[2 + bw.impls.index("gather_sdpa")] == "-"  # untimed at this timing: no bar
    assert float(lines[1].split()[2]) == pytest.approx(bw.value(bw.impls[0], "W1")["frac"], abs=5e-4)
    assert lines[-1].startswith("absent: ") and "flashinfer (" in lines[-1]


def test_describe_problems(tmp_path):
    cases = conformance.cases_for(conformance.get("reference", "decode"), "smoke")[:1]
    paths = exchange.export_problems(cases, tmp_path)
    text = exchange.describe_problems(tmp_path)
    lines = text.splitlines()
    assert lines[0].startswith(paths[0].name) and lines[0].endswith(f"{paths[0].stat().st_size:>7} bytes")
    assert lines[1].startswith("manifest.json") and lines[2] == ""
    assert lines[3].startswith(f"{paths[0].name}: case {cases[0].id}, tolerance ")
    keys = {ln.split()[0] for ln in lines[4:]}
    assert {"q", "k_cache", "v_cache", "ref", "block_table", "seq_lens"} <= keys
    assert json.loads((tmp_path / "manifest.json").read_text())["problems"][0]["case"] == cases[0].id
    assert exchange.describe_problems(tmp_path, paths[0]) == text


# ---- the sweep panel both notebooks show: their committed sweeps vary one parameter ------------------------------
def test_sweep_panel_of_one_varying_parameter_offers_no_colour_and_holds_nothing(tmp_path, monkeypatch):
    from workbench.sweeps import runner, store, view
    from workbench.ui import sweep_panels

    monkeypatch.setattr(store, "COMMITTED", tmp_path / "none")  # only this test's files
    monkeypatch.setattr(store, "OUT", tmp_path / "none")
    one = runner.run("coalescing", {"layout": ["nhd", "vllm"], "kind": ["k"], "block_size": [16]}, out=tmp_path / "one",
                     progress=False)
    panel = sweep_panels.sweep_panel(one.json_path)
    assert list(panel.controls) == ["source", "y", "x", "color"]  # no at_layout: layout is always on x
    values = {name: [v for _, v in panel.controls[name].options] for name in ("x", "color")}  # (label, column)
    assert values == {"x": ["layout"], "color": [view.NO_COLOR]}
    assert [list(d.x) for d in panel.figure.data] == [["nhd", "vllm"]]
    two = runner.run("coalescing", {"layout": ["nhd", "vllm"], "kind": ["k", "v"], "block_size": [16]},
                     out=tmp_path / "two", progress=False)
    panel = sweep_panels.sweep_panel(two.json_path)
    assert {"at_layout", "at_kind"} <= set(panel.controls)
    assert [v for _, v in panel.controls["color"].options] == [view.NO_COLOR, "layout", "kind"]
