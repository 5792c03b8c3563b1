"""Real K/V capture (``workbench.model.capture``): shapes and conventions of one short prompt's capture, the
statistics, the saved folder and its round trip, the CLI, ``capture.real_kv`` on a saved folder, and the committed
``data/activations``. Needs SmolLM2-135M (skipped with the install hint otherwise); the model is loaded once."""

import json
import math
import re

import pytest
import torch

from workbench.model.gguf_weights import model_available

if (_why := model_available()) is not None:
    pytest.skip(_why, allow_module_level=True)

from workbench.model import capture  # noqa: E402
from workbench.quant import error_study, synthetic  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: a busy 2-core CPU runs one thread 10x faster

PROMPT = ("Name three rivers in Europe and say in one sentence each why they mattered for trade in the Middle "
          "Ages.")  # 51 tokens in the chat template: 35 keys before the last 16 queries


@pytest.fixture(scope="module")
def loaded():
    from workbench.model import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def cap(loaded):
    model, tok = loaded
    return capture.capture_kv(model, tok.chat(PROMPT), name="rivers")


@pytest.fixture(scope="module")
def saved(cap, tmp_path_factory):
    return capture.save([cap], tmp_path_factory.mktemp("act"), layers=(0, 17, 29))


def test_shapes_and_attention_rows(cap, loaded):
    model, _ = loaded
    T = len(cap.tokens)
    assert T == len(loaded[1].chat(PROMPT)) and cap.layers == list(range(30))
    for x in (cap.k_pre, cap.k, cap.v):
        assert x.shape == (30, T, 3, 64) and x.dtype == torch.float32 and bool(x.isfinite().all())
        assert float(x.abs().mean()) > 1e-3  # real activations, not zeros
    assert cap.attn_last.shape == (30, 9, T) and cap.q_last.shape == (30, capture.N_QUERIES, 9, 64)
    torch.testing.assert_close(cap.attn_last.sum(-1), torch.ones(30, 9), atol=1e-5, rtol=0)
    assert bool((cap.attn_last >= 0).all())
    # the same weights from the study's GQA attention (query head h reads kv head h // 3, scale 1 / sqrt(64))
    ref = error_study.attention_weights(cap.q_last[:, -1:], cap.k)  # [L, Hkv, G, 1, T]
    torch.testing.assert_close(cap.attn_last, ref.reshape(30, 9, T), atol=1e-5, rtol=1e-4)
    assert cap.sm_scale == model.sm_scale == 0.125 and cap.rope_base == 1e5


