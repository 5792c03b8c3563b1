"""The conformance suite (workbench.conformance), checked on implementations whose answer we know: ours, the
references and the starter pass; the starter with each of its three deliberate bugs fails, and fails on the kind of
case that bug is about; the report, the case ids and the registry's refusals; and the judge, on small
implementations that are wrong in one way each.

Every kernel run is at level "smoke" (or one hand-picked case) under one torch thread: the whole file is about a
minute under the Triton interpreter. ``-s`` prints each broken starter's first failure and each smoke run's time.
"""

import contextlib
import functools
import importlib.util
import inspect
import json
import keyword
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import workbench
from workbench import conformance as C
from workbench.conformance import builtin, implementations, ops
from workbench.conformance.starter import MISTAKES, starter_decode
from workbench.conformance.suite_formats import CAST, SUITE_FORMATS
from workbench.core.layout import to_nhd

# small tensors on a busy 2-core CPU: one torch thread; runs Triton kernels (scripts/gpu_run.sh runs it compiled)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]

OPS = ("decode", "shared_prefix", "write", "copy")
LAYOUTS = ("nhd", "hnd", "vllm")


@contextlib.contextmanager
def registered(op, name, fn, **claims):
    """``fn`` registered as ``name`` for the block, unregistered after (whatever happens in it)."""
    impl = C.register(op, name, fn, **claims)
    try:
        yield impl
    finally:
        C.unregister(op, name)
    assert name not in C.names(op)


def has_tail(case) -> bool:
    """Some length is not a multiple of the block size: the last block has unwritten (poisoned) slots."""
    return any(n % case.block_size for n in case.lens)


# ---- 1. what must pass passes -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("op", OPS)
def test_ours_passes_smoke(op):
    report = C.check("ours", op=op, level="smoke")
    print(f"\n[{op}] ours smoke: {len(report.results)} cases in {report.seconds:.1f} s")
    assert report.results and report.passed, report.summary()


@pytest.mark.parametrize("op", OPS)
def test_references_pass_smoke(op):
    report = C.check("reference", op=op, level="smoke")
    assert report.results and report.passed, report.summary()


def test_starter_passes_smoke():
    report = C.check("starter", level="smoke")
    print(f"\nstarter smoke: {len(report.results)} cases in {report.seconds:.1f} s")
    assert report.results and report.passed, report.summary()
    assert {r.case.layout for r in report.results} == {"nhd", "hnd"}  # what the starter claims, nothing else
    assert {r.case.kv_format for r in report.results} == set(CAST)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the block bug's NaN reads, interpreted
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_the_interpreters_longer_tile_changes_only_the_speed(mistake):
    """The starter's default tile (128 tokens a step interpreted, 32 compiled: ``default_tile``) gives tile 32's
    outputs to fp32 rounding, bugs included, on a case with a partial last tile and an empty sequence."""
    from workbench.conformance.implementations import make_impl
    from workbench.conformance.starter import default_tile

    assert default_tile() == (128 if workbench.is_interpreted() else 32)
    case = C.Case.parse("decode/hnd/bs16/d64/hkv2/g2/fp32/lens=37,0,150/pad3/seed1")
    outs = []
    for tile in (32, None):
        fn = functools.partial(starter_decode, mistake=mistake, **({} if tile is None else {"tile": tile}))
        inputs = case.build(workbench.device())
        inputs.pop("ref")
        outs.append(make_impl("decode", "t", fn, origin="user", layouts=("hnd",))(dict(inputs)).clone())
    ok = torch.isfinite(outs[0])
    assert torch.equal(ok, torch.isfinite(outs[1]))  # a bug's NaN read lands on the same outputs
    assert torch.allclose(outs[1][ok], outs[0][ok], atol=1e-6, rtol=1e-5), (outs[1] - outs[0]).abs().max()


@pytest.mark.parametrize("tile", [0, 3, 48, -32, 1.5, True, "32"])
def test_the_starter_refuses_a_tile_that_is_not_a_power_of_two(tile):
    case = C.Case.parse("decode/nhd/bs16/d64/hkv1/g1/fp32/lens=2,1/pad0/seed1")
    inputs = case.build(workbench.device())
    inputs.pop("ref")
    out = inputs["out"].clone()
    with pytest.raises(ValueError, match="tile must be a power of two"):
        starter_decode(**{k: inputs[k] for k in ("q", "k_cache", "v_cache", "layout", "block_table", "seq_lens",
                                                 "sm_scale", "out")}, tile=tile)
    assert torch.equal(inputs["out"].nan_to_num(), out.nan_to_num())  # nothing written


