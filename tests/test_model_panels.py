"""Notebook 06's logic: block-table snapshots of a run (``workbench.model.inspect``) on a small random-weights llama
(no model file), the grid and the counts exactly, and its panels headless; then the claims the notebook makes about
SmolLM2-135M itself (skipped, with the install hint, when the model is not installed).
"""

import json

import numpy as np
import pytest
import torch

from workbench.cache import PagedKVCache
from workbench.model import SMOLLM2_135M, Llama, Runner, agreement, inspect, random_weights
from workbench.model.gguf_weights import model_available

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small matmuls, one thread on a busy CPU
CFG = SMOLLM2_135M.with_layers(2)
SYSTEM = list(range(300, 320))  # 20 shared tokens: the second prompt finds the first full block of 16 cached
PROMPTS = [SYSTEM + [5, 6, 7, 8], SYSTEM + [9, 10, 11, 12]]  # 24 tokens each: one full block and 8 tokens
NO_MODEL = model_available()
needs_model = pytest.mark.skipif(NO_MODEL is not None, reason=f"SmolLM2-135M: {NO_MODEL}")


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, random_weights(CFG, seed=1))


class FakeTokenizer:
    """Enough of ``workbench.model.tokenizer.Tokenizer`` for the panels: a 20-token 'system prompt', then one token
    per character of the line."""

    def chat(self, user, system=None):
        return SYSTEM + [400 + ord(c) % 200 for c in user]

    def encode(self, text):
        return [400 + ord(c) % 200 for c in text]

    def decode(self, ids, skip_special=False):
        return " ".join(map(str, ids))

    def token(self, i):
        return f"<{int(i)}>"


def snap(index, event, tables, lengths, hits=0, bs=4):
    ids = [(i, 0) for i in range(len(tables))]
    return inspect.Snapshot(index, event, tuple(ids), tuple(tuple(t) for t in tables),
                            tuple(tuple(range(n)) for n in lengths), bs, hits)


# ---- pure functions on hand-made snapshots ---------------------------------------------------------------------
def test_block_grid_pads_counts_refs_and_marks_only_new_blocks():
    prev = snap(0, "fork", [[0, 1], [0, 1]], [6, 6])
    cur = snap(1, "step", [[0, 2], [0, 1]], [7, 7])  # sequence 0 copied block 1 on write
    g = inspect.block_grid(cur, prev, width=3)
    assert g.rows == ["p0 s0", "p1 s0"]
    assert g.block == [[0, 2, None], [0, 1, None]]
    assert g.refs == [[2, 1, None], [2, 1, None]]
    assert g.fill == [[4, 3, None], [4, 3, None]]
    assert g.new == [[False, True, False], [False, False, False]]  # only the copy is new memory
    assert g.width == 3 and g.block_size == 4
    assert inspect.block_grid(cur).new == [[False, False], [False, False]]  # no previous snapshot: nothing marked
    with pytest.raises(ValueError, match="width must be at least"):
        inspect.block_grid(cur, width=1)


def test_block_grid_keeps_a_runs_rows_in_place():
    early = snap(0, "prefill", [[0, 1]], [5])
    rows = [(0, 0), (0, 1), (1, 0)]
    g = inspect.block_grid(early, seq_ids=rows, width=2)
    assert g.rows == ["p0 s0", "p0 s1", "p1 s0"]
    assert g.block == [[0, 1], [None, None], [None, None]]
    with pytest.raises(ValueError, match="missing"):
        inspect.block_grid(early, seq_ids=[(1, 0)])


def test_counts_and_copy_on_write_over_a_timeline():
    snaps = [snap(0, "prefill", [[0, 1]], [6]),
             snap(1, "fork", [[0, 1], [0, 1]], [6, 6]),
             snap(2, "step", [[0, 2], [0, 1]], [7, 7], hits=1),
             snap(3, "step", [[0, 2, 3], [0, 1, 4]], [9, 9], hits=1)]
    rows = inspect.timeline(snaps)
    assert [r["cow_copies"] for r in rows] == [0, 0, 1, 1]
    assert [r["blocks_in_use"] for r in rows] == [2, 2, 3, 5]
    assert [r["blocks_unshared"] for r in rows] == [2, 4, 4, 6]
    assert [r["shared_blocks"] for r in rows] == [0, 2, 1, 1]
    assert [r["prefix_hit_tokens"] for r in rows] == [0, 0, 4, 4]
    assert rows[3] == {"index": 3, "event": "step", "sequences": 2, "tokens": 18, "blocks_in_use": 5,
                       "blocks_unshared": 6, "shared_blocks": 1, "prefix_hit_tokens": 4, "cow_copies": 1}
    assert inspect.ref_counts(snaps[3]) == {0: 2, 2: 1, 3: 1, 1: 1, 4: 1}
    assert inspect.seq_label((2, 3)) == "p2 s3" and inspect.seq_label("a") == "a"


