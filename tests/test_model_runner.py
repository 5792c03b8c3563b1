"""The runner, the decode step and the PyTorch ops of the cache on a small random-weights llama (no model file):
paged (kernels and torch ops, every kind of scheme) against the contiguous baseline, prefix reuse, forks,
and failed steps that leave the cache exactly as it was."""

import pytest
import torch
from conftest import bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_allocator import snapshot

import workbench
from workbench.cache import PagedKVCache
from workbench.model import SMOLLM2_135M, ContiguousKV, Llama, PagedKV, Runner, random_weights
from workbench.model.gguf_weights import unpermute

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

CFG = SMOLLM2_135M.with_layers(2)
SYSTEM = list(range(300, 320))  # 20 shared tokens: one full block of 16 is a prefix hit for the second prompt
PROMPTS = [SYSTEM + [5, 6, 7], SYSTEM + [9, 10], list(range(40, 51))]
DEV = workbench.device()  # where the kernels read (compiled on a GPU: CUDA memory only); the torch ops run on the CPU


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU."""


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, random_weights(CFG, seed=1))


@pytest.fixture(scope="module")
def models(model):
    """The model per ops: on the CPU for the torch ops, on the kernels' device for the kernels (the same weights)."""
    on_dev = model if DEV.type == "cpu" else Llama(CFG, random_weights(CFG, seed=1), device=DEV)
    return {"torch": model, "kernels": on_dev}


@pytest.fixture(scope="module")
def baseline(model):
    return Runner(model, ContiguousKV(CFG.num_hidden_layers)).generate(PROMPTS, 5, keep_logits=True)


def paged(scheme="fp32", ops="torch", num_pages=24, page_tokens=16, **kw):
    """A cache for the test model: on the CPU for the torch ops, on :data:`DEV` for the kernels (a CPU cache with
    compiled kernels is refused: the H200 run failed inside Triton on CPU pointers)."""
    return PagedKVCache(CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim, num_pages,
                        page_tokens=page_tokens, kv_dtype=scheme, device=DEV if ops == "kernels" else "cpu", ops=ops,
                        **kw)


def max_logit_diff(a, b) -> float:
    return max(float((torch.stack(a.logits[s]) - torch.stack(b.logits[s])).abs().max()) for s in b.logits)


