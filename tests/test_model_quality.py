"""Quantized caches against the fp16 cache on real text (``workbench.model.quality``, ``bench model_quality``):
fp16 against itself is exact, a 2-bit cache drifts more than an 8-bit one, perplexity is plausible, the smoke
benchmark writes its rows, bad arguments are refused by name. Needs SmolLM2-135M (skipped with the install hint
otherwise); the model is loaded once, and every run is a few tokens (the whole file takes about 30 s on a CPU)."""

import json

import pytest
import torch

from workbench.model.gguf_weights import model_available

if (_why := model_available()) is not None:
    pytest.skip(_why, allow_module_level=True)

from workbench.bench import model_quality  # noqa: E402
from workbench.model import quality  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: a busy 2-core CPU runs one thread 10x faster

CHUNK, PREFILL, BATCH = 24, 16, 2  # two chunks of 24 tokens: 7 scored tokens each


@pytest.fixture(scope="module")
def smol():
    return quality.smollm2()  # the bench's own cache: --smoke below does not load it again


@pytest.fixture(scope="module")
def text(smol):
    return smol[1].encode(quality.load_text())[:2 * CHUNK]


@pytest.fixture(scope="module")
def pre(smol, text):
    return quality.prefill_chunks(smol[0], text, CHUNK, PREFILL)


@pytest.fixture(scope="module")
def ref(smol, text, pre):
    return quality.forced_run(smol[0], text, "fp16", CHUNK, BATCH, prefill=PREFILL, prefilled=pre)


def test_fp16_against_itself_is_exact(smol, text, pre, ref):
    model, _ = smol
    tf = quality.teacher_forced(model, text, "fp16", CHUNK, BATCH, prefill=PREFILL, prefilled=pre)  # runs both
    s = tf.summary()
    assert s["scored_tokens"] == 2 * (CHUNK - PREFILL - 1) == ref.logprobs.numel()
    assert s["mean_abs_drift"] == s["max_abs_drift"] == s["mean_kl"] == s["max_kl"] == 0.0
    assert s["perplexity"] == s["ref_perplexity"]
    a = quality.agreement(model, [text[:12], text[20:32]], "fp16", 3)
    assert a["agreement"] == 1.0 and a["first_divergence"] == [3, 3] and a["first_divergence_min"] == 3


def test_int2_drifts_more_than_int8_and_perplexity_is_plausible(smol, text, pre, ref):
    model, _ = smol
    got = {name: quality.teacher_forced(model, text, name, CHUNK, BATCH, prefill=PREFILL, prefilled=pre,
                                        reference=ref).summary() for name in ("int8/token", "int2/token")}
    fine, coarse = got["int8/token"], got["int2/token"]
    assert 0 < fine["mean_abs_drift"] < coarse["mean_abs_drift"]
    assert 0 < fine["mean_kl"] < coarse["mean_kl"]
    for s in got.values():  # 135M model, 16-23 tokens of context into the Declaration of Independence
        assert 1.0 < s["ref_perplexity"] < 200 and 1.0 < s["perplexity"] < 1e4
    assert abs(fine["perplexity"] / fine["ref_perplexity"] - 1) < 0.2


def test_static_scheme_is_calibrated_per_cache_or_per_layer(smol):
    model, tok = smol
    sample = quality.capture_kv(model, tok.encode("We hold these truths to be self-evident."))
    H, L = model.config.num_key_value_heads, model.num_layers
    k, v = quality.static_scales("int8/head", sample)
    assert k.shape == v.shape == (H,)  # per head, one pair for all layers
    assert len(sample.layer_amax()["k"]) == L
    kl, vl = quality.static_scales("int8/head", sample, per_layer=True)
    assert kl.shape == vl.shape == (L, H) and torch.equal(kl.amax(0), k)  # the widest layer's is the per-cache one
    amax = torch.tensor(sample.layer_amax()["v"])
    assert torch.allclose(quality.static_scales("int8/tensor", sample, per_layer=True)[1], amax / 127)
    cache = quality.build_cache(model, "int8/tensor", [8], calibration=sample, per_layer_scales=True)
    assert cache.per_layer_scales and cache.k_scale.shape == (L, 1)
    with pytest.raises(ValueError, match="calibration"):
        quality.build_cache(model, "int8/tensor", [8])
    with pytest.raises(ValueError, match="per_layer"):
        quality.static_scales("int8/tensor", sample, per_layer="yes")