def test_compare_greedy_counts_equal_tokens_divergence_and_drift():
    r = agreement.compare_greedy([1, 2, 3, 4], [-0.5, -1.0, -2.0, -0.1], [1, 2, 9, 4], [-0.25, -1.5, -3.0, -0.1])
    assert r == {"equal": 2, "first_divergence": 2, "drift": [0.25, -0.5], "max_drift": 0.5}
    same = agreement.compare_greedy([1, 2], [-1.0, -1.0], [1, 2], [-1.0, -0.5])
    assert same["first_divergence"] is None and same["equal"] == 2 and same["drift"] == [0.0, 0.5]
    with pytest.raises(ValueError, match="one log-prob per token"):
        agreement.compare_greedy([1, 2], [-1.0], [1, 2], [-1.0, -1.0])


def test_page_tokens_follow_kivis_key_groups():
    assert agreement.page_tokens_for("int4/kivi") == 32 and agreement.page_tokens_for("int2/kivi", 48) == 64
    assert agreement.page_tokens_for("int4/token") == 16 and agreement.page_tokens_for("fp16") == 16


def test_chat_prompts_one_per_non_empty_line():
    got = inspect.chat_prompts(FakeTokenizer(), "ab\n\n  c \n")
    assert got == [SYSTEM + [497, 498], SYSTEM + [499]]


def test_snapshot_refuses_an_unknown_event():
    cache = PagedKVCache(1, 1, 64, 2, page_tokens=16, device="cpu", ops="torch")
    with pytest.raises(ValueError, match="event must be one of"):
        inspect.snapshot(cache.manager, "free")


def test_kv_stats_sources_merge_each_prompts_channels_from_its_npz(tmp_path):
    assert inspect.kv_stats_sources(tmp_path) == {}
    L, H, D = 2, 3, 4
    layer = lambda i, absmax=True: {"layer": i, "sink0": 0.5, "sink4": 0.6, **{
        n: {"ratio": [2.0] * H, "top3": [[0, 1, 2]] * H, **({"absmax": [[1.0] * D] * H} if absmax else {})}
        for n in ("k_pre", "k", "v")}}
    stats = {"prompts": [{"name": "a", "tokens": 7, "layers": [layer(i, False) for i in range(L)]},
                         {"name": "b", "tokens": 9, "layers": [layer(i, False) for i in range(L)]}],
             "average": {"prompts": 2, "layers": [layer(i) for i in range(L)]}}
    (tmp_path / "stats.json").write_text(json.dumps(stats))
    absmax = np.arange(3 * L * H * D, dtype=np.float16).reshape(3, L, H, D)
    np.savez(tmp_path / "00_a.npz", absmax=absmax)  # prompt b has no npz: left out
    got = inspect.kv_stats_sources(tmp_path)
    assert list(got) == ["average of 2 prompts", "a"]
    assert got["a"]["tokens"] == 7
    assert got["a"]["layers"][1]["k"]["absmax"] == absmax[1, 1].astype(np.float32).tolist()
    assert got["a"]["layers"][0]["k"]["ratio"] == [2.0] * H


# ---- a run of the random-weights model -----------------------------------------------------------------------
def test_record_follows_prefill_fork_and_copy_on_write(model):
    rec = inspect.record(model, PROMPTS, 4, n=2)
    assert [s.event for s in rec.snapshots] == ["prefill", "fork", "prefill", "fork", "step", "step", "step"]
    first, last = rec.snapshots[3], rec.snapshots[-1]
    assert first.tables == ((0, 1), (0, 1), (0, 2), (0, 2))  # block 0 a prefix hit, forks share everything
    assert last.tables == ((0, 3), (0, 1), (0, 4), (0, 2))  # each sample 0 copied its shared tail on write
    rows = inspect.timeline(rec.snapshots)
    assert rows[-1]["cow_copies"] == 2 and rows[-1]["prefix_hit_tokens"] == 16
    assert rows[-1]["blocks_in_use"] == 5 and rows[-1]["blocks_unshared"] == 8
    assert rec.generation.prefix_hit_tokens == {0: 0, 1: 16}
    # the tokens in the cache at the last step: every chosen token but the newest, which is never fed back
    assert rec.generated(last) == {s: t[:-1] for s, t in rec.generation.tokens.items()}
    assert rec.ops == "torch" and rec.kv_dtype == "fp16" and rec.quantized_tokens == {s: 27 for s in last.seq_ids}


