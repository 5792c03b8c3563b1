"""Sparsification policies (workbench.compress.policies), the CSR store and the study's scoring.

One contract for every policy: its keep set has exactly the budget's tokens (the threshold: its semantics), always
the sinks and the window, and a full budget reads exactly the full cache.
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.compress import observation, policies, recall_study, sparsity_study
from workbench.compress.block_keep import block_keep
from workbench.compress.csr import CSRStore, csr_nbytes
from workbench.compress.observation import Observation, attention_output
from workbench.compress.policies import resolve_budget

BUDGETED = ("streaming", "h2o", "snapkv", "quest")


@pytest.fixture(scope="module")
def obs():
    return observation.synthetic_observation(num_layers=2, num_tokens=83, num_kv_heads=2, head_dim=16, num_queries=6)


def _forced(T, sinks, window):
    m = torch.zeros(T, dtype=torch.bool)
    m[:sinks] = True
    m[max(0, T - window):] = True
    return m


# ---- registry ------------------------------------------------------------------------------------------------------


def test_registry_lists_every_name_and_entries_are_frozen_labelled_configs():
    assert policies.NAMES == tuple(policies.POLICIES) == ("full", "streaming", "h2o", "snapkv", "threshold", "quest")
    for name, cfg in policies.POLICIES.items():
        assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen, name
        hash(cfg)
        assert isinstance(cfg.label, str) and cfg.label, name
        assert policies.get(name) is cfg and policies.get(cfg) is cfg and cfg.build(None) is cfg
    assert policies.get("h2o", budget=0.25, sinks=4, window=32) == policies.H2O(0.25, 4, 32)


def test_unknown_names_and_options_are_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match="policy must be one of") as e:
        policies.get("tova")
    for name in policies.NAMES:
        assert repr(name) in str(e.value)
    with pytest.raises(ValueError, match="no option"):
        policies.get("h2o", no_such_field=1)
    with pytest.raises(ValueError, match="threshold"):
        policies.get("threshold", threshold=2.0)


# ---- budgets and arguments -----------------------------------------------------------------------------------------


def test_resolve_budget():
    assert resolve_budget(10, 100) == 10 and resolve_budget(500, 100) == 100
    assert resolve_budget(0.25, 100) == 25 and resolve_budget(0.255, 100) == 26 and resolve_budget(1.0, 7) == 7
    assert resolve_budget(0.01, 10) == 1  # at least one token
    for bad in (True, False, 0, -3, 0.0, -0.5, 1.5, math.nan, math.inf, "0.5", None, [1]):
        with pytest.raises(ValueError, match="budget"):
            resolve_budget(bad, 100)
    for bad_t in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="T must"):
            resolve_budget(4, bad_t)


BAD = {  # field -> values it must refuse (each policy that has the field)
    "budget": [True, 0, -1, 0.0, 1.01, math.nan, "1", None],
    "sinks": [-1, 1.5, True, "4", None],
    "window": [-1, -0.1, 1.5, math.nan, True, "8"],
    "obs_window": [0, -2, 2.5, True],
    "kernel": [0, 4, 7.0, False],
    "threshold": [0, 0.0, 1, 1.0, -0.1, math.nan, True, "0.1"],
    "page_size": [0, -16, 16.0, True],
}
CASES = [(name, f, v) for name in policies.NAMES for f in BAD if f in {x.name for x in dataclasses.fields(
    policies.POLICIES[name])} for v in BAD[f]]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(CASES))
def test_bad_fields_are_refused_naming_the_field(case):
    name, field, value = case
    with pytest.raises(ValueError, match=field):
        policies.get(name, **{field: value})


def test_observation_and_block_keep_refuse_bad_arguments(obs):
    with pytest.raises(ValueError, match="k and v"):
        Observation(obs.k, obs.v[:, :-1], obs.q, 0.25)
    with pytest.raises(ValueError, match="q must be"):
        Observation(obs.k, obs.v, obs.q[..., :-1], 0.25)
    with pytest.raises(ValueError, match="q must hold"):
        Observation(obs.k[:, :3], obs.v[:, :3], obs.q, 0.25)
    for bad in (0, -1.0, math.inf, True, "0.25"):
        with pytest.raises(ValueError, match="sm_scale"):
            Observation(obs.k, obs.v, obs.q, bad)
    keep = torch.ones(10, dtype=torch.bool)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="block_size"):
            block_keep(keep, bad)
    with pytest.raises(ValueError, match="partial"):
        block_keep(keep, 4, "drop")
    with pytest.raises(ValueError, match="keep must"):
        block_keep(keep.int(), 4)
    with pytest.raises(ValueError, match="mask must"):
        attention_output(obs, keep)


# ---- the contract --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUDGETED)
@pytest.mark.parametrize("budget", [1, 9, 20, 0.3, 0.5])
def test_keep_holds_exactly_the_budget_and_always_the_sinks_and_window(obs, name, budget):
    T = obs.num_tokens
    sinks, window = (1, 1) if name == "quest" else (4, 8)
    pol = policies.get(name, budget=budget, sinks=sinks, window=window)
    keep, per_head = pol.keep(obs), pol.per_head_keep(obs)
    assert keep.shape == (T,) and keep.dtype == torch.bool
    assert per_head.shape == (obs.k.shape[0], obs.k.shape[2], T) and per_head.dtype == torch.bool
    n = resolve_budget(budget, T)
    if name == "quest":  # whole pages: ceil(n / page_size) of them, each page's tokens
        ps = pol.page_size
        r = block_keep(keep, ps, "keep")
        assert torch.equal(r.mask, keep) and r.blocks == min(-(-n // ps), -(-T // ps))
        forced = _forced(T, 1, 1) if -(-n // ps) >= 2 else _forced(T, 1, 0)
    else:
        assert int(keep.sum()) == n, (name, budget, int(keep.sum()), n)
        assert bool((per_head.sum(-1) == n).all())
        if name == "streaming":  # sinks + the newest
            assert bool((keep == _forced(T, min(4, n), n - min(4, n))).all())
        forced = _forced(T, min(sinks, n), min(window, n - min(sinks, n)))
    assert bool(keep[forced].all()) and bool(per_head[..., forced].all())


def test_sinks_then_newest_fill_a_budget_smaller_than_sinks_plus_window(obs):
    keep = policies.get("h2o", budget=10, sinks=4, window=32).keep(obs)
    assert bool((keep == _forced(obs.num_tokens, 4, 6)).all())
    assert bool((policies.get("snapkv", budget=3, sinks=4).keep(obs) == _forced(obs.num_tokens, 3, 0)).all())


def test_window_as_a_share_of_the_budget(obs):
    keep = policies.get("h2o", budget=20, sinks=2, window=0.5).keep(obs)
    assert int(keep.sum()) == 20 and bool(keep[_forced(obs.num_tokens, 2, 10)].all())


@pytest.mark.parametrize("name", policies.NAMES)
def test_a_full_budget_reads_exactly_the_full_cache(obs, name):
    over = {"threshold": {"threshold": 1e-30, "window": obs.num_tokens}, "full": {}}.get(name, {"budget": 1.0})
    pol = policies.get(name, **over)
    full = attention_output(obs)
    for budget_pol in [pol] + ([policies.get(name, budget=obs.num_tokens)] if "budget" in over else []):
        keep = budget_pol.keep(obs)
        assert bool(keep.all()) and bool(budget_pol.per_head_keep(obs).all())
        assert torch.equal(attention_output(obs, keep), full)
        assert observation.attention_error(obs, keep) == 0.0


def test_heavy_hitters_find_the_looked_up_tokens_a_window_misses(obs):
    # the synthetic queries look up random tokens: accumulated attention finds them, a window cannot
    err = {n: observation.attention_error(obs, policies.get(n, budget=0.25, sinks=4, window=4).keep(obs))
           for n in ("streaming", "h2o")}
    assert err["h2o"] < 0.7 * err["streaming"], err


def test_snapkv_scores_are_the_last_queries_attention_max_pooled(obs):
    pol = policies.get("snapkv", obs_window=2, kernel=3)
    p = observation.attention_probs(obs)[:, :, :, -2:].sum((2, 3))  # [L, Hkv, T]
    pad = torch.nn.functional.pad(p, (1, 1), value=float("-inf"))
    expect = torch.stack([pad[..., :-2], pad[..., 1:-1], pad[..., 2:]]).amax(0)
    torch.testing.assert_close(pol.score(obs), expect)


def test_h2o_is_causal(obs):
    # a query never weighs keys after its position: the first observed query sees T - W + 1 keys
    p = observation.attention_probs(obs)
    T, W = obs.num_tokens, obs.num_queries
    assert float(p[..., 0, T - W + 1:].abs().max()) == 0.0
    torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)))


# ---- threshold and CSR ---------------------------------------------------------------------------------------------


def test_threshold_keeps_entries_over_the_threshold_plus_sinks_and_window(obs):
    pol = policies.get("threshold", threshold=0.02, sinks=2, window=3)
    score = pol.score(obs)  # [L, Hkv, T]
    per_head = pol.per_head_keep(obs)
    forced = _forced(obs.num_tokens, 2, 3)
    assert torch.equal(per_head, (score >= 0.02) | forced)
    assert 0 < int(per_head.sum()) < per_head.numel()
    assert torch.equal(pol.keep(obs), per_head.any(0).any(0))
    assert torch.equal(pol.store(obs).mask(), per_head)


def test_csr_round_trip_bytes_and_attention_equal_masked_dense(obs):
    L, T, H, D = obs.k.shape
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(L, H, T, generator=g) < 0.3
    mask[0, 1] = False  # an empty row: its queries get zeros
    store = CSRStore.from_mask(obs.k, obs.v, mask)
    assert store.indptr.dtype == store.indices.dtype == torch.int32 and store.indptr.numel() == L * H + 1
    assert store.nnz == int(mask.sum()) and torch.equal(store.mask(), mask)
    k, v = store.to_dense()
    m = mask.permute(0, 2, 1)[..., None]  # [L, T, Hkv, 1]
    assert torch.equal(k, torch.where(m, obs.k, 0.0)) and torch.equal(v, torch.where(m, obs.v, 0.0))
    assert store.nbytes("fp16") == 2 * store.nnz * D * 2 + 4 * (store.nnz + L * H + 1)
    assert store.nbytes("fp8") == csr_nbytes(store.nnz, L * H, D, "fp8") == 2 * store.nnz * D + 4 * (store.nnz + L * H
                                                                                                       + 1)
    out, ref = store.attention(obs.q, obs.sm_scale), attention_output(obs, mask)
    G = obs.q.shape[2] // H
    assert float(out[0, :, G:2 * G].abs().max()) == 0.0
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="indptr"):
        CSRStore(store.indptr[:-1], store.indices, store.k, store.v, T, H)
    with pytest.raises(ValueError, match="indices"):
        CSRStore(store.indptr, store.indices + T, store.k, store.v, T, H)
    with pytest.raises(ValueError, match="mask"):
        CSRStore.from_mask(obs.k, obs.v, mask.float())


# ---- block granularity ---------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=70), st.integers(1, 9))
def test_block_keep_invariants(bits, block_size):
    keep = torch.tensor(bits)
    T, total = keep.numel(), -(-keep.numel() // block_size)
    kept = keep.reshape(-1) if T % block_size == 0 else torch.cat([keep, keep.new_zeros(total * block_size - T)])
    touched = kept.reshape(total, block_size).any(-1)
    r = block_keep(keep, block_size, "keep")
    assert r.blocks == int(touched.sum()) and r.freed == total - r.blocks and r.moved == 0
    assert bool(r.mask[keep].all())  # rounded up: every kept token still read
    assert torch.equal(r.mask, touched.repeat_interleave(block_size)[:T])  # whole blocks only
    c = block_keep(keep, block_size, "compact")
    assert torch.equal(c.mask, keep) and c.blocks == -(-int(keep.sum()) // block_size) <= r.blocks
    assert c.freed == total - c.blocks and 0 <= c.moved <= int(keep.sum())
    whole = torch.equal(r.mask, keep)  # every touched block kept whole: each chunk is an old block, nothing moves
    assert (c.moved == 0) == whole


def test_compaction_moves_the_chunks_that_match_no_old_block():
    keep = torch.zeros(24, dtype=torch.bool)
    keep[[0, 1, 2, 5, 9, 10, 11, 12, 13, 14, 15, 22]] = True  # the example of tests/test_compress_evict.py
    assert block_keep(keep, 4, "compact")[1:] == (3, 3, 12)
    keep = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 1, 1], dtype=torch.bool)
    assert block_keep(keep, 4, "compact")[1:] == (2, 1, 3)  # [0 1 2 3] stays, [5 8 9] is copied


def test_keep_blocks_chooses_whole_blocks(obs):
    pol = policies.get("h2o", budget=32, sinks=4, window=4)
    m = pol.keep_blocks(obs, 8)
    r = block_keep(m, 8, "keep")
    assert torch.equal(r.mask, m) and r.blocks == 4 and bool(m[:4].all()) and bool(m[-4:].all())


# ---- study ---------------------------------------------------------------------------------------------------------


def test_score_policies_rows(obs):
    rows = sparsity_study.score_policies([obs], budgets=(0.25,), block_size=8, thresholds=(0.02,), held_out=2)
    L = obs.k.shape[0]
    per = {(r["policy"], r["partial"]) for r in rows}
    assert ("threshold", "blocks") not in per and ("h2o", "keep-equal") in per and ("quest", "compact") in per
    assert len(rows) == (L + 1) * len(per)
    for r in rows:
        assert 0 <= r["error"] < 2 and r["blocks_kept"] <= r["blocks_full"] and r["bytes_kept"] <= r["bytes_full"]
        if r["policy"] == "full":
            assert r["error"] == r["error_per_head"] == 0.0 and r["freed"] == 0
        if r["partial"] == "keep-equal":
            twin = next(x for x in rows if x["policy"] == r["policy"] and x["partial"] == "compact"
                        and x["layer"] == r["layer"])
            assert r["blocks_kept"] <= twin["blocks_kept"]
    a = next(r for r in rows if r["policy"] == "h2o" and r["partial"] == "compact" and r["layer"] == "all")
    assert a["tokens_kept"] == resolve_budget(0.25, obs.num_tokens - 2) + 2  # the held-out tokens appended whole
    assert a["bytes_kept"] == L * a["blocks_kept"] * 8 * 2 * 16 * 2 * 2
    s = sparsity_study.summarize(rows)
    assert {(d["policy"], d["partial"]) for d in s} == per and all(d["n"] == 1 for d in s)
    # without the per-head masks (the panel's rows): the same rows, their per-head columns None
    shared = sparsity_study.score_policies([obs], budgets=(0.25,), block_size=8, thresholds=(0.02,), held_out=2,
                                           per_head=False)
    heads = ("tokens_per_head", "bytes_csr", "error_per_head")
    assert [{k: v for k, v in r.items() if k not in heads} for r in shared] == [
        {k: v for k, v in r.items() if k not in heads} for r in rows]
    assert all(r[k] is None for r in shared for k in heads)
    with pytest.raises(ValueError, match="partial"):
        sparsity_study.score_policies([obs], ["h2o"], partial="drop")


def test_attention_error_and_quest_recall_rows(obs):
    keep = policies.get("h2o", budget=0.5).keep(obs)
    per_layer = observation.attention_error(obs, keep, by_layer=True)
    assert len(per_layer) == obs.k.shape[0] and all(e > 0 for e in per_layer)
    assert observation.attention_error(obs, keep, last=1) >= 0
    with pytest.raises(ValueError, match="last"):
        observation.attention_error(obs, keep, last=0)
    rows = recall_study.quest_recall_rows([obs], page_sizes=(8,), page_budgets=(2, 1.0))
    assert len(rows) == 2 * obs.k.shape[0]
    full = [r for r in rows if r["page_budget"] == 1.0]
    assert all(abs(r["recall"] - 1) < 1e-5 and abs(r["recall_per_head"] - 1) < 1e-5 for r in full)
    assert all(abs(r["recall_topk"] - 1) < 1e-5 for r in full) and all(0 < r["recall_topk"] <= 1 for r in rows)
    assert all(0 < r["recall"] <= r["recall_oracle"] + 1e-6 for r in rows)