# ---- 2. the broken starters fail, on the cases their bug is about -------------------------------------------------
BROKEN = {m: f"test_conformance_broken_{m}" for m in MISTAKES if m != "none"}
TILE = 128  # tokens per loop step: the starter's default is 32; 128 makes the same bugs half as slow to interpret

# cases beyond smoke that tell the bugs apart: smoke has heads (2, 4) and (1, 1) only, and no single sequence
EXTRA = {
    "mask": [],
    "gqa": [C.Case("decode", "nhd", 16, 64, 1, 8, "fp16", (37, 0, 1, 150), 0, 101),  # MQA: h % 1 == h // 8
            C.Case("decode", "hnd", 16, 64, 2, 1, "bf16", (37, 0, 1, 150), 3, 102),  # MHA: h % 2 == h // 1
            C.Case("decode", "nhd", 24, 80, 3, 2, "fp32", (37, 0, 1, 150), 0, 103)],  # GQA on 3 kv heads
    "block": [C.Case("decode", "hnd", 16, 64, 2, 4, "fp16", (150,), 3, 104)],  # one sequence: row 0 is its row
}


@pytest.fixture(scope="module")
def broken():
    """``{mistake: Report}`` of the starter with each bug (registered like scripts/broken_starters.py does, under
    names of this file, with a longer tile), on its smoke cases and the :data:`EXTRA` ones; unregistered after
    the module."""
    reports = {}
    with contextlib.ExitStack() as stack:
        for m, name in BROKEN.items():
            fn = functools.partial(starter_decode, mistake=m, tile=TILE)
            impl = stack.enter_context(registered("decode", name, fn, layouts=("nhd", "hnd")))
            reports[m] = C.check(name, cases=C.cases_for(impl, "smoke") + EXTRA[m])
        yield reports


@pytest.mark.parametrize("mistake", list(BROKEN))
def test_broken_starter_fails(broken, mistake):
    report = broken[mistake]
    first = report.first_failure
    assert not report.passed and first is not None
    print(f"\nbroken starter {mistake!r}: {len(report.failures)}/{len(report.results)} cases fail; first failure\n"
          f"  {first.case.id}\n  {first.reason}")
    assert report.failures[0] is first and first.case.id in report.summary()


def test_mask_bug_reads_the_poisoned_tail(broken):
    results = broken["mask"].results
    assert any(has_tail(r.case) for r in results) and any(not has_tail(r.case) for r in results)
    for r in results:
        assert r.passed != has_tail(r.case), (r.case.id, r.reason)  # fails exactly when the last block has a tail
        if not r.passed:
            assert r.reason.startswith("non-finite output") and r.error == math.inf, r.reason
            b, n = map(int, re.search(r"sequence (\d+) of length (\d+)", r.reason).groups())
            assert n == r.case.lens[b] and n % r.case.block_size, r.reason  # the NaN is in a sequence with a tail
    whole = [r for r in results if all(n % r.case.block_size == 0 for n in r.case.lens)]
    assert whole and all(r.passed for r in whole)  # "whole blocks" cases (and block size 1) never catch it


def test_gqa_bug_needs_several_kv_heads_and_a_group(broken):
    results = broken["gqa"].results
    both = [r for r in results if r.case.num_kv_heads > 1 and r.case.group > 1]
    assert both and len(both) < len(results)
    assert {(r.case.num_kv_heads > 1, r.case.group > 1) for r in results} == {
        (True, True), (True, False), (False, True), (False, False)}  # each way of having one without the other
    assert all(not r.passed for r in both), [r.case.id for r in both if r.passed]
    for r in broken["gqa"].failures:
        assert r.case.num_kv_heads > 1 and r.case.group > 1, r.case.id
        assert r.reason.startswith("relative error"), r.reason  # a wrong (finite) head, not a read of poison


def test_block_bug_needs_more_than_one_sequence(broken):
    results = broken["block"].results
    assert any(len(r.case.lens) == 1 for r in results)
    for r in results:
        assert r.passed == (len(r.case.lens) == 1), (r.case.id, r.reason)
    # sequence 0's blocks are right for sequence 0: the worst sequence of every failure is another one
    for r in broken["block"].failures:
        assert int(re.search(r"sequence (\d+)", r.reason).group(1)) > 0, r.reason


