"""The runner's decode through the shared-prefix cascade and through Quest (issue 33): forked samples of one prompt
read their common blocks once (``PagedKV(shared_prefix=...)``) with the tokens and logits of plain decode; a long
prompt attends only its top pages once it holds more than a budget (``QuestKV``), in full below it (then exactly
plain decode); bad arguments are refused before anything changes."""

import pytest
import torch
from test_allocator import snapshot

import workbench
from workbench.cache import PagedKVCache
from workbench.compress.quest_kv import QuestKV
from workbench.model import SMOLLM2_135M, Llama, PagedKV, Runner, random_weights

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

CFG = SMOLLM2_135M.with_layers(2)
DEV = workbench.device()
LONG = [int(t) for t in torch.randint(5, 4000, (70,), generator=torch.Generator().manual_seed(3))]  # 5 pages of 16


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, random_weights(CFG, seed=1), device=DEV)


def cache(ops="kernels", kv_dtype="fp32", page_tokens=16, **kw):
    return PagedKVCache(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, 40, page_tokens=page_tokens,
                        kv_dtype=kv_dtype, device=DEV if ops == "kernels" else "cpu", ops=ops, **kw)


def logits_diff(a, b) -> float:
    return max(float((torch.stack(a.logits[s]) - torch.stack(b.logits[s])).abs().max()) for s in b.logits)


@pytest.fixture(scope="module")
def forked_plain(model):
    """Three samples of a 40-token prompt (2 full blocks shared), 2 decode steps, plain paged decode."""
    kv = PagedKV(cache())
    return kv, Runner(model, kv).generate([LONG[:40]], 3, n=3, temperature=1.0, seed=2, keep_logits=True)


@pytest.mark.parametrize("mode", ["shared", "auto"])
def test_forked_samples_decode_through_the_cascade_with_plain_decodes_tokens(model, forked_plain, mode):
    plain_kv, plain = forked_plain
    kv = PagedKV(cache(), shared_prefix=mode)
    got = Runner(model, kv).generate([LONG[:40]], 3, n=3, temperature=1.0, seed=2, keep_logits=True)
    assert got.tokens == plain.tokens and logits_diff(got, plain) < 1e-4
    assert sum(kv.paths.values()) == 2 * CFG.num_hidden_layers  # 2 decode steps (the first token is the prefill's)
    assert plain_kv.paths == {"plain": 2 * CFG.num_hidden_layers}
    if mode == "shared":  # the three samples hold the prompt's 2 full blocks: the cascade reads them once
        assert kv.paths == {"shared": 2 * CFG.num_hidden_layers}


def test_quest_with_a_budget_covering_the_prompt_is_plain_decode(model):
    plain = Runner(model, PagedKV(cache())).generate([LONG], 5, keep_logits=True)
    kv = QuestKV(cache(key_bounds=True), page_budget=8)
    got = Runner(model, kv).generate([LONG], 5, keep_logits=True)
    assert got.tokens == plain.tokens and logits_diff(got, plain) == 0
    assert kv.paths == {"plain": 4 * CFG.num_hidden_layers}


@pytest.mark.parametrize("ops", ["kernels", "torch"])
def test_quest_reads_only_its_budget_and_keeps_every_page(model, ops):
    """5 pages, a budget of 3: every step attends by Quest; the torch ops and the kernels pick the same pages (the
    same tokens, logits within fp32 accumulation order); nothing is evicted."""
    c = cache(ops, key_bounds=True)
    m = model if ops == "kernels" or DEV.type == "cpu" else Llama(CFG, random_weights(CFG, seed=1))
    kv = QuestKV(c, page_budget=3)
    got = Runner(m, kv).generate([LONG], 5, keep_logits=True, free=False)
    assert kv.paths == {"quest": 4 * CFG.num_hidden_layers}
    assert c.manager.num_tokens((0, 0)) == len(LONG) + 4 and len(c.manager.block_table((0, 0))) == 5
    full = Runner(m, PagedKV(cache(ops))).generate([LONG], 5, keep_logits=True)
    assert all(torch.isfinite(torch.stack(got.logits[s])).all() for s in got.logits)
    assert logits_diff(got, full) > 0  # 2 of 5 pages unread: not the full attention
    if ops == "torch":
        ker = Runner(model, QuestKV(cache("kernels", key_bounds=True), page_budget=3)).generate([LONG], 5,
                                                                                               keep_logits=True)
        assert ker.tokens == got.tokens and logits_diff(ker, got) < 1e-3


def test_bad_decode_paths_are_refused_before_anything_changes():
    c = cache("torch", key_bounds=True)
    kivi = cache("torch", kv_dtype="int4/kivi", page_tokens=32)
    before = snapshot(c.manager)
    for make, match in [(lambda: PagedKV(c, shared_prefix="cascade"), "shared_prefix"),
                        (lambda: PagedKV(kivi, shared_prefix="auto"), "residual"),
                        (lambda: PagedKV(c, shared_prefix="auto", timing="replay"), "timing"),
                        (lambda: QuestKV(cache("torch"), page_budget=4), "key_bounds"),
                        (lambda: QuestKV(c, page_budget=0), "page_budget"),
                        (lambda: QuestKV(c, page_budget=2, keep_first=2), "page_budget"),
                        (lambda: QuestKV(c, page_budget=4, reduce="mean"), "reduce"),
                        (lambda: QuestKV(c, page_budget=True), "page_budget")]:
        with pytest.raises(ValueError, match=match):
            make()
    assert snapshot(c.manager) == before