def test_ref_counts_from_the_tables_are_the_pools(model):
    """The prefix cache holds no reference: a block's users are exactly the tables that hold it."""
    cache = PagedKVCache(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim,
                         inspect.pages_needed(PROMPTS, 6, 3, 16), page_tokens=16, device="cpu", ops="torch")
    seen = []

    def check(s):
        pool = cache.manager.pool
        assert inspect.ref_counts(s) == {b: pool.ref_count(16, b) for b in inspect.ref_counts(s)}
        seen.append(s.event)

    rec = inspect.Recorder(cache.manager, check)
    Runner(model, inspect.RecordingKV(cache, rec), observe=rec).generate(PROMPTS, 6, n=3, temperature=1.0,
                                                                         free=False)
    assert seen.count("fork") == 4 and seen.count("step") == 5
    cache.manager.check_invariants()


# ---- the panels, headless ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ui():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    pytest.importorskip("anywidget")
    from workbench.ui import model_panels
    from workbench.ui.plot_view import figure_json

    return model_panels, figure_json


def test_generation_panel_runs_on_generate_and_replays_snapshots(model, ui):
    mp, figure_json = ui
    p = mp.generation_panel(model, FakeTokenizer(), prompt="ab\ncd", max_new_tokens=3, n=2, temperature=0.0)
    step = p.controls["step"]
    assert step.max == step.value == len(p.recorded.snapshots) - 1 == 5
    assert p.pending() == "" and p.view.figure == figure_json(p.figure)
    p.controls["n"].value = 3
    assert p.pending() == "changed since this run: samples 3; press Generate"
    assert "press Generate" in p.figure.layout.title.text and p.runs == 1  # nothing ran
    p.button.click()
    assert p.runs == 2 and p.pending() == "" and "2 prompts x 3 samples" in p.figure.layout.title.text
    assert step.max == step.value == len(p.recorded.snapshots) - 1 == 7
    assert p.view.figure == figure_json(p.figure)
    step.value = 0  # replay: the first prefill, every later row still in place and empty
    r = p.compute()
    assert r["grid"].rows == ["p0 s0", "p0 s1", "p0 s2", "p1 s0", "p1 s1", "p1 s2"]
    assert r["grid"].block[0] == [0, 1] and r["grid"].block[1] == [None, None]
    p.controls["colour"].value = "refs"
    assert [list(z) for z in p.figure.data[0].z][0] == [1, 1]
    step.value = step.max
    assert [list(z) for z in p.figure.data[0].z] == [[6, 1]] * 6  # block 0 in every table, tails all copied
    assert "p1 s2" in p.texts.value and p.status.value == ""


def test_generation_panel_reset_shows_its_first_run_and_every_sequences_text(model, ui):
    """A check cell that pressed Generate with other settings leaves the panel on its first run once it resets (06
    showed the check's 3 samples at temperature 0 after Run All); the text of every sequence is shown, none hidden in
    an inner scroll box (4 of 6 sequences showed)."""
    mp, figure_json = ui
    p = mp.generation_panel(model, FakeTokenizer(), prompt="ab\ncd", max_new_tokens=2, n=2, temperature=0.8)
    first, built, figure = p.recorded, p.values(), figure_json(p.figure)
    p.controls["n"].value, p.controls["temperature"].value = 3, 0.0
    p.button.click()
    assert all(f"p{i} s{j}" in p.texts.value for i in (0, 1) for j in range(3))  # six sequences, all in the text
    p.controls["step"].value, p.controls["colour"].value = 1, "refs"
    assert p.texts.layout.max_height is None and p.texts.layout.overflow in (None, "visible")
    p.reset()
    assert p.values() == built and p.recorded is first and p.pending() == "" and p.runs == 1
    assert p.controls["step"].max == len(first.snapshots) - 1 and figure_json(p.figure) == figure
    assert p.view.figure == figure and "p1 s1" in p.texts.value and "p1 s2" not in p.texts.value


def test_generation_panel_says_why_it_cannot_run(model, ui):
    mp, _ = ui
    p = mp.generation_panel(model, FakeTokenizer(), prompt="ab", max_new_tokens=2, n=1)
    p.controls["prompt"].value = "  \n"
    p.button.click()
    assert "prompt box is empty" in p.status.value and p.runs == 1 and not p.button.disabled