# ---- 3. the report ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mistake", list(BROKEN))
def test_summary_names_the_first_failure_and_its_replay(broken, mistake):
    report, name = broken[mistake], BROKEN[mistake]
    first = report.first_failure
    text = report.summary()
    assert f"case   {first.case.id}" in text and first.reason in text
    assert f"python -m workbench check {name} --op decode --case '{first.case.id}'" in text
    assert f"{len(report.results) - len(report.failures)}/{len(report.results)} cases passed" in text
    again = C.replay(name, first.case.id)  # from the id alone: the same data, the same failure
    assert again.case == first.case and not again.passed
    assert again.reason == first.reason and again.error == first.error


def test_report_json_and_worst_by(broken):
    report = broken["gqa"]
    data = json.loads(json.dumps(report.to_json()))
    assert data["impl"] == BROKEN["gqa"] and data["op"] == "decode" and data["passed"] is False
    assert [row["case"] for row in data["cases"]] == [r.case.id for r in report.results]
    assert [row["passed"] for row in data["cases"]] == [r.passed for r in report.results]
    assert all(C.Case.parse(row["case"]) == r.case for row, r in zip(data["cases"], report.results, strict=True))

    by_group = report.worst_by("group")
    for g, (worst, n, bad) in by_group.items():
        mine = [r for r in report.results if r.case.group == g]
        assert n == len(mine) and bad == sum(not r.passed for r in mine)
        assert worst == max(r.error for r in mine)
    assert by_group[1][2] == 0 and by_group[4][2] > 0  # group 1: h % Hkv == h // 1, the bug is harmless
    assert sum(n for _, n, _ in report.worst_by().values()) == len(report.results)
    assert set(report.worst_by()) == {r.case.kv_format for r in report.results}  # the default: per format


def test_passing_report_is_strict_json():
    report = C.check("reference", op="write", level="smoke")
    data = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert data["passed"] is True and len(data["cases"]) == len(report.results)
    assert "first failure" not in report.summary()


def test_failing_report_is_strict_json(broken):
    json.dumps(broken["mask"].to_json(), allow_nan=False)


def test_check_refuses_cases_of_another_op():
    with pytest.raises(ValueError, match="cases must be of op 'copy'"):
        C.check("ours", op="copy", cases=[C.Case("decode")])
    with pytest.raises(ValueError, match="level must be one of"):
        C.check("ours", level="exhaustive")


# ---- 4. case ids round-trip ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["pairwise", "full"])
@pytest.mark.parametrize("op", OPS)
def test_case_ids_round_trip(op, level):
    cases = C.cases_for(C.get("ours", op), level)
    assert cases and all(c.op == op for c in cases)
    assert len({c.id for c in cases}) == len(cases)
    for c in cases:
        assert C.Case.parse(c.id) == c, c.id
        assert C.Case.parse(f"  {c.id}\n") == c  # pasted from a terminal


INTS = st.integers(-(10**6), 10**9)


@settings(max_examples=300, deadline=None)
@given(st.builds(C.Case, op=st.sampled_from(OPS), layout=st.sampled_from(LAYOUTS), block_size=INTS, head_dim=INTS,
                 num_kv_heads=INTS, group=INTS, kv_format=st.sampled_from(list(SUITE_FORMATS)),
                 lens=st.lists(INTS, max_size=6).map(tuple), pad=INTS, seed=INTS, shared=INTS, layers=INTS,
                 pairs=INTS))
def test_case_id_round_trips_any_fields(case):
    assert C.Case.parse(case.id) == case, case.id
    assert case.id.startswith(f"{case.op}/{case.layout}/")


@pytest.mark.parametrize("garbage", ["", "   ", "decode", "decode/nhd", "/nhd/fp16", "decode/nhd/lens=1,x/fp16",
                                     "decode/nhd/fp16/pad--3", "decode/nhd/fp16/lens=1.5"])
def test_case_parse_refuses_garbage(garbage):
    with pytest.raises(ValueError):
        C.Case.parse(garbage)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=30).filter(lambda s: s.count("/") < 2))
def test_case_parse_refuses_random_text(text):
    with pytest.raises(ValueError, match="case id"):
        C.Case.parse(text)


@pytest.mark.parametrize("garbage", ["a/b/c", "decode/sideways/fp16", "decode/nhd/bs16/oops/fp16", "decode/nhd/bsx"])
def test_case_parse_refuses_unreadable_parts(garbage):
    with pytest.raises(ValueError):
        C.Case.parse(garbage)


# ---- 5. the registry refuses bad input before it changes anything -------------------------------------------------
def ok_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out):
    return builtin.reference_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale,
                                    quant, out)


