"""Bring your own kernel against a peer that crashes (issue 30, item 3): what an adapter claims, cases outside it
listed as unsupported (not failures), a case that kills its process or its CUDA context failing alone and named,
the journal that attributes a hard crash and lets ``--resume`` go on after it, and the same for ``bench decode
--impl``.

On a CPU the crashes are faked by a registered implementation (written to a file, so a spawned worker imports it):
``os._exit(1)`` on one case, and on another a raise of CUDA's sticky "misaligned address" that also poisons its
process, as a real sticky error does, so every later call there fails: only a replaced worker passes the next case.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from workbench import conformance as C
from workbench.__main__ import main
from workbench.conformance import cases as cases_mod
from workbench.conformance import isolation, peers
from workbench.conformance.implementations import make_impl
from workbench.conformance.journal import Journal
from workbench.conformance.problems import Case, empty_pool, row_alignment
from workbench.conformance.suite_formats import SUITE_FORMATS

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]  # the starter and ours run as Triton kernels

ISSUE_CASE = "decode/nhd/bs8/d80/hkv2/g4/bf16/lens=16,8/pad3/seed2"  # FlashInfer's "misaligned address" on the H200
OK1 = "decode/nhd/bs16/d64/hkv2/g4/fp16/lens=37,0,1,150/pad0/seed1"
OK2 = "decode/nhd/bs24/d64/hkv1/g1/fp16/lens=48,24/pad0/seed3"
CRASH = "decode/nhd/bs8/d64/hkv2/g4/fp16/lens=16,8/pad0/seed2"  # block size 8: os._exit(1)
STICKY = "decode/nhd/bs16/d80/hkv1/g1/fp16/lens=32,16/pad0/seed4"  # head dim 80: the fake sticky error

FAKE = '''
import os
from workbench import conformance
from workbench.conformance.builtin import reference_decode

POISONED = []  # a real sticky CUDA error makes every later call of the process fail: so does this one


def fake_peer(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, block_size,
              out):
    if POISONED:
        raise RuntimeError("CUDA error: unspecified launch failure (fake: an earlier call broke this process)")
    if block_size == 8 or int(seq_lens.max()) == 13:  # check: CRASH; bench decode --smoke: W3
        os._exit(1)
    if q.shape[-1] == 80 or q.shape[1] == 2:  # check: STICKY; bench decode --smoke: W4 (MHA, 2 heads)
        POISONED.append(1)
        raise RuntimeError("CUDA error: misaligned address (fake)")
    return reference_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant,
                            out)


conformance.register("decode", "fake_peer", fake_peer, layouts=("nhd",), formats=("fp16",))
'''


@pytest.fixture
def fake_file(tmp_path):
    path = tmp_path / "fake_peer_kernels.py"
    path.write_text(FAKE)
    yield path
    if "fake_peer" in C.names("decode"):
        C.unregister("decode", "fake_peer")


def _report(path):
    return json.loads(path.read_text())


def _by_case(doc):
    return {r["case"]: r for r in doc["cases"]}


# ------------------------------------------------------------------------------------------- what an adapter claims
def _flashinfer_like(fn=None, **over):
    from workbench.conformance.builtin import reference_decode

    return make_impl("decode", "fi_like", fn or reference_decode, origin="user", **{**peers.FLASHINFER_CLAIMS, **over})


def test_the_issue_case_is_outside_flashinfers_declaration_and_named_why():
    """The case that killed ``check flashinfer`` on the H200: head dim 80 and rows 2-byte aligned, both outside
    what FlashInfer's decode supports; the suite skips it as unsupported, never runs it."""
    fi = _flashinfer_like()
    why = fi.unsupported(Case.parse(ISSUE_CASE))
    assert "head dim 80 not in 64,128,256" in why and "rows aligned to 2 bytes, needs 16" in why
    report = C.check(fi, cases=[Case.parse(ISSUE_CASE), Case.parse(OK1)])
    assert [r.case.id for r in report.results] == [OK1] and report.passed
    assert [(c.id, w) for c, w in report.skipped] == [(ISSUE_CASE, why)]
    assert ISSUE_CASE in {c.id for c, _ in cases_mod.unsupported_cases(fi, "full")}
    assert "unsupported by the adapter (skipped, not failures): 1 cases" in report.summary()