def test_agreement_panel_against_fp16(model, ui):
    mp, figure_json = ui
    from workbench.model import quality

    tok = FakeTokenizer()
    calibration = quality.capture_kv(model, list(range(100, 164)))
    prompts = {"one": SYSTEM + [5, 6], "two": SYSTEM + [7, 8, 9]}
    p = mp.agreement_panel(model, tok, prompts, new_tokens=4, scheme="fp32",
                           schemes=["fp32", "int8/token", "fp8_e4m3/tensor"], calibration=calibration)
    r = p.compute()
    assert r["ref_tokens"] == r["tokens"] and r["first_divergence"] is None and r["equal"] == 4
    for scheme in ("int8/token", "fp8_e4m3/tensor"):
        p.controls["scheme"].value = scheme
        r = p.compute()
        assert p.status.value == "" and r["scheme"] == scheme and len(r["tokens"]) == 4
        assert r["equal"] == (4 if r["first_divergence"] is None else r["first_divergence"])
        assert len(r["drift"]) == r["equal"]
    assert "calibrated" in r["note"]
    p.controls["prompt"].value = "two"
    assert set(p.results) == {("fp32", "one"), ("int8/token", "one"), ("fp8_e4m3/tensor", "one"),
                              ("fp8_e4m3/tensor", "two")}
    assert [t.type for t in p.figure.data][-1] == "table" and p.view.figure == figure_json(p.figure)


def test_kv_stats_panel_follows_layer_head_and_source(ui):
    mp, _ = ui
    L, H, D = 4, 3, 8

    def layers(scale):
        return [{"layer": i, "sink0": 0.1 * i, "sink4": 0.1 * i + 0.05, **{
            n: {"ratio": [scale * (i + 1 + h) for h in range(H)], "top3": [[h, h + 1, h + 2] for h in range(H)],
                "absmax": [[scale * (c + h) for c in range(D)] for h in range(H)]} for n in ("k_pre", "k", "v")}}
            for i in range(L)]

    p = mp.kv_stats_panel({"average": {"layers": layers(1.0), "tokens": None},
                           "x": {"layers": layers(2.0), "tokens": 10}}, layer=9)
    assert p.controls["layer"].value == 3 and p.controls["layer"].max == 3
    p.controls["layer"].value = 1
    p.controls["head"].value = 2
    marker = p.figure.data[3]
    assert list(marker.x) == [1] and list(marker.y) == [4.0]  # layer 1, head 2: ratio 1 + 1 + 2
    assert list(p.figure.data[6].y) == [float(c + 2) for c in range(D)]  # that head's channels, before RoPE
    p.controls["source"].value = "x"
    assert list(p.figure.data[6].y) == [2.0 * (c + 2) for c in range(D)] and "(10 tokens)" in \
        p.figure.layout.title.text
    lay = p.figure.layout  # 06: the 'ch 26' label ran into the legend that sat inside the channel plot
    for name in ("legend", "legend2", "legend3"):
        leg = lay[name]
        inside = [a for a in ("yaxis", "yaxis2", "yaxis3") if lay[a].domain[0] <= leg.y <= lay[a].domain[1]
                  and lay["x" + a[1:]].domain[0] <= leg.x <= lay["x" + a[1:]].domain[1]]
        assert not inside, f"{name} sits inside the plot of {inside}"


# ---- the notebook's claims about SmolLM2-135M ----------------------------------------------------------------------
@needs_model
def test_smollm2_two_chat_prompts_share_a_block_and_copy_one_per_sample():
    from workbench.model import ContiguousKV, load_smollm2

    real, tok = load_smollm2()
    prompts = inspect.chat_prompts(tok, "Name a fruit.\nName a colour.")
    assert [len(p) for p in prompts] == [34, 34]
    rec = inspect.record(real, prompts, 4, n=2)
    rows = inspect.timeline(rec.snapshots)
    assert rows[-1]["prefix_hit_tokens"] == 16 and rows[-1]["cow_copies"] == 2
    assert rows[-1]["blocks_in_use"] == 7 and rows[-1]["blocks_unshared"] == 12
    base = Runner(real, ContiguousKV(real.num_layers, torch.float16)).generate(prompts, 4)
    assert all(rec.generation.tokens[(i, 0)] == base.tokens[(i, 0)] for i in range(2))  # paged changes no token