def snapshot():
    return [(i.op, i.name, i.origin, i.fn, i.claims()) for i in C.available()]


def fn_taking(*names):
    """A function whose signature names ``names`` (keyword-only, no defaults)."""
    def fn(**kwargs):
        raise AssertionError("never called")
    fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names])
    return fn


def _star_args(*args, sm_scale):
    pass


def _positional_only(q, /, sm_scale):
    pass


BAD = [  # (op, name, fn, claims, what the message must say)
    ("decoder", "t_bad", ok_decode, {}, "op must be one of"),
    ("", "t_bad", ok_decode, {}, "op must be one of"),
    ("decode", "has space", ok_decode, {}, "name must be"),
    ("decode", "a/b", ok_decode, {}, "name must be"),
    ("decode", "file.py:mine", ok_decode, {}, "name must be"),
    ("decode", 7, ok_decode, {}, "name must be"),
    ("decode", None, lambda q, sm_scale, out: out, {}, "name must be"),  # a lambda's name is '<lambda>'
    ("decode", "t_bad", 42, {}, "fn must be callable"),
    ("decode", "t_bad", "ok_decode", {}, "fn must be callable"),
    ("decode", "t_bad", torch.zeros(2), {}, "fn must be callable"),
    ("decode", "t_bad", fn_taking("q", "sm_scale", "softcap"), {}, r"requires arguments \['softcap'\]"),
    ("write", "t_bad", fn_taking("key", "slot_mapping", "block_table"), {}, r"requires arguments \['block_table'\]"),
    ("copy", "t_bad", fn_taking("pool", "src", "dst", "stream"), {}, r"requires arguments \['stream'\]"),
    ("decode", "t_bad", fn_taking("q", "k_cache", "v_cache", "block_table", "seq_lens", "out"), {},
     r"must accept \['sm_scale'\]"),
    ("write", "t_bad", fn_taking("key", "value", "k_cache", "v_cache"), {}, r"must accept \['slot_mapping'\]"),
    ("copy", "t_bad", fn_taking("pool", "src"), {}, r"must accept \['dst'\]"),
    ("decode", "t_bad", _star_args, {}, "positional-only and \\*args"),
    ("decode", "t_bad", _positional_only, {}, "positional-only and \\*args"),
    ("decode", "t_bad", ok_decode, {"layouts": ("nhd", "sideways")}, "layout must be one of"),
    ("decode", "t_bad", ok_decode, {"layouts": ()}, "layouts must name at least one"),
    ("decode", "t_bad", ok_decode, {"layouts": None}, "layouts must be a list"),
    ("decode", "t_bad", ok_decode, {"formats": ("fp16", "fp4")}, "formats: 'fp4' is not one of"),
    ("write", "t_bad", builtin.reference_write, {"formats": "float16"}, "formats: 'float16' is not one of"),
    ("decode", "t_bad", ok_decode, {"block_sizes": (16, 0)}, "block_sizes must be positive ints"),
    ("decode", "t_bad", ok_decode, {"block_sizes": -16}, "block_sizes must be positive ints"),
    ("decode", "t_bad", ok_decode, {"block_sizes": True}, "block_sizes must be positive ints"),
    ("decode", "t_bad", ok_decode, {"block_sizes": (16, False)}, "block_sizes must be positive ints"),
    ("decode", "t_bad", ok_decode, {"block_sizes": (16.0,)}, "block_sizes must be positive ints"),
    ("decode", "t_bad", ok_decode, {"block_sizes": "16"}, "block_sizes must be positive ints"),
    ("decode", "t_bad", ok_decode, {"block_sizes": 1.5}, "block_sizes must be a list"),
    ("decode", "t_bad", ok_decode, {"head_dims": (64, -1)}, "head_dims must be positive ints"),
    ("decode", "t_bad", ok_decode, {"origin": "vendor"}, "origin must be one of"),
]


@pytest.mark.parametrize("op, name, fn, claims, match", BAD, ids=[f"{i}-{b[4][:24]}" for i, b in enumerate(BAD)])
def test_register_refuses_bad_input_and_changes_nothing(op, name, fn, claims, match):
    before = snapshot()
    with pytest.raises(ValueError, match=match):
        C.register(op, name, fn, **claims)
    assert snapshot() == before, "a refused register changed the registry"