@pytest.mark.parametrize("level", ["smoke", "pairwise", "full"])
def test_flashinfer_runs_only_what_it_claims_and_lists_the_rest(level):
    fi = _flashinfer_like()
    run, skipped = cases_mod.cases_for(fi, level), cases_mod.unsupported_cases(fi, level)
    assert run and skipped
    assert all(fi.unsupported(c) == "" for c in run)
    assert all(why == fi.unsupported(c) != "" for c, why in skipped)
    assert all(row_alignment(c) >= 16 and c.head_dim in (64, 128) for c in run)
    # every claimed layout x format x head dim still meets (the alignment filter keeps pairs covered)
    met = {(c.layout, c.kv_format, c.head_dim) for c in run}
    assert {(lay, f) for lay, f, _ in met} == {(lay, f) for lay in ("nhd", "hnd") for f in ("fp16", "bf16")}


def test_vllm_claims_any_block_size_head_dim_and_padding():
    from workbench.conformance.builtin import reference_decode

    v = make_impl("decode", "vllm_like", reference_decode, **peers.VLLM_CLAIMS)
    assert v.unsupported(Case.parse(ISSUE_CASE)) == ""  # d80, pad 3, bs8: vLLM's Triton kernel takes them
    assert "layout hnd not in nhd" in v.unsupported(replace(Case.parse(ISSUE_CASE), layout="hnd"))


@pytest.mark.parametrize("claims, message", [
    ({"row_align": 3}, "row_align must be a power of two"), ({"row_align": 0}, "row_align must be a power of two"),
    ({"row_align": True}, "row_align must be a power of two"), ({"groups": [0]}, "groups must be positive ints"),
    ({"groups": []}, "groups must name at least one value"),
])
def test_bad_claims_are_refused_naming_the_argument(claims, message):
    before = C.names()
    with pytest.raises(ValueError, match=message):
        C.register("decode", "bad_claims", lambda q, sm_scale, out: out, **claims)
    assert C.names() == before


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(["nhd", "hnd", "vllm"]), fmt=st.sampled_from(sorted(SUITE_FORMATS)),
       bs=st.sampled_from([1, 8, 16, 24, 32]), d=st.sampled_from([64, 80, 128]), h=st.integers(1, 3),
       pad=st.sampled_from([0, 1, 3, 16, 64]))
@example(layout="nhd", fmt="bf16", bs=1, d=64, h=1, pad=64)  # the H200 run drew it: size-1 dims' strides counted
def test_row_alignment_divides_every_row_start_and_is_the_largest(layout, fmt, bs, d, h, pad):
    """Property: every K/V row (the innermost run of a view) starts at a multiple of row_alignment bytes, and
    twice that (below 256) does not divide all of them."""
    from workbench.conformance.suite_formats import IN_BLOCKS
    from workbench.quant import get

    if fmt in IN_BLOCKS and pad % 16:
        return  # the suite never builds these (its scales must stay aligned)
    case = Case("decode", layout, bs, d, h, 1, fmt, (1,), pad)
    align = row_alignment(case)
    starts = set()
    for kind in "kv":
        view = empty_pool(get(fmt), case, kind, 3, "meta")
        outer = [(n, s) for n, s in zip(view.shape, view.stride(), strict=True) if s != 1]
        offsets = {0}
        for n, s in outer:
            offsets = {o + i * s for o in offsets for i in range(n)}
        starts |= {o * view.element_size() for o in offsets}
    assert all(o % align == 0 for o in starts)
    assert align == 256 or any(o % (2 * align) for o in starts)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts=st.sets(st.sampled_from(["nhd", "hnd", "vllm"]), min_size=1),
       formats=st.sets(st.sampled_from(["fp16", "bf16", "fp32", "fp8_e4m3/head", "int8/head"]), min_size=1),
       dims=st.one_of(st.none(), st.sets(st.sampled_from([64, 80, 128, 256]), min_size=1)),
       groups=st.one_of(st.none(), st.sets(st.sampled_from([1, 2, 4, 8]), min_size=1)),
       align=st.sampled_from([1, 2, 4, 8, 16]), level=st.sampled_from(["smoke", "pairwise"]))