def test_bench_smoke_writes_the_rows(tmp_path, capsys):
    assert model_quality.main(["--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("model-quality-*.json")
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    static = [n for n in model_quality.SMOKE_SCHEMES if quality.get_scheme(n).needs_static_scales]
    assert static and [r["scheme"] for r in rows] == [x for n in model_quality.SMOKE_SCHEMES
                                                      for x in ([n, n] if n in static else [n])]
    assert [r.get("scales") for r in rows if r["static"]] == ["cache", "layer"] * len(static)  # a row of each
    assert doc["mode"] == "smoke" and doc["meta"]["gpu"].startswith("cpu") and "commit" in rows[0]
    fp16 = rows[0]
    assert fp16["agreement"] == 1.0 and fp16["mean_kl"] == 0.0 and fp16["bytes_per_token"] == 2 * 3 * 64 * 2
    assert rows[1]["bytes_per_token"] == fp16["bytes_per_token"] / 2 and "k_scale" in rows[1]
    assert len(rows[2]["k_scale"]) == len(doc["calibration_layer_amax"]["k"])  # per layer: one per layer
    assert doc["static_scales_by"] == ["cache", "layer"]
    assert "agreement" in capsys.readouterr().out


def test_bad_arguments_are_refused_by_name(smol, text):
    model, _ = smol
    with pytest.raises(ValueError, match="scheme"):
        quality.agreement(model, [text[:8]], "int3/token", 4)
    with pytest.raises(ValueError, match="scheme"):
        quality.teacher_forced(model, text, "fp17", CHUNK, BATCH)
    with pytest.raises(ValueError, match="new_tokens"):
        quality.agreement(model, [text[:8]], "fp16", 0)
    with pytest.raises(ValueError, match="new_tokens"):
        quality.evaluate_all(model, text, [text[:8]], calibration=text[:8], new_tokens=0)
    with pytest.raises(ValueError, match="prefill"):
        quality.forced_run(model, text, "fp16", CHUNK, BATCH, prefill=CHUNK - 1)
    with pytest.raises(ValueError, match="text_tokens"):
        quality.chunks(text[:5], CHUNK)
    with pytest.raises(SystemExit) as e:
        model_quality.main(["--schemes", "int3/token"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        model_quality.main(["--static-scales", "cache,tensor"])
    assert e.value.code == 2
    for bad in ((), ["layer", "layer"], ["head"], "layer"):
        with pytest.raises(ValueError, match="static_scales_by"):
            quality.evaluate_all(model, text, [text[:8]], calibration=text[:8], static_scales_by=bad)


def test_bench_without_the_model_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("workbench.model.gguf_weights.model_available", lambda: "not installed here")
    assert model_quality.main(["--smoke", "--out", str(tmp_path)]) == 2
    assert "SmolLM2-135M" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_generate_with_shared_prefill_is_runner_generate(smol, text):
    """The prefill computed once and added to each cache gives what Runner.generate gives."""
    from workbench.model import PagedKV, Runner

    model, _ = smol
    prompts = [text[:10], text[30:40]]
    cache = quality.build_cache(model, "int8/token", [13, 13])
    g = Runner(model, PagedKV(cache)).generate(prompts, 3)
    assert quality.generate(model, prompts, "int8/token", 3) == [g.tokens[(0, 0)], g.tokens[(1, 0)]]
