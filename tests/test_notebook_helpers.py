"""Helpers the notebooks import: SMOKE and its sizes, the breakdown summary, the K/V bit-identity check."""

import importlib

import torch

import workbench
from workbench import compaction, fragmentation, notebook
from workbench.allocator import ByExpectedLength
from workbench.cache import PagedKVCache


def test_smoke_is_on_under_ci_or_without_a_gpu(monkeypatch):
    monkeypatch.setenv("CI", "1")
    assert importlib.reload(notebook).SMOKE is True
    monkeypatch.delenv("CI")
    assert importlib.reload(notebook).SMOKE is (not torch.cuda.is_available())
    importlib.reload(notebook)


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