def test_any_declaration_splits_the_level_into_claimed_and_listed_cases(layouts, formats, dims, groups, align,
                                                                          level):
    """Property: whatever an implementation claims, the suite builds only cases it claims, and every case of the
    level it does not claim is listed with a reason (or its claims name nothing the suite tests: a clear error)."""
    from workbench.conformance.builtin import reference_decode

    impl = make_impl("decode", "prop", reference_decode, layouts=sorted(layouts), formats=sorted(formats),
                     head_dims=None if dims is None else sorted(dims),
                     groups=None if groups is None else sorted(groups), row_align=align)
    try:
        run = cases_mod.cases_for(impl, level)
    except ValueError as e:
        assert "claims" in str(e)
        return
    assert run and all(impl.unsupported(c) == "" for c in run)
    skipped = cases_mod.unsupported_cases(impl, level)
    assert all(why and why == impl.unsupported(c) for c, why in skipped)
    assert {c.layout for c in run} <= layouts and {c.kv_format for c in run} <= formats


# ------------------------------------------------------------------------------------------- a crashing peer
def test_isolated_check_names_the_crashing_and_the_sticky_case_and_goes_on(fake_file, tmp_path, capsys):
    """The issue's failure on a CPU: one case kills its process, one leaves it poisoned (as CUDA's sticky errors
    do). Isolated, each fails alone and named, the others pass (OK2 after the poison proves the worker was replaced),
    and the report is written."""
    out = tmp_path / "r.json"
    argv = ["check", f"{fake_file}:fake_peer", "--isolate", "-q", "--json", str(out)]
    for case in (OK1, CRASH, STICKY, OK2):
        argv += ["--case", case]
    assert main(argv) == 1
    text = capsys.readouterr().out
    doc = _report(out)
    by = _by_case(doc)
    assert doc["wrong"] == [CRASH, STICKY] and doc["isolated"] and doc["workers_replaced"] >= 2
    assert by[OK1]["passed"] and by[OK2]["passed"]
    assert "crashed the worker process (exit status 1)" in by[CRASH]["reason"]
    assert "misaligned address" in by[STICKY]["reason"] and "fresh worker" in by[STICKY]["reason"]
    assert f"FAIL {CRASH}" in text and f"FAIL {STICKY}" in text and "wrong on 2 of the cases it claims" in text


def test_in_process_a_lost_context_stops_the_run_names_the_case_and_writes_the_report(fake_file, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["check", f"{fake_file}:fake_peer", "--no-isolate", "-q", "--json", str(out)]
    for case in (OK1, STICKY, OK2):
        argv += ["--case", case]
    assert main(argv) == 1
    doc = _report(out)
    assert [r["case"] for r in doc["cases"]] == [OK1, STICKY] and doc["wrong"] == [STICKY]
    assert STICKY in doc["stopped"] and "1 cases not run" in doc["stopped"] and "--resume" in doc["stopped"]
    assert f"stopped: case {STICKY}" in capsys.readouterr().out
    # --resume (a fresh process in practice; here a fresh load of the file): the journaled sticky case does not
    # stop the run again, the rest runs
    assert main([*argv, "--resume"]) == 1
    doc = _report(out)
    assert [r["case"] for r in doc["cases"]] == [OK1, STICKY, OK2] and doc["wrong"] == [STICKY]
    assert not doc["stopped"] and _by_case(doc)[OK2]["passed"]


def test_a_hard_crash_is_in_the_journal_and_resume_continues_after_it(fake_file, tmp_path, capsys):
    """In-process, the crash kills the whole run (a subprocess here); the journal holds the case it died in, and
    --resume reuses the finished case, fails that one as crashed and runs the rest."""
    out = tmp_path / "r.json"
    args = ["check", f"{fake_file}:fake_peer", "--no-isolate", "-q", "--json", str(out)]
    for case in (OK1, CRASH, OK2):
        args += ["--case", case]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    journal = out.with_suffix(".journal.jsonl")
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert records[-1] == {"start": CRASH} and sum("done" in r for r in records) == 1
    assert main([*args, "--resume"]) == 1
    doc = _report(out)
    by = _by_case(doc)
    assert [r["case"] for r in doc["cases"]] == [OK1, CRASH, OK2] and doc["wrong"] == [CRASH]
    assert by[OK1]["seconds"] == records[2]["row"]["seconds"]  # reused from the journal, not run again
    assert "crashed the process while it ran" in by[CRASH]["reason"] and by[OK2]["passed"]
    capsys.readouterr()
    # a journal of another run is refused before anything is written; the file is left as it was
    before = journal.read_bytes()
    assert main(["check", f"{fake_file}:fake_peer", "--case", OK1, "-q", "--json", str(out), "--resume"]) == 2
    assert "of another run" in capsys.readouterr().err and journal.read_bytes() == before
    assert main(["check", "ours", "--case", OK1, "-q", "--resume"]) == 2
    assert "--resume: needs a journal" in capsys.readouterr().err


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "done", "torn"]), st.integers(0, 4)), max_size=12))
def test_journal_resume_reuses_finished_and_blames_unfinished(tmp_path_factory, events):
    """Property: after any sequence of starts, finishes and a torn last line, a resumed journal's ``done`` is the
    finished keys' rows and ``crashed`` the keys started and never finished, in order."""
    path = tmp_path_factory.mktemp("j") / "j.jsonl"
    header = {"run": "t"}
    with Journal(path, header) as j:
        started, done = [], {}
        for kind, k in events:
            key = f"k{k}"
            if kind == "start":
                j.start(key)
                started.append(key) if key not in started else None
            elif kind == "done":
                j.finish(key, {"v": k})
                done[key] = {"v": k}
    if events and events[-1][0] == "torn":
        with open(path, "a") as f:
            f.write('{"start": "k9"')  # the crash cut the line
    again = Journal(path, header, resume=True)
    again.close()
    assert again.done == done
    assert again.crashed == [k for k in started if k not in done]
    with pytest.raises(ValueError, match="of another run"):
        Journal(path, {"run": "other"}, resume=True)