def test_post_rope_keys_are_the_pre_rope_keys_rotated_at_their_positions(cap):
    T = cap.k.shape[1]
    torch.testing.assert_close(cap.k, synthetic.apply_rope(cap.k_pre, torch.arange(T), base=1e5), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(capture.rope(cap.k_pre), cap.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cap.k[:, 0], cap.k_pre[:, 0])  # position 0: no rotation
    shifted = synthetic.apply_rope(cap.k_pre, torch.arange(1, T + 1), base=1e5)  # one position off: clearly not it
    assert error_study.reconstruction_error(cap.k, shifted) > 1e-2


def _numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


def test_stats_are_finite_and_json(cap):
    s = capture.kv_stats(cap)
    assert json.loads(json.dumps(s)) == s
    assert s["tokens"] == len(cap.tokens) and len(s["layers"]) == 30
    nums = list(_numbers(s))
    assert nums and all(math.isfinite(x) for x in nums) and any(x != 0 for x in nums)
    for d in s["layers"]:
        assert 0 <= d["sink0"] <= d["sink4"] <= 1 + 1e-3 and 0 < d["entropy_norm"] <= 1 + 1e-3
        for n in ("k_pre", "k", "v"):
            assert len(d[n]["absmax"]) == 3 and len(d[n]["absmax"][0]) == 64
            assert all(r >= 1 for r in d[n]["ratio"]) and all(len(t) == 3 for t in d[n]["top3"])
    avg = capture.average_stats([s, s])
    assert avg["prompts"] == 2 and avg["layers"][5]["sink0"] == pytest.approx(s["layers"][5]["sink0"], rel=1e-3)
    assert avg["layers"][5]["k_pre"]["top1_agree"] == [1.0, 1.0, 1.0]


def test_save_load_round_trip(cap, saved):
    names = sorted(p.name for p in saved.iterdir())
    assert names == ["00_rivers.npz", "README.md", "stats.json"]
    stats = json.loads((saved / "stats.json").read_text())
    assert len(stats["prompts"]) == 1 and len(stats["average"]["layers"]) == 30
    assert "prompts: 1" in (saved / "README.md").read_text()
    (back,) = capture.load(saved)
    assert back.name == "rivers" and back.tokens == cap.tokens and back.layers == [0, 17, 29]
    for n in ("k_pre", "k", "v", "q_last"):
        got, ref = getattr(back, n), getattr(cap, n)[[0, 17, 29]]
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert error_study.reconstruction_error(ref, got) < 2e-3  # fp16 storage
    assert back.attn_last.shape == cap.attn_last.shape  # every layer
    assert error_study.reconstruction_error(cap.attn_last, back.attn_last) < 2e-3
    with pytest.raises(FileNotFoundError, match="capture"):
        capture.load(saved / "nowhere")


def test_real_kv_has_the_study_shapes(saved):
    r = capture.real_kv(path=saved, multiple=1)
    T = 51 - capture.N_QUERIES
    assert r.layers == [0, 17, 29] and r.rope_base == 1e5
    assert r.q.shape == (3, capture.N_QUERIES, 9, 64)
    assert r.k_pre.shape == r.k.shape == r.v.shape == (3, T, 3, 64)
    assert float(r.k_pre.abs().mean()) > 1e-3 and float(r.v.abs().mean()) > 1e-3
    torch.testing.assert_close(r.k, synthetic.apply_rope(r.k_pre, base=r.rope_base), atol=1e-3, rtol=1e-3)
    one = capture.real_kv(29, "rivers", saved, multiple=32)
    assert one.layers == [29] and one.k_pre.shape == (1, 32, 3, 64)
    rows = error_study.kivi_comparison(one.q, one.k_pre, one.v, bits=(4,), rope_base=one.rope_base)
    assert len(rows) == 4 and all(0 < x["attn_err"] < 1 for x in rows)
    with pytest.raises(ValueError, match="stored layers"):
        capture.real_kv(5, path=saved)


def test_cli_writes_a_folder(loaded, tmp_path, monkeypatch, capsys):
    import workbench.model as wm

    monkeypatch.setattr(wm, "load_smollm2", lambda: loaded)  # the module's model: no second 10 s load
    assert capture.main(["--out", str(tmp_path), "--prompts", "1", "--layers", "29"]) == 0
    out = capsys.readouterr().out
    assert "sink0" in out and f"{capture.PROMPTS[0].name} " in out
    assert capture.load(tmp_path)[0].layers == [29]
    monkeypatch.setattr("workbench.model.gguf_weights.model_available", lambda: "not installed here")
    assert capture.main(["--out", str(tmp_path)]) == 2
    assert "not installed here" in capsys.readouterr().err


def test_committed_activations_agree_with_their_readme():
    folder = capture.DEFAULT_PATH
    stats = json.loads((folder / "stats.json").read_text())
    readme = (folder / "README.md").read_text()
    n = int(re.search(r"^prompts: (\d+)$", readme, re.M).group(1))
    assert n == len(stats["prompts"]) == len(list(folder.glob("*.npz"))) >= 4
    assert stats["average"]["prompts"] == n
    for s in stats["prompts"]:
        assert re.search(rf"\| {s['name']} \| \w+ \| {s['tokens']} \|", readme), s["name"]
        assert 100 <= s["tokens"] <= 300
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 8e6, f"data/activations is {size / 1e6:.1f} MB"