def test_unpermute_undoes_llama_cpps_rope_permutation():
    """llama.cpp's convert script permutes Q/K rows for pair-wise RoPE; unpermute is its inverse."""
    n_head, D, d = 3, 8, 5
    w = torch.randn(n_head * D, d)
    permuted = w.reshape(n_head, 2, D // 2, d).transpose(1, 2).reshape(w.shape)  # llama.cpp's permute
    assert torch.equal(unpermute(permuted, n_head), w)


def test_a_prefill_made_before_gives_the_same_generation(model):
    """generate(prefilled=...): a prefill made once (quality.prefill_all) stored in another scheme's cache gives
    that scheme's run bit for bit (prefill attends over fresh K/V); None prefills that prompt; a prefill of other
    tokens is refused."""
    from workbench.model import quality

    pre = quality.prefill_all(model, PROMPTS[:2])
    for scheme in ("fp16", "int4/token"):
        want = Runner(model, PagedKV(paged(scheme, prefix_caching=False))).generate(PROMPTS[:2], 4, keep_logits=True)
        got = Runner(model, PagedKV(paged(scheme, prefix_caching=False))).generate(
            PROMPTS[:2], 4, keep_logits=True, prefilled=[pre[0], None])
        assert got.tokens == want.tokens and got.logprobs == want.logprobs, scheme
        assert all(torch.equal(a, b) for s in want.logits for a, b in zip(got.logits[s], want.logits[s], strict=True))
    with pytest.raises(ValueError, match="prefilled"):
        Runner(model, PagedKV(paged())).generate(PROMPTS[:2], 2, prefilled=[pre[1], None])


@pytest.mark.parametrize("ops", ["torch", "kernels"])
def test_paged_fp32_equals_contiguous_with_prefix_reuse(models, baseline, ops):
    cache = paged(ops=ops)
    g = Runner(models[ops], PagedKV(cache)).generate(PROMPTS, 5, keep_logits=True, free=False)
    assert g.tokens == baseline.tokens
    assert max_logit_diff(g, baseline) < 1e-4
    assert g.prefix_hit_tokens == {0: 0, 1: 16, 2: 0}  # the second prompt reused the shared block
    assert cache.manager.block_table((0, 0))[0] == cache.manager.block_table((1, 0))[0]
    cache.manager.check_invariants()


@pytest.mark.parametrize("scheme", ["fp16", "int8/token"])
def test_kernels_and_torch_ops_agree_on_a_scheme(models, scheme):
    """The same blocks written and read by the Triton kernels (interpreter) and by their PyTorch references."""
    out = {}
    for ops in ("torch", "kernels"):
        cache = paged(scheme, ops)
        out[ops] = (Runner(models[ops], PagedKV(cache)).generate(PROMPTS[:2], 4, keep_logits=True, free=False),
                    cache)
    (a, ca), (b, cb) = out["torch"], out["kernels"]
    assert a.tokens == b.tokens
    assert max_logit_diff(a, b) < 5e-3  # fp16 queries and outputs on the kernel path
    n = len(PROMPTS[0])  # the prompt's K/V (prefill is PyTorch on both paths; decode K differs by attention's rounding)
    ka, kb = ca.read((0, 0))[0][:, :n].cpu(), cb.read((0, 0))[0][:, :n].cpu()
    step = ka.abs().amax(-1, keepdim=True) / 127 if scheme == "int8/token" else torch.zeros_like(ka)  # one code
    same_prefill = DEV.type == "cpu"  # on a GPU the kernels' model prefills there: its fp32 K differs in the last bits
    if not same_prefill:  # so a value may round to the neighbouring fp16, a per-token scale move by as little
        step = step + ka.abs() * 2.0**-10
    diff = (ka - kb).abs()
    assert bool((diff <= step * 1.01 + 1e-7).all()), float(diff.max())  # a rounding midpoint may differ by one code
    if same_prefill:  # the same fp32 K: only midpoints may differ
        assert float((diff > 1e-7).float().mean()) < 0.01


@pytest.mark.parametrize("scheme", ["fp8_e4m3/token", "int8_asym/token", "int4/kivi", "int8/head"])
def test_every_kind_of_scheme_generates_close_to_fp32(model, baseline, scheme):
    kw = {"k_scale": 0.02, "v_scale": 0.02} if scheme.endswith(("/tensor", "/head")) else {}
    if scheme.endswith("/head"):
        kw = {"k_scale": torch.full((3,), 0.02), "v_scale": torch.full((3,), 0.02)}
    cache = paged(scheme, page_tokens=32, **kw)
    g = Runner(model, PagedKV(cache)).generate(PROMPTS, 5, keep_logits=True)
    drift = max_logit_diff(g, baseline)
    assert 0 < drift < 0.5, drift  # random weights: logits are small; quantization moves them a little


def test_forked_samples_share_blocks_until_copy_on_write(model, baseline):
    cache = paged()
    runner = Runner(model, PagedKV(cache))
    runner.prefill("p", PROMPTS[0])  # 23 tokens: one full block + a partial one
    cache.fork("p", "c")
    shared = cache.manager.block_table("p")
    assert cache.manager.block_table("c") == shared
    runner.step(["p", "c"], [1, 2])
    tp, tc = cache.manager.block_table("p"), cache.manager.block_table("c")
    assert tp[0] == tc[0] and tp[1] != tc[1]  # the full block stays shared, the partial one was copied
    assert cache.manager.pool.ref_count(16, tp[0]) == 2


def test_greedy_samples_of_one_prompt_are_identical(model, baseline):
    g = Runner(model, PagedKV(paged())).generate(PROMPTS[:1], 5, n=3)
    assert g.tokens[(0, 0)] == g.tokens[(0, 1)] == g.tokens[(0, 2)] == baseline.tokens[(0, 0)]


def behaviour(m):
    """The allocator's snapshot, without the access times of free uncached blocks (no eviction order reads them,
    and a restore does not bring them back: BlockManager.restore)."""
    classes, *rest = snapshot(m)
    for bs, fields in classes.items():
        ref, key, access = fields[0], fields[2], list(fields[8])
        fields = list(fields)
        fields[8] = [a if ref[b] or key[b] is not None else None for b, a in enumerate(access)]
        classes[bs] = tuple(fields)
    return classes, *rest


def state(cache):
    return behaviour(cache.manager), bits(cache.pool).clone()


def test_a_failed_step_leaves_the_cache_as_it_was(model):
    """A NaN in layer 1's K of a quantized cache stops the step after layer 0 was written: abort restores it."""
    cache = paged("int8/token")
    runner = Runner(model, PagedKV(cache))
    runner.prefill("a", PROMPTS[0])
    runner.prefill("b", PROMPTS[2])
    before = behaviour(cache.manager)
    real_qkv = model.qkv

    def poisoned(layer, x, pos):
        q, k_pre, k, v = real_qkv(layer, x, pos)
        if layer == 1:
            k = k.clone()
            k[0, 0, 0] = float("nan")
        return q, k_pre, k, v

    model.qkv = poisoned
    try:
        with pytest.raises(ValueError, match="NaN"):
            runner.step(["a", "b"], [1, 2])
    finally:
        del model.qkv
    assert behaviour(cache.manager) == before
    assert cache.manager.num_tokens("a") == len(PROMPTS[0])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=st.sampled_from(["unknown", "duplicate", "count", "token", "empty", "full"]), seed=st.integers(0, 999))