# ------------------------------------------------------------------------------------------- the report's lists
def test_the_report_lists_supported_cases_a_peer_gets_wrong_apart_from_unsupported_ones():
    import functools

    from workbench.conformance.starter import starter_decode

    gqa = make_impl("decode", "fi_gqa", functools.partial(starter_decode, mistake="gqa"), origin="user",
                    **peers.FLASHINFER_CLAIMS)
    wrong = "decode/nhd/bs16/d64/hkv2/g4/fp16/lens=37,0,1,150/pad0/seed1"  # claimed, and the gqa bug shows
    outside = "decode/nhd/bs8/d80/hkv2/g4/fp16/lens=16,8/pad0/seed2"  # d80: unsupported, and wrong too
    report = C.check(gqa, cases=[Case.parse(wrong), Case.parse(outside)], include_unsupported=True)
    assert [r.case.id for r in report.failures] == [wrong] and [r.case.id for r in report.outside] == [outside]
    assert not report.outside[0].passed and report.to_json()["wrong"] == [wrong]
    text = report.summary(failures=5)
    assert "wrong on 1 of the cases it claims" in text and "outside its claims, run anyway: 0/1 passed" in text
    plain = C.check(gqa, cases=[Case.parse(wrong), Case.parse(outside)])
    assert [r.case.id for r in plain.results] == [wrong] and [c.id for c, _ in plain.skipped] == [outside]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_check_refuses_a_non_positive_stop_after(bad):
    with pytest.raises(ValueError, match="stop_after must be an int >= 1"):
        C.check("reference", cases=[Case.parse(OK1)], stop_after=bad)


def test_sticky_messages_and_the_context_probe():
    for text in ("CUDA error: misaligned address", "an illegal memory access was encountered",
                 "CUDA error: unspecified launch failure", "device-side assert triggered"):
        assert isolation.sticky(text) and isolation.sticky(text.upper())
    assert not isolation.sticky("relative error 1.0 > 1e-2") and not isolation.sticky("")
    if not torch.cuda.is_initialized():
        assert isolation.context_lost() == ""


def test_a_replaced_worker_forks_from_the_preloaded_server_and_can_use_cuda():
    """Workers fork from one forkserver that imported torch (a replacement starts in ~0.1 s, not the seconds of a
    fresh interpreter), never from this process; the server never asked CUDA anything, so on a GPU a worker can
    still initialize it (a fork of a process that called ``cuInit`` cannot)."""
    assert "workbench" not in isolation.PRELOAD  # its import asks CUDA for devices
    with isolation.Worker() as w:
        first = w.call(os.getppid)
        w.retire()
        second = w.call(os.getppid)
        cuda = w.call(torch.cuda.init) if torch.cuda.is_available() else ("ok", None)
    assert first[0] == second[0] == "ok" and first[1] == second[1] != os.getpid()
    assert w.replaced == 2 and cuda[0] == "ok", cuda


# ------------------------------------------------------------------------------------------- bench decode --impl
def _rows(out):
    (path,) = out.glob("byok-decode-*.json")
    doc = json.loads(path.read_text())
    return {(r["workload"], r["impl"]): r for r in doc["rows"]}, doc