def test_register_refusal_of_an_unknown_argument_names_it_and_what_the_op_provides():
    with pytest.raises(ValueError, match=r"requires arguments \['cu_seqlens_q', 'softcap'\].*provides \[.*'q'"):
        C.register("decode", "t_bad", fn_taking("q", "softcap", "sm_scale", "cu_seqlens_q", "out"))
    with pytest.raises(ValueError, match=r"must accept \['sm_scale'\] \(softmax scale"):
        C.register("decode", "t_bad", fn_taking("q", "out"))


BAD_NAME_CHARS = list(" ./:<>!@#$%^&*()+=[]{};'\",?\\|`~\t\n")
IDENT = st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))


def _random_bad_registration(data):
    """(op, name, fn, claims, regex) of one random bad register call."""
    op = data.draw(st.sampled_from(OPS))
    kind = data.draw(st.sampled_from(["op", "name", "fn", "argument", "layout", "format", "block_size",
                                      "head_dim"]))
    fn = VALID[op]
    name, claims = "t_random_bad", {}
    if kind == "op":
        return data.draw(st.text(max_size=12).filter(lambda s: s not in ops.OPS)), name, fn, claims, "op must"
    if kind == "name":
        bad = data.draw(st.tuples(st.text("abc_-09", max_size=5), st.sampled_from(BAD_NAME_CHARS),
                                  st.text("abc_-09", max_size=5)).map("".join))
        return op, bad, fn, claims, "name must be"
    if kind == "fn":
        return op, name, data.draw(st.one_of(st.integers(), st.text(), st.none().map(lambda _: [fn]))), claims, \
            "fn must be callable"
    if kind == "argument":
        extra = data.draw(IDENT.filter(lambda s: s not in ops.OPS[op].arguments))
        return op, name, fn_taking(*ops.OPS[op].required, extra), claims, f"requires arguments \\['{extra}'\\]"
    if op == "copy":  # the copy op has no layout or format claims to check (its formats are "any")
        op, fn = "decode", ok_decode
    if kind == "layout":
        bad = data.draw(st.text(max_size=8).filter(lambda s: s.lower() not in LAYOUTS))
        return op, name, fn, {"layouts": ["nhd", bad]}, "layout must be one of"
    if kind == "format":
        bad = data.draw(st.text(max_size=16).filter(lambda s: s not in SUITE_FORMATS))
        return op, name, fn, {"formats": [bad, "fp16"]}, "formats: .* is not one of"
    key = "block_sizes" if kind == "block_size" else "head_dims"
    bad = data.draw(st.one_of(st.integers(max_value=0), st.booleans(), st.floats(allow_nan=True),
                              st.text(max_size=4)))
    return op, name, fn, {key: [16, bad]}, f"{key} must be positive ints"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_register_refuses_random_bad_input_and_changes_nothing(data):
    op, name, fn, claims, match = _random_bad_registration(data)
    before = snapshot()
    with pytest.raises(ValueError, match=match):
        C.register(op, name, fn, **claims)
    assert snapshot() == before and "t_random_bad" not in C.names()


VALID = {"decode": ok_decode, "shared_prefix": builtin.reference_decode, "write": builtin.reference_write,
         "copy": builtin.reference_copy}


def test_builtin_names_are_not_replaced_without_replace():
    C.names()  # the built-ins are registered (on first lookup)
    for op in OPS:
        ours = C.get("ours", op)
        before = snapshot()
        with pytest.raises(ValueError, match=r"name 'ours' is taken by the ours implementation.*replace=True"):
            C.register(op, "ours", VALID[op])
        assert snapshot() == before and C.get("ours", op) is ours
    with pytest.raises(ValueError, match="taken by the reference implementation"):
        C.register("decode", "reference", ok_decode)
    with pytest.raises(ValueError, match="taken by the example implementation"):
        C.register("decode", "starter", ok_decode)


def test_registering_a_user_name_again_replaces_it():
    def second(q, sm_scale, out):
        return out

    with registered("decode", "t_twice", ok_decode, layouts=("nhd",)) as first:
        again = C.register("decode", "t_twice", second)  # a notebook cell run twice, edited
        assert C.get("t_twice") is again and again.fn is second and again.layouts == LAYOUTS
        assert first.fn is ok_decode and C.names("decode").count("t_twice") == 1
    assert "t_twice" not in C.names()


def test_register_as_a_decorator():
    @C.register("decode", layouts="nhd", formats="fp32", block_sizes=16)
    def t_decorated(q, sm_scale, out):
        """One-line description."""
        return out

    try:
        impl = C.get("t_decorated")
        assert impl.fn is t_decorated and impl.origin == "user" and impl.description == "One-line description."
        assert (impl.layouts, impl.formats, impl.block_sizes, impl.head_dims) == (("nhd",), ("fp32",), (16,), None)
        assert impl.takes == {"q", "sm_scale", "out"} and not impl.takes_all
    finally:
        C.unregister("decode", "t_decorated")