def test_random_bad_steps_change_nothing(bad, seed):
    g = torch.Generator().manual_seed(seed)
    cache = paged("fp16", num_pages=3)
    for s, n in (("a", 16), ("b", 7)):  # "a" fills its block: its next token needs a new one
        k = torch.randn(CFG.num_hidden_layers, n, 3, 64, generator=g)
        cache.add(s, list(range(n)), k, k.clone())
    ids, toks = ["a", "b"], [1, 2]
    if bad == "unknown":
        ids = ["a", "zz"]
    elif bad == "duplicate":
        ids = ["b", "b"]
    elif bad == "count":
        toks = [1]
    elif bad == "token":
        toks = [1, 2.5]
    elif bad == "empty":
        ids, toks = [], []
    else:  # no free block left for "a"'s 17th token after another sequence takes the last ones
        k = torch.randn(CFG.num_hidden_layers, 16, 3, 64, generator=g)
        cache.add("c", list(range(100, 116)), k, k.clone())
    before = state(cache)
    with pytest.raises(Exception) as e:
        cache.begin_step(ids, toks)
    assert not isinstance(e.value, (AssertionError, TypeError)), repr(e.value)
    after = state(cache)
    assert after[0] == before[0] and torch.equal(after[1], before[1])


def test_positions_past_the_rope_table_are_refused_before_anything_is_stored(model):
    """Past ``max_position_embeddings`` the RoPE table's gather would fail on the device (on a GPU, a device-side
    assert that ends the process's CUDA context): the runner refuses on the host first, and stores nothing."""
    import dataclasses

    short = Llama(dataclasses.replace(CFG, max_position_embeddings=24), random_weights(CFG, seed=1))
    cache = paged("fp16")
    runner = Runner(short, PagedKV(cache))
    before = state(cache)
    with pytest.raises(ValueError, match="tokens: 25 positions pass the model's max_position_embeddings 24"):
        runner.prefill("a", list(range(100, 125)))
    with pytest.raises(ValueError, match="prompts and max_new_tokens"):
        runner.generate([list(range(100, 120))], 6)
    after = state(cache)
    assert after[0] == before[0] and torch.equal(after[1], before[1])
    runner.prefill("a", list(range(100, 124)))  # the table's last position
    before = state(cache)
    with pytest.raises(ValueError, match="seq_ids: 25 positions"):
        runner.step(["a"], [7])
    after = state(cache)
    assert after[0] == before[0] and torch.equal(after[1], before[1])