def test_bench_decode_isolated_reports_the_crashing_units_and_goes_on(fake_file, tmp_path, monkeypatch):
    from workbench.bench import byok_decode

    # W3 (the crash), W4 (the poison), W5 (after it): the worker measures whichever units the parent hands it
    monkeypatch.setattr(byok_decode, "WORKLOADS", {k: byok_decode.WORKLOADS[k] for k in ("W3", "W4", "W5")})
    out = tmp_path / "out"
    assert main(["bench", "decode", "--smoke", "--impl", "fake_peer", "--load", str(fake_file), "--isolate",
                 "--out", str(out)]) == 0
    by, doc = _rows(out)
    assert by[("W3", "fake_peer")]["status"] == "error" and "crashed the worker" in by[("W3", "fake_peer")]["error"]
    assert "misaligned address" in by[("W4", "fake_peer")]["error"]
    assert by[("W5", "fake_peer")]["status"] == "ok"  # a fresh worker after W4's poison
    assert all(by[(w, "ours")]["status"] == "ok" for w in ("W3", "W4", "W5"))
    assert doc["workers_replaced"] >= 2 and doc["isolated"]


def test_bench_decode_journal_attributes_a_hard_crash_and_resumes(fake_file, tmp_path):
    out = tmp_path / "out"
    args = ["bench", "decode", "--smoke", "--impl", "fake_peer", "--load", str(fake_file), "--no-isolate",
            "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "workbench", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 1 and not list(out.glob("byok-decode-*.json")), done.stderr[-2000:]
    journal = out / "byok-decode.journal.jsonl"
    assert json.loads(journal.read_text().splitlines()[-1]) == {"start": "W3/nhd/bs16/fake_peer"}
    assert main([*args, "--resume"]) == 1  # W4's sticky error stops this process: named, rows written
    by, doc = _rows(out)
    assert "crashed the process while it ran" in by[("W3", "fake_peer")]["error"]
    assert doc["stopped"].startswith("W4/nhd/bs16/fake_peer left the CUDA context unusable")
    assert ("W5", "ours") not in by
    for p in out.glob("byok-decode-*.json"):
        p.unlink()
    assert main([*args, "--resume"]) == 0  # a fresh process goes on after it
    by, doc = _rows(out)
    assert by[("W5", "fake_peer")]["status"] == "ok" and "stopped" not in doc
    assert "misaligned address" in by[("W4", "fake_peer")]["error"]
    assert not any(math.isnan(r.get("rel_err") or 0.0) for r in by.values())


# ------------------------------------------------------------------------------------------- on the GPU
GPU_FAULT = '''
import torch
from workbench import conformance
from workbench.conformance.builtin import reference_decode


def gpu_fault(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, block_size,
              out):
    if block_size == 8:  # an index far outside a tensor: a device-side assert, sticky like a misaligned address
        torch.zeros(4, device=q.device)[torch.tensor([1 << 30], device=q.device)].sum().item()
    return reference_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant,
                            out)


conformance.register("decode", "gpu_fault", gpu_fault, layouts=("nhd",), formats=("fp16",))
'''


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real sticky CUDA error needs a GPU")
def test_on_the_gpu_a_real_sticky_error_fails_its_case_alone(tmp_path, capsys):
    """A device-side assert in one case: isolated (the GPU's default), that case fails naming the lost context and
    the next passes in a fresh worker; in one process (a subprocess here: the context it loses is its own) the run
    stops at that case, names it, and writes the report."""
    src = tmp_path / "gpu_fault_kernels.py"
    src.write_text(GPU_FAULT)
    cases = []
    for case in (OK1, CRASH, OK2):
        cases += ["--case", case]
    out = tmp_path / "iso.json"
    try:
        assert main(["check", f"{src}:gpu_fault", *cases, "-q", "--json", str(out)]) == 1
    finally:
        if "gpu_fault" in C.names("decode"):
            C.unregister("decode", "gpu_fault")
    doc = _report(out)
    by = _by_case(doc)
    assert doc["isolated"] and doc["wrong"] == [CRASH] and by[OK1]["passed"] and by[OK2]["passed"]
    assert "fresh worker" in by[CRASH]["reason"] and doc["workers_replaced"] >= 1
    one = tmp_path / "one.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "workbench", "check", f"{src}:gpu_fault", *cases, "-q",
                           "--no-isolate", "--json", str(one)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, done.stderr[-2000:]
    doc = _report(one)
    assert [r["case"] for r in doc["cases"]] == [OK1, CRASH] and doc["stopped"].startswith(f"case {CRASH} left")