def test_register_refuses_an_empty_name():
    def t_empty_named(q, sm_scale, out):
        return out

    try:
        with pytest.raises(ValueError, match="name must be"):
            C.register("decode", "", t_empty_named)
    finally:
        if "t_empty_named" in C.names("decode"):
            C.unregister("decode", "t_empty_named")


def test_builtin_names_are_protected_before_the_first_lookup(monkeypatch):
    monkeypatch.setattr(implementations, "_REGISTRY", {})  # a fresh process: nothing registered, nothing loaded yet
    monkeypatch.setattr(builtin, "_LOADED", False)
    monkeypatch.setattr(builtin, "ABSENT", {})
    with pytest.raises(ValueError, match="taken by the ours implementation"):
        C.register("decode", "ours", ok_decode)


def test_get_and_unregister_of_an_unknown_name_list_the_registered_ones():
    with pytest.raises(ValueError, match=r"no implementation 'nobody' of op 'decode'; registered: \[.*'ours'.*"
                                         r"'reference'.*'starter'"):
        C.get("nobody")
    with pytest.raises(ValueError, match=r"no implementation 'starter' of op 'copy'; registered: \['ours', "
                                         r"'reference'\]"):
        C.get("starter", op="copy")
    with pytest.raises(ValueError, match="op must be one of"):
        C.get("ours", op="prefill")
    with pytest.raises(ValueError, match=r"no implementation 'nobody' of op 'write'; registered: \["):
        C.unregister("write", "nobody")


