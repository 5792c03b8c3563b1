"""Helpers the notebooks import: SMOKE and its sizes, the breakdown summary, the K/V bit-identity check, the digits
a checked output may show (sig, Bound, conclusions)."""

import importlib
import re
from decimal import ROUND_CEILING, Decimal

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import workbench
from workbench.allocator import ByExpectedLength
from workbench.analysis import fragmentation
from workbench.cache import PagedKVCache, compaction
from workbench.publish import notebook

pytestmark = pytest.mark.kernels  # the breakdown and compaction checks run the cache's kernels


def test_smoke_is_on_under_ci_or_without_a_gpu(monkeypatch):
    before = dict(vars(notebook))  # a reload makes new classes (Bound): modules that imported the old keep them
    try:
        monkeypatch.setenv("CI", "1")
        assert importlib.reload(notebook).SMOKE is True
        monkeypatch.delenv("CI")
        assert importlib.reload(notebook).SMOKE is (not torch.cuda.is_available())
    finally:
        vars(notebook).update(before)


def test_smoke_size():
    assert notebook.smoke_size(None, 1000, on=True) == 1000
    assert notebook.smoke_size(None, 1000, on=False) is None
    assert notebook.smoke_size("full", "small") == ("small" if notebook.SMOKE else "full")


def small_cache():
    cache = PagedKVCache(num_layers=1, num_kv_heads=2, head_dim=16, num_pages=12, page_tokens=16, block_sizes=[4, 16],
                         policy=ByExpectedLength(small=4, large=16, threshold=40))
    fragmentation.churn(cache, steps=50, seed=16)
    return cache


def test_format_breakdown():
    b = fragmentation.LiveBreakdown(token=10, reservation=2, internal=4, external=3, free=5, total=24, cached=1,
                                    stranded=6, request_block_size=16, slot_bytes=2.0)
    assert notebook.format_breakdown(b) == (
        "  token 10, reservation 2, internal 4, external 3, free 5 slots | cached 1, stranded 6 | utilization 0.62\n"
        "  paper's bars (%): token_states 41.7, reservation 8.3, internal 16.7, external 33.3")
    text = notebook.format_breakdown(fragmentation.breakdown(small_cache()))
    assert text.count("\n") == 1 and text.startswith("  token ") and "paper's bars (%)" in text


def test_kv_identical_through_a_compaction():
    cache = small_cache()
    before = compaction.kv_snapshot(cache)
    assert set(before) == set(cache.manager.seq_ids) and before
    assert compaction.kv_identical(before, cache) and compaction.kv_identical(before, compaction.kv_snapshot(cache))
    p = compaction.plan(cache, cached="evict")
    compaction.apply(cache, p)
    assert p.num_moves or p.rehomes, "the churned cache has something to compact"
    assert compaction.kv_identical(before, cache)


def test_kv_identical_sees_one_changed_bit_and_missing_sequences():
    k = torch.randn(2, 5, 2, 16, generator=torch.Generator().manual_seed(0)).half()
    v = k.clone()
    snap = {"a": (k, v), "b": (k[:, :2], v[:, :2])}
    assert compaction.kv_identical(snap, {s: (a.clone(), b.clone()) for s, (a, b) in snap.items()})
    flipped = v.clone()
    flipped.view(torch.int16)[1, 4, 1, 15] ^= 1  # the lowest bit of one element
    assert not compaction.kv_identical(snap, {**snap, "a": (k, flipped)})
    assert not compaction.kv_identical(snap, {"a": snap["a"]})
    assert not compaction.kv_identical(snap, {**snap, "c": snap["a"]})
    assert not compaction.kv_identical(snap, {**snap, "b": (k[:, :3], v[:, :3])})
    assert not compaction.kv_identical(snap, {**snap, "a": (k.float(), v)})
    zero = torch.zeros(1, 1, 1, 2, dtype=torch.float16)
    assert not compaction.kv_identical({"z": (zero, zero)}, {"z": (-zero, zero)})  # -0.0 == 0.0, but not bitwise
    assert workbench.device() is not None


# ---- digits stable on every CPU (issue 30, item 1; docs/notebooks.md) -------------------------------------------
def test_issue_example_key_number_is_the_same_on_both_cpus():
    # notebook 07's 'H2O 25% compacted: attention error': stored on one CPU, recomputed on an AMD EPYC
    a, b = (notebook.conclusions("07", {"H2O 25% compacted: attention error": v})._repr_mimebundle_()
            for v in (0.24835937537272063, 0.2483593750007545))
    assert a == b and a[notebook.KEY_NUMBERS_MIME]["numbers"] == {"H2O 25% compacted: attention error": 0.248}
    assert a["text/plain"].endswith(" 0.248")


def test_issue_example_max_rel_error_is_its_bound():
    # notebook 07's 'max rel. error 5.8e-04' there, '5.9e-04' here: fp16 rounding, shown as the bound it meets
    assert {f"{notebook.Bound(v):.1e}" for v in (5.8448e-4, 5.8505e-4, 5.9e-4)} == {"< 1e-03"}


