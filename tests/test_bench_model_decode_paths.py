"""``bench model_decode``'s sections ``cascade`` and ``quest`` (issue 33): the smoke run's rows (the cascade gives plain
decode's tokens, every row says how it attended, Quest's agreement with the full cache is a share), the chunked
prefill against one prefill, the agreement figures on known tokens, and bad arguments refused before any work."""

import json

import pytest
import torch

import workbench
from workbench.bench import model_decode
from workbench.bench import model_decode_paths as paths
from workbench.model import SMOLLM2_135M, Llama, PagedKV, Runner, random_weights
from workbench.model.quality import prefill_all

pytestmark = pytest.mark.kernels  # the smoke run launches Triton kernels (compiled on a GPU)

CFG = SMOLLM2_135M.with_layers(2)


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, random_weights(CFG, seed=4), device=workbench.device())


def test_smoke_rows_cascade_gives_plain_tokens_and_quest_agreement_is_a_share(tmp_path):
    assert model_decode.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("model-decode-*.json")
    doc = json.loads(path.read_text())
    assert doc["mode"] == "smoke" and doc["meta"]["commit"]
    steps = 2 * CFG.num_hidden_layers  # (decode step, layer)s: 3 new tokens, the first the prefill's
    cascade = [r for r in doc["rows"] if r["section"] == "cascade"]
    assert [r["shared_prefix"] for r in cascade] == list(paths.SHARED_MODES)
    for r in cascade:
        assert r["samples"] == 2 and r["prompt"] == 40 and r["tokens_per_s"] > 0 and r["step_ms"] > 0
        assert r["tokens_equal_plain"] and r["agree_overall"] == 1 and sum(r["paths"].values()) == steps
    assert cascade[0]["paths"] == {"plain": steps} and cascade[0]["speedup_vs_plain"] == 1
    assert cascade[2]["paths"] == {"shared": steps}  # 2 samples hold the prompt's 2 full blocks
    quest = [r for r in doc["rows"] if r["section"] == "quest"]
    assert [(r["batch"], r["page_budget"]) for r in quest] == [(2, None), (2, 2)]
    for r in quest:
        assert r["prompt"] == 40 and r["tokens_per_s"] > 0 and "smoke figure" in r["note"]
        assert 0 <= r["agree_to_divergence"] <= r["agree_overall"] <= 1  # equal up to the divergence: a lower bound
        assert r["tokens_equal"] == (r["agree_to_divergence"] == 1)
        if r["kv"] == "full":
            assert r["paths"] == {"plain": steps} and r["tokens_equal"] and r["budget_tokens"] is None
        else:  # 3 pages held, 2 read: every (step, layer) by Quest
            assert r["paths"] == {"quest": steps} and r["budget_tokens"] == 16 * r["page_budget"]


def test_chunked_prefill_is_one_prefill(model):
    toks = torch.randint(5, CFG.vocab_size, (45,), generator=torch.Generator().manual_seed(7)).tolist()
    (ref,) = prefill_all(model, [toks])
    for chunk in (16, 45, 64):
        got = paths.prefill_chunked(model, toks, chunk)
        assert got.tokens == toks and got.k.shape == ref.k.shape == (CFG.num_hidden_layers, 45,
                                                                     CFG.num_key_value_heads, CFG.head_dim)
        for a, b in ((got.k, ref.k), (got.v, ref.v), (got.logits, ref.logits)):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-3)  # summation order only
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="chunk"):
            paths.prefill_chunked(model, toks, bad)
    with pytest.raises(ValueError, match="tokens"):
        paths.prefill_chunked(model, [], 4)


def test_agreement_on_known_tokens():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(0, 100, (2, 8), generator=g).tolist()
    b = [list(a[0]), list(a[1])]
    b[0][2] += 1  # first differs at 2 of 8, then agrees
    b[1][6] += 1
    b[1][7] += 1
    got = paths.agreement(a, b)
    assert got["agree_to_divergence"] == pytest.approx((2 / 8 + 6 / 8) / 2)
    assert got["agree_overall"] == pytest.approx((7 / 8 + 6 / 8) / 2) and not got["tokens_equal"]
    assert paths.agreement(a, a) == {"agree_to_divergence": 1.0, "agree_overall": 1.0, "tokens_equal": True}
    for ref, other in (([], []), (a, a[:1]), (a, [a[0], a[1][:7]]), ([[]], [[]])):
        with pytest.raises(ValueError, match="ref and got|same number"):
            paths.agreement(ref, other)