# ---- 6. an implementation is handed what it names -----------------------------------------------------------------
def csr_decode(q, k_cache, v_cache, layout, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out):
    """A PyTorch decode over FlashInfer-style CSR pages (no block table, no lengths)."""
    k, v = to_nhd(k_cache, layout, "k"), to_nhd(v_cache, layout, "v")  # [blocks, bs, Hkv, D]
    B, Hq, D = q.shape
    bs, hkv = k.shape[1], k.shape[2]
    for b in range(B):
        pages = kv_indices[kv_indptr[b]: kv_indptr[b + 1]].long()
        if not len(pages):
            out[b] = 0
            continue
        n = (len(pages) - 1) * bs + int(kv_last_page_len[b])
        kb = k[pages].reshape(-1, hkv, D)[:n].double().repeat_interleave(Hq // hkv, dim=1)  # [n, Hq, D]
        vb = v[pages].reshape(-1, hkv, D)[:n].double().repeat_interleave(Hq // hkv, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[b].double(), kb) * sm_scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, vb).to(out.dtype)


def test_csr_implementation_passes_smoke():
    with registered("decode", "t_csr", csr_decode, formats=CAST) as impl:
        assert impl.takes == {"q", "k_cache", "v_cache", "layout", "kv_indptr", "kv_indices", "kv_last_page_len",
                              "sm_scale", "out"}
        report = C.check("t_csr", level="smoke")
    assert report.results and report.passed, report.summary()
    assert {r.case.layout for r in report.results} == set(LAYOUTS)


@pytest.mark.parametrize("op", OPS)
def test_every_argument_of_an_op_is_provided(op):
    impl = C.get("reference", op)
    inputs = C.cases_for(impl, "smoke")[0].build("cpu")
    assert set(ops.OPS[op].arguments) <= set(inputs) - {"ref"}


@pytest.mark.parametrize("op", OPS)
def test_kwargs_implementation_receives_everything(op):
    base, seen = VALID[op], {}

    def everything(**kwargs):
        seen.update(kwargs)
        return base(**{k: kwargs[k] for k in inspect.signature(base).parameters})

    with registered(op, "t_kwargs", everything) as impl:
        assert impl.takes_all and not impl.takes
        case = C.cases_for(impl, "smoke")[0]
        result = C.run_case(impl, case)
    assert result.passed, result.reason
    assert set(ops.OPS[op].arguments) <= set(seen), set(ops.OPS[op].arguments) - set(seen)
    assert "ref" not in seen  # never the answer


def test_parameters_the_op_does_not_know_keep_their_defaults():
    calls = []

    def with_options(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out,
                     tile=32, verbose=False):
        calls.append((tile, verbose))
        return ok_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out)

    with registered("decode", "t_options", with_options) as impl:
        assert "tile" not in impl.takes and "verbose" not in impl.takes and not impl.takes_all
        result = C.run_case(impl, C.Case("decode", "nhd", 16, 64, 2, 4, "fp16", (37, 0, 1, 150), 0, 5))
    assert result.passed and calls == [(32, False)]


# ---- 7. the judge -------------------------------------------------------------------------------------------------
DECODE_CASE = C.Case("decode", "nhd", 16, 64, 2, 4, "fp16", (37, 0, 1, 150), 3, 7)  # ragged, an empty sequence


def _wrong_dtype(**kw):
    return ok_decode(**kw).float()


def _wrong_shape(**kw):
    return ok_decode(**kw)[:, :, :32]


def _not_a_tensor(**kw):
    return ok_decode(**kw).tolist()


def _raises(**kw):
    raise RuntimeError("out of shared memory")


def _writes_k_cache(**kw):
    got = ok_decode(**kw)  # the right answer, then a write into a cache it may only read
    kw["k_cache"][int(kw["block_table"][0, 0])].zero_()
    return got


def _empty_not_zero(**kw):
    got = ok_decode(**kw)
    got[kw["seq_lens"] == 0] = 1.0
    return got


def _half_written(**kw):
    got = ok_decode(**kw).clone()
    kw["out"].fill_(float("nan"))
    kw["out"][:, :2] = got[:, :2]  # forgets the other heads


def _ignores_sm_scale(**kw):
    return ok_decode(**{**kw, "sm_scale": 1 / math.sqrt(kw["q"].shape[-1])})


def _modifies_table(**kw):
    got = ok_decode(**kw)
    kw["block_table"].add_(1)
    return got


JUDGED = [  # (fn, the reason must match)
    (_wrong_dtype, r"output is \(4, 8, 64\) torch.float32, expected \(4, 8, 64\) torch.float16"),
    (_wrong_shape, r"output is \(4, 8, 32\) torch.float16, expected \(4, 8, 64\) torch.float16"),
    (_not_a_tensor, r"returned list, expected a \[B, Hq, D\] tensor"),
    (_raises, r"raised RuntimeError: out of shared memory"),
    (_writes_k_cache, r"modified its input k_cache, which it may only read"),
    (_empty_not_zero, r"sequence 1 is empty \(length 0\) but its output is not zero"),
    (_half_written, r"non-finite output at \[0, 2, 0\]"),
    (_ignores_sm_scale, r"relative error .* > 1e-02"),
    (_modifies_table, r"modified its input block_table"),
]


def test_judged_case_passes_the_reference():
    assert C.run_case(C.get("reference"), DECODE_CASE).passed


@pytest.mark.parametrize("fn, match", JUDGED, ids=[fn.__name__.strip("_") for fn, _ in JUDGED])
def test_judge_decode(fn, match):
    def named(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out):
        return fn(q=q, k_cache=k_cache, v_cache=v_cache, layout=layout, block_table=block_table, seq_lens=seq_lens,
                  sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, quant=quant, out=out)

    with registered("decode", "t_judged", named) as impl:
        result = C.run_case(impl, DECODE_CASE)
    assert not result.passed and re.search(match, result.reason), result.reason


def _unwritten_slot(inputs) -> tuple[int, int]:
    bs = inputs["block_size"]
    blocks = inputs["k_cache"].shape[0]
    free = sorted(set(range(blocks * bs)) - set(inputs["slot_mapping"].tolist()))
    return divmod(free[len(free) // 2], bs)


def test_judge_write_touching_an_unwritten_slot():
    def also_zeroes_a_slot(key, value, k_cache, v_cache, layout, slot_mapping, block_size, k_scale, v_scale):
        builtin.reference_write(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale)
        blk, off = _unwritten_slot({"block_size": block_size, "k_cache": k_cache, "slot_mapping": slot_mapping})
        k_cache[blk, off].zero_()  # an NHD cache: [blocks, block_size, Hkv, D]

    with registered("write", "t_sloppy_write", also_zeroes_a_slot, layouts=("nhd",), formats=CAST):
        report = C.check("t_sloppy_write", op="write", level="smoke")
    assert report.results and all(not r.passed for r in report.results), report.summary()
    for r in report.results:
        assert re.match(r"\d+ bytes of k_cache differ from the reference", r.reason), r.reason
        assert 0 < r.error <= r.case.num_kv_heads * r.case.head_dim * 4  # the bytes of one slot, at most


def test_judge_write_of_the_wrong_slot_and_a_skipped_token():
    case = C.Case("write", "nhd", 16, 64, 2, 1, "fp16", (37,), 3, 9)

    def off_by_one(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale):
        builtin.reference_write(key, value, k_cache, v_cache, layout, slot_mapping + 1, k_scale, v_scale)

    def skips_last(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale):
        builtin.reference_write(key[:-1], value[:-1], k_cache, v_cache, layout, slot_mapping[:-1], k_scale, v_scale)

    for fn in (off_by_one, skips_last):
        with registered("write", "t_bad_write", fn) as impl:
            result = C.run_case(impl, case)
        assert not result.passed and "bytes of k_cache differ" in result.reason, (fn.__name__, result.reason)


@pytest.mark.parametrize("kv_format", ["int8/head", "fp8_e4m3/head"])
def test_judge_write_touching_an_unwritten_slot_of_a_quantized_cache(kv_format):
    def nudges_a_slot(key, value, k_cache, v_cache, layout, slot_mapping, block_size, k_scale, v_scale):
        builtin.reference_write(key, value, k_cache, v_cache, layout, slot_mapping, k_scale, v_scale)
        blk, off = _unwritten_slot({"block_size": block_size, "k_cache": k_cache, "slot_mapping": slot_mapping})
        k_cache[blk, off].view(torch.uint8).__ixor__(1)  # every code of the slot one step away (a stray write)

    with registered("write", "t_nudge", nudges_a_slot, formats=(kv_format,)) as impl:
        result = C.run_case(impl, C.Case("write", "nhd", 16, 64, 2, 1, kv_format, (37,), 0, 9))
    assert not result.passed


def _clobbers_k_scale(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out):
    got = ok_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out)
    k_scale.mul_(3)  # after reading it: the output is right, the caller's scales are not
    return got


def _clobbers_ref_counts(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant,
                         ref_counts, out):
    got = ok_decode(q, k_cache, v_cache, layout, block_table, seq_lens, sm_scale, k_scale, v_scale, quant, out)
    ref_counts.zero_()
    return got


@pytest.mark.parametrize("what, fn, case", [
    ("k_scale", _clobbers_k_scale, C.Case("decode", "nhd", 16, 64, 2, 4, "fp8_e4m3/head", (53, 16), 0, 3)),
    ("ref_counts", _clobbers_ref_counts, C.Case("shared_prefix", "nhd", 16, 64, 2, 4, "fp16", (53, 16), 0, 3,
                                                shared=1))])
def test_judge_decode_modifying_scales_or_ref_counts(what, fn, case):
    with registered(case.op, "t_clobber", fn, formats=(case.kv_format,)) as impl:
        result = C.run_case(impl, case)
    assert not result.passed and f"modified its input {what}" in result.reason


def test_judge_copy_of_the_first_layer_only():
    def first_layer_only(pool, src, dst):
        pool[:1, :, dst.long()] = pool[:1, :, src.long()].clone()

    with registered("copy", "t_one_layer", first_layer_only):
        report = C.check("t_one_layer", op="copy", level="smoke")
    assert any(r.case.layers == 1 for r in report.results) and any(r.case.layers > 1 for r in report.results)
    for r in report.results:
        assert r.passed == (r.case.layers == 1 or r.case.pairs == 0), (r.case.id, r.reason)
        if not r.passed:
            assert re.match(r"\d+ bytes of pool differ from the reference", r.reason), r.reason


def test_judge_copy_that_modifies_src():
    def copies_then_clears_src(pool, src, dst):
        builtin.reference_copy(pool, src, dst)
        src.zero_()

    with registered("copy", "t_src", copies_then_clears_src) as impl:
        result = C.run_case(impl, C.Case("copy", "nhd", 16, 80, 2, 1, "fp16", (), 0, 4, layers=3, pairs=5))
    assert not result.passed and "modified its input src" in result.reason


# ---- 8. peers that are not installed here -------------------------------------------------------------------------
@pytest.mark.parametrize("peer, module", [("flashinfer", "flashinfer"), ("vllm_triton", "vllm")])
def test_absent_peers_are_listed_with_a_reason(peer, module):
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is importable on this machine: {peer} is registered, not absent")
    C.names()  # the built-ins (and peers) are loaded on first lookup
    assert peer in builtin.ABSENT and peer not in C.names()
    assert re.match(r"(ModuleNotFoundError|ImportError): .*" + module, builtin.ABSENT[peer]), builtin.ABSENT[peer]
    with pytest.raises(ValueError, match=rf"no implementation '{peer}'.*absent peers: \[.*'{peer}'"):
        C.get(peer)
