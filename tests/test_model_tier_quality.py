"""A lossy host tier's cost on a model (``workbench.model.tier_quality``, ``bench model_quality --sections tiers``):
a prompt's prefix demoted through a real TieredCache in a format and promoted back equals the format's reference
roundtrip, the fp16 tier is the exact reference, a 2-bit tier drifts more than an 8-bit one, the bench's smoke rows,
bad arguments refused by name. The model-free tests run a 2-layer random-weights llama; the bench smoke needs
SmolLM2-135M (skipped with the install hint otherwise)."""

import json
import random

import pytest
import torch

from workbench.bench import model_quality
from workbench.cache import PagedKVCache
from workbench.model import SMOLLM2_135M, Llama, random_weights, tier_quality
from workbench.model.gguf_weights import model_available
from workbench.tiers import TieredCache, formats

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: a busy 2-core CPU runs one thread 10x faster

CFG = SMOLLM2_135M.with_layers(2)
PROMPT, NEW = 70, 4  # two full 32-token blocks of each prompt go down and come back


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, random_weights(CFG, seed=2))


@pytest.fixture(scope="module")
def text():
    return torch.randint(0, CFG.vocab_size, (300,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module")
def rows(model, text):
    return tier_quality.evaluate_tiers(model, text, host_formats=["fp16", "int8/token", "int2/token"], prompts=2,
                                       prompt_tokens=PROMPT, new_tokens=NEW)


def test_the_prefix_comes_back_as_the_formats_roundtrip(model, text):
    wins = tier_quality.windows(text, 2, PROMPT, NEW)
    for fmt, lossy in (("fp16", False), ("int4/token", True)):
        run = tier_quality.tier_run(model, wins, PROMPT, fmt)
        assert run.roundtrip_equal and run.lossy is lossy
        assert run.prefix_tokens == [64, 64] and run.stats["promoted_host"] == 4 and run.stats["format"] == (
            "device" if fmt == "fp16" else fmt)
        assert run.forced.logprobs.shape == (2 * NEW,) and [len(g) for g in run.greedy] == [NEW, NEW]
        assert run.block_bytes == (run.device_block_bytes if fmt == "fp16" else run.block_bytes)
    assert run.block_bytes < run.device_block_bytes / 3


def test_rows_against_the_fp16_tier(rows):
    ref, fine, coarse = rows
    assert [r["host_format"] for r in rows] == ["fp16", "int8/token", "int2/token"]
    assert all(r["section"] == "tier" and r["reference"] == "fp16" and r["roundtrip_equal"] for r in rows)
    assert ref["agreement"] == 1.0 and ref["mean_kl"] == ref["max_abs_drift"] == 0 and not ref["lossy"]
    assert ref["perplexity"] == ref["ref_perplexity"] == fine["ref_perplexity"]
    assert 0 < fine["mean_kl"] < coarse["mean_kl"] and fine["lossy"] and coarse["lossy"]
    assert ref["bytes_per_token"] == 2 * CFG.num_key_value_heads * CFG.head_dim * 2  # one layer's fp16 K and V
    assert coarse["fp16_bytes_fraction"] < fine["fp16_bytes_fraction"] < 1
    assert all(r["prefix_tokens"] == 64 and r["scored_tokens"] == 2 * NEW for r in rows)


def test_tier_kv_promotes_before_it_reads(model, text):
    cache = PagedKVCache(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, 8, page_tokens=32,
                         device="cpu", ops="torch")
    tc = TieredCache(cache, host_bytes=4 * formats.block_bytes(cache, formats.DEVICE, 32), host_format="int8/token")
    kv = tier_quality.TierKV(tc)
    k = torch.randn(CFG.num_hidden_layers, 70, CFG.num_key_value_heads, CFG.head_dim)
    kv.add("a", text[:70], k, k * 0.5)
    kv.free("a")
    tc.evict()
    pk, pv = kv.read_prefix(text[:70])  # promoted from the host: int8's roundtrip, not the bytes that went down
    assert pk.shape[1] == 64 and tc.stats()["promoted_host"] == 2
    assert 0 < (pk - k[:, :64].half().float()).abs().max() < 0.1 and torch.allclose(pv, pk * 0.5, atol=0.05)
    assert kv.read_prefix(text[100:120]) == (None, None)
    with pytest.raises(ValueError, match="tiered"):
        tier_quality.TierKV(cache)
    tc.close()


def test_device_blocks_are_what_the_mover_gathers():
    cache = PagedKVCache(2, 3, 64, 4, page_tokens=32, device="cpu", ops="torch")
    cache.blocks(32).normal_()
    tc = TieredCache(cache, host_bytes=4 * formats.block_bytes(cache, formats.DEVICE, 32), fsync=False, path="dma")
    starts = tc.lower.host.allocate([1, 1])
    tc.lower.mover.to_host(32, [2, 0], starts)
    assert torch.equal(tier_quality.device_blocks(cache, 32, [2, 0]), tc.lower.host.buffer[starts])
    tc.close()


def test_windows_and_agreement_on_random_tokens():
    rng = random.Random(5)
    toks = [rng.randrange(1000) for _ in range(200)]
    wins = tier_quality.windows(toks, 3, 50, 10)
    assert [len(w) for w in wins] == [60] * 3 and wins[0] == toks[:60] and wins[-1] == toks[-60:]
    ref = [[rng.randrange(9) for _ in range(8)] for _ in range(3)]
    got = [list(r) for r in ref]
    got[1][5] = ref[1][5] + 1
    got[2][0] = ref[2][0] + 1
    a = tier_quality.agreement(got, ref)
    assert a["agreement"] == 22 / 24 and a["first_divergence_mean"] == (8 + 5 + 0) / 3
    assert a["first_divergence_min"] == 0
    with pytest.raises(ValueError, match="got and ref"):
        tier_quality.agreement(got[:2], ref)
    with pytest.raises(ValueError, match="text_tokens"):
        tier_quality.windows(toks[:40], 2, 50, 10)
    with pytest.raises(ValueError, match="prompt_tokens"):
        tier_quality.windows(toks, 2, 0, 10)


def test_bad_arguments_are_refused_by_name(model, text):
    with pytest.raises(ValueError, match="prompt_tokens must exceed"):
        tier_quality.evaluate_tiers(model, text, prompt_tokens=32, new_tokens=2)
    with pytest.raises(ValueError, match="host_formats"):
        tier_quality.evaluate_tiers(model, text, host_formats=[], prompt_tokens=40)
    with pytest.raises(ValueError, match="window"):
        tier_quality.tier_run(model, [text[:40]], 40, "int8/token")
    with pytest.raises(ValueError, match="host_format"):
        tier_quality.tier_run(model, [text[:50]], 40, "int8/tensor")  # static scales: no tier format
    for argv in (["--sections", "tiers,layers"], ["--tier-formats", "fp16,int8/tensor"],
                 ["--tier-formats", "fp16,int3/token"], ["--sections", "tiers", "--tier-prompt-tokens", "16"]):
        with pytest.raises(SystemExit) as e:
            model_quality.main(["--smoke", *argv])
        assert e.value.code == 2


@pytest.mark.skipif(model_available() is not None, reason=str(model_available()))
def test_bench_smoke_writes_tier_rows(tmp_path, capsys):
    argv = ["--smoke", "--sections", "tiers", "--tier-formats", "fp16,int4/token", "--out", str(tmp_path)]
    assert model_quality.main(argv) == 0
    (path,) = tmp_path.glob("model-quality-*.json")
    doc = json.loads(path.read_text())
    assert doc["mode"] == "smoke" and doc["sections"] == ["tiers"] and doc["meta"]["gpu"].startswith("cpu")
    assert doc["tiers"]["host_formats"] == ["fp16", "int4/token"] and "TieredCache" in doc["tiers"]["how"]
    ref, int4 = doc["rows"]
    assert ref["host_format"] == "fp16" and ref["agreement"] == 1.0 and ref["mean_kl"] == 0.0
    assert int4["lossy"] and int4["roundtrip_equal"] and int4["mean_kl"] > 0 and int4["prefix_tokens"] == 32
    assert "commit" in int4 and "host_format" in capsys.readouterr().out