def test_greedy_decode_times_the_steps_after_warmup(model):
    toks = torch.randint(5, CFG.vocab_size, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = Runner(model, PagedKV(paths.paged_cache(model, 2, 24, "fp32")))
    first = int(runner.prefill(0, toks)[0].argmax())
    runner.prefill(1, toks)
    out, secs = paths.greedy_decode(runner, [0, 1], [first, first], 3, 1)
    assert len(out) == 2 and out[0] == out[1] and len(out[0]) == 3 and secs > 0
    for steps, warmup, match in ((1, 1, "steps"), (2, -1, "warmup"), (True, 0, "steps")):
        with pytest.raises(ValueError, match=match):
            paths.greedy_decode(runner, [0, 1], [first, first], steps, warmup)
    with pytest.raises(ValueError, match="first"):
        paths.greedy_decode(runner, [0, 1], [first], 2, 0)


def test_bad_arguments_are_refused_before_any_work(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(paths, "prefill_chunked", lambda *a, **k: pytest.fail("prefilled before checking"))
    for kw, match in ((dict(sections=("cascade", "graph")), "sections"), (dict(sections=()), "sections"),
                      (dict(new_tokens=3), "new_tokens"), (dict(new_tokens=True), "new_tokens"),
                      (dict(warmup=-1), "warmup"), (dict(samples=1), "samples"), (dict(long_prompt=0), "long_prompt"),
                      (dict(chunk=2.0), "chunk"), (dict(batches=()), "batches"), (dict(batches=(1, 0)), "batches"),
                      (dict(budgets=(64, 1)), "page_budget"), (dict(budgets=(True,)), "page_budget")):
        with pytest.raises(ValueError, match=match):
            paths.run(model, "fp32", **kw)
    with pytest.raises(ValueError, match="max_position_embeddings"):  # the 32k prompt past the 8192 RoPE table
        paths.run(model, "fp32", sections=("quest",), long_prompt=CFG.max_position_embeddings)
    assert paths.positions_needed(("cascade", "quest"), 4096, 32768, 256) == 33024
    with pytest.raises(ValueError, match="samples"):
        paths.cascade_rows(model, None, 1, 3, 1, "fp32")
    for argv, match in ((["--sections", "decode,graph"], "--sections"),
                        (["--sections", "quest", "--new-tokens", "3"], "new_tokens"),
                        (["--quest-budgets", "64,1"], "page_budget"), (["--samples", "1"], "samples")):
        with pytest.raises(SystemExit) as e:
            model_decode.main([*argv, "--out", str(tmp_path)])
        assert e.value.code == 2 and match in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_attend_timing_leaves_the_cache_and_the_rows_paths_as_they_were(model, monkeypatch):
    """On a GPU each row times one layer's kv.attend (do_bench, here replaced by two calls): the open step is aborted
    (the sequences keep their lengths), and the row's paths count the decode steps only."""
    calls = []
    monkeypatch.setattr(paths.harness, "time_us", lambda fn: (calls.append(fn()), calls.append(fn()), 250.0)[-1])
    toks = torch.randint(5, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    pre = paths.prefill_chunked(model, toks, 16)
    rows = paths.quest_rows(model, pre, [2], [2], 2, 1, "fp32", time_attend=True)  # 3 pages held, 2 read
    assert [r["kv"] for r in rows] == ["full", "quest"] and len(calls) == 4
    assert all(torch.isfinite(c).all() and c.shape == (2, CFG.num_attention_heads, CFG.head_dim) for c in calls)
    for r in rows:
        assert r["attend_us"] == 250.0 and r["attend_share"] == pytest.approx(2 * 250.0 / (1e3 * r["step_ms"]))
        assert sum(r["paths"].values()) == 2 * CFG.num_hidden_layers
    kv = PagedKV(paths.paged_cache(model, 1, 50, "fp32"), shared_prefix="shared")
    runner = Runner(model, kv)
    runner.add_prefilled((0, 0), pre)
    kv.fork((0, 0), (0, 1))
    assert paths.attend_us(runner, [(0, 0), (0, 1)], [7, 8]) == 250.0
    assert [kv.num_tokens(s) for s in ((0, 0), (0, 1))] == [40, 40] and kv.cache.manager.block_table((0, 0)) == \
        kv.cache.manager.block_table((0, 1))  # aborted: no copy on write kept, nothing appended