def test_bound_formats_as_its_claim_and_stays_a_float():
    b = notebook.Bound(5.84e-4)
    assert (str(b), repr(b), f"{b}", f"{b:.3g}", f"{b:>10.2e}", f"{b:<9}|", f"{b:^9}|") == (
        "< 1e-03", "< 1e-03", "< 1e-03", "< 1e-03", "   < 1e-03", "< 1e-03  |", " < 1e-03 |")
    assert b.limit == 1e-3 and b < 1e-3 and b * 2 == 1.168e-3 and sorted([b, 1e-4])[0] == 1e-4
    assert [str(notebook.Bound(v)) for v in (0.0, 1e-3, 1e-7, 0.2, 12.0, float("inf"))] == [
        "0", "< 1e-02", "< 1e-06", "< 1e+00", "< 1e+02", "inf"]  # 1e-7's double is below 10**-7
    c = notebook.conclusions("t", {"err": b, "n": 1})._repr_mimebundle_()
    assert c[notebook.KEY_NUMBERS_MIME]["numbers"]["err"] == "< 1e-03" and "err: < 1e-03" in c["text/plain"]
    assert notebook.format_value(b) == "< 1e-03"
    with pytest.raises(ValueError, match=re.escape("numbers['e'] must be finite")):
        notebook.conclusions("t", {"e": notebook.Bound(float("inf"))})


@pytest.mark.parametrize("bad", [-1e-9, -1.0, float("-inf"), "x", None])
def test_bound_refuses_what_is_not_an_error(bad):
    with pytest.raises((ValueError, TypeError)):
        notebook.Bound(bad)


@given(st.floats(min_value=1e-30, max_value=1e30))
def test_bound_is_the_power_of_ten_above(x):
    b = notebook.Bound(x)
    assert x < b.limit <= 10 * x * (1 + 1e-15)
    assert str(b) == f"< {b.limit:.0e}" and float(str(b)[2:]) == b.limit


@given(st.floats(min_value=1e-30, max_value=1e30), st.sampled_from([1 + 1e-9, 1 - 1e-9]))
def test_key_digits_and_bounds_survive_float_noise(x, noise):
    lo, hi = sorted((x, x * noise))
    assert str(notebook.Bound(lo)) == str(notebook.Bound(hi)) or notebook.Bound(lo).limit <= hi
    if not _crosses_a_rounding_midpoint(lo, hi):
        assert notebook.sig(lo) == notebook.sig(hi) and notebook.format_value(lo) == notebook.format_value(hi)


def _crosses_a_rounding_midpoint(lo: float, hi: float) -> bool:
    """Whether a midpoint between two neighbouring 3-significant-digit values lies in ``[lo, hi]`` (exactly)."""
    d_lo, d_hi = Decimal(lo), Decimal(hi)
    step = Decimal(10) ** (d_lo.adjusted() - notebook.KEY_DIGITS + 1)
    k = (d_lo / step - Decimal("0.5")).to_integral_value(rounding=ROUND_CEILING)
    return (k + Decimal("0.5")) * step <= d_hi


@given(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300))
def test_sig_rounds_to_the_key_digits(x):
    s = notebook.sig(x)
    assert notebook.sig(s) == s and notebook.format_value(s) == notebook.format_value(x)
    if x:
        assert abs(s - x) <= 0.5 * 10.0 ** (int(f"{abs(x):.16e}".split("e")[1]) - 2) * (1 + 1e-9)
        assert len(re.sub(r"e.*", "", repr(abs(s))).replace(".", "").strip("0")) <= notebook.KEY_DIGITS  # shortest repr


@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(str.strip),
                       st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-10**12, 10**12),
                                 st.booleans()), min_size=1, max_size=6))
def test_conclusions_carry_what_they_show(numbers):
    payload = notebook.conclusions("t", numbers)._repr_mimebundle_()[notebook.KEY_NUMBERS_MIME]["numbers"]
    for name, value in numbers.items():
        got = payload[name]
        assert got == (notebook.sig(value) if isinstance(value, float) else value)
        assert notebook.format_value(got) == notebook.format_value(value)


def test_as_bounds_marks_the_rounding_rows_only():
    rows = [{"scheme": "fp16", "err": 7.55e-4, "b": 768}, {"scheme": "int8", "err": 0.0138, "b": 384}]
    out = notebook.as_bounds(rows, ("err",), scheme=("fp16", "bf16"))
    assert [type(r["err"]) for r in out] == [notebook.Bound, float] and out[0]["b"] == 768
    assert rows[0]["err"].__class__ is float, "the rows given are not changed"
    assert f"{out[0]['err']:.3g} {out[1]['err']:.3g}" == "< 1e-03 0.0138"


@pytest.mark.parametrize("columns, where, needle", [
    (("nope",), {"scheme": ("fp16",)}, "columns ['nope']"),
    (("err",), {"scheme": "fp16"}, "scheme must be a tuple"),
    (("err",), {"scheme": 3}, "scheme must be a tuple"),
])
def test_as_bounds_names_bad_arguments(columns, where, needle):
    rows = [{"scheme": "fp16", "err": 1e-4}]
    with pytest.raises(ValueError, match=re.escape(needle)):
        notebook.as_bounds(rows, columns, **where)
    assert rows == [{"scheme": "fp16", "err": 1e-4}]