def test_step_api_refuses_what_it_cannot_do():
    cache = paged("fp16")
    k = torch.randn(CFG.num_hidden_layers, 5, 3, 64)
    cache.add("a", list(range(5)), k, k.clone())
    step = cache.begin_step(["a"], [9])
    with pytest.raises(ValueError, match="layer"):
        step.write(7, k[0, :1], k[0, :1])
    with pytest.raises(ValueError, match="shape"):
        step.write(0, k[0, :2], k[0, :2])
    step.abort()
    with pytest.raises(RuntimeError, match="aborted"):
        step.commit()
    assert cache.manager.num_tokens("a") == 5
    kivi = paged("int4/kivi", page_tokens=32)
    kivi.add("a", list(range(5)), k, k.clone())
    with pytest.raises(ValueError, match="residual"):
        kivi.begin_step(["a"], [9])


def test_append_batch_is_all_or_nothing():
    cache = paged("fp16", num_pages=2)
    k = torch.randn(CFG.num_hidden_layers, 16, 3, 64)
    cache.add("a", list(range(16)), k, k.clone())  # full: its next token needs the last free block
    cache.add("b", list(range(16, 32)), k, k.clone())  # full too: nothing left for it
    before = state(cache)
    one = torch.randn(CFG.num_hidden_layers, 2, 3, 64)
    with pytest.raises(Exception, match="blocks"):
        cache.append_batch(["a", "b"], [1, 2], one, one.clone())
    after = state(cache)
    assert after[0] == before[0] and torch.equal(after[1], before[1])


@pytest.mark.parametrize("ops", ["torch"])  # the kernels' step is checked on the H200 (bench model_decode --check)
def test_graph_decoder_step_equals_the_runner_eagerly(model, ops):
    """The CUDA-graph step's code, run eagerly (no graphs on a CPU): write-then-read in every layer gives the runner's
    logits (the runner reads the same blocks), step after step, and commits its steps."""
    from workbench.model.graph import GraphDecoder

    caches = [paged("fp32", ops) for _ in range(2)]
    runners = [Runner(model, PagedKV(c)) for c in caches]
    ids = ["a", "b"]
    for r in runners:
        for s, p in zip(ids, PROMPTS[1:], strict=True):
            r.prefill(s, p)
    dec = GraphDecoder(model, caches[1], batch_size=2, max_seq_len=64, use_graph=False)
    toks = [3, 4]
    for _ in range(3):
        want = runners[0].step(ids, toks)
        got = dec.step(ids, toks)
        assert float((want - got).abs().max()) < 1e-4
        toks = want.argmax(-1).tolist()
    assert caches[1].manager.num_tokens("a") == len(PROMPTS[1]) + 3
    with pytest.raises(ValueError, match="batch_size"):
        dec.step(["a"], [1])
    assert caches[1].manager.num_tokens("a") == len(PROMPTS[1]) + 3  # the refused step changed nothing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU (none here: the "
                    "eager test above runs the same step code; bench model_decode --check runs it on the GPU)")
def test_graph_replay_equals_the_eager_step_on_the_gpu():
    from workbench.model.graph import GraphDecoder

    model = Llama(CFG, {k: v.half() for k, v in random_weights(CFG, seed=1).items()}, dtype=torch.float16,
                  device="cuda")
    outs = []
    for use_graph in (False, True):
        cache = PagedKVCache(CFG.num_hidden_layers, 3, 64, 24, page_tokens=16, kv_dtype="fp16", device="cuda")
        runner = Runner(model, PagedKV(cache))
        for s, p in zip("ab", PROMPTS[1:], strict=True):
            runner.prefill(s, p)
        dec = GraphDecoder(model, cache, 2, 64, use_graph=use_graph)
        toks, got = [3, 4], []
        for _ in range(4):
            out = dec.step(["a", "b"], toks).clone()
            got.append(out)
            toks = out.argmax(-1).tolist()
        outs.append(torch.stack(got))
    assert float((outs[0] - outs[1]).abs().max()) < 1e-2
