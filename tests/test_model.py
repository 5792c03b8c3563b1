"""SmolLM2-135M through the paged cache against Hugging Face transformers on the same GGUF weights.

Greedy decoding of two chat prompts (sharing the system prompt) for 16 new tokens must give the same tokens as (a)
the same runner on a plain contiguous store (all logits compared at every step) and (b) transformers'
``LlamaForCausalLM.from_pretrained(..., gguf_file=...)`` (its own GGUF reader and dequantization, fp32; its top 64
logits of every step compared), read from ``tests/fixtures/smollm2_hf_greedy.json`` (``scripts/model_hf_fixture.py``;
``WORKBENCH_HF_LIVE=1`` runs transformers instead). The
paged runs use the cache's PyTorch ops (the kernels' references) for all 16 tokens, and the Triton kernels
(interpreter) for a few tokens: the whole 30-layer model under the interpreter costs about 2 s a token. Needs the
optional model packages (installed by ``scripts/setup.sh``); without them the module is skipped, saying how to
install them."""

import json
import os
from pathlib import Path

import pytest
import torch

import workbench
from workbench.model.gguf_weights import model_available

why = model_available()
if why is not None:
    pytest.skip(f"SmolLM2-135M is not available: {why}", allow_module_level=True)

from workbench.cache import PagedKVCache  # noqa: E402
from workbench.model import ContiguousKV, PagedKV, Runner, load_smollm2  # noqa: E402

pytestmark = pytest.mark.kernels  # runs Triton kernels: scripts/gpu_run.sh runs it compiled (tests/kernel_launches.py)

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_tokens.json"
HF_FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_hf_greedy.json"
N = 16  # 32 until the CI budget ran short: the logits are compared at every step, the tokens stay equal


@pytest.fixture(scope="module", autouse=True)
def _threads(one_thread):
    """One torch thread: two stall each other on a busy 2-core CPU (about 10x slower under pytest -n 2)."""


@pytest.fixture(scope="module")
def smol():
    return load_smollm2()


@pytest.fixture(scope="module")
def prompts(smol):
    _, tok = smol
    # two chat prompts share the system prompt (a prefix hit for the second)
    return [tok.chat("Write a short story about a robot who learns to paint."),
            tok.chat("Explain why the sky is blue, in detail.")]


def cache_for(model, scheme="fp32", ops="torch", num_pages=32, **kw):
    cfg = model.config
    return PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_pages, page_tokens=16,
                        kv_dtype=scheme, device=model.device, ops=ops, **kw)  # one device: the model's


@pytest.fixture(scope="module")
def ours(smol, prompts):
    model, _ = smol
    cache = cache_for(model)
    paged = Runner(model, PagedKV(cache)).generate(prompts, N, keep_logits=True, free=False)
    contiguous = Runner(model, ContiguousKV(model.num_layers)).generate(prompts, N, keep_logits=True)
    return paged, contiguous, cache


@pytest.fixture(scope="module")
def hf(prompts):
    """transformers' greedy tokens and its top logits at every step, from ``tests/fixtures/smollm2_hf_greedy.json``
    (``scripts/model_hf_fixture.py`` writes it: loading the GGUF in transformers costs ~35 s of a 2-core machine), or
    computed now with ``WORKBENCH_HF_LIVE=1``. Returns ``[(tokens, top_ids [N, k], top_logits [N, k])]`` per prompt."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import model_hf_fixture as fx

    data = json.loads(HF_FIXTURE.read_text(encoding="utf-8"))
    assert [c["prompt_ids"] for c in data["cases"]] == prompts, "prompts changed: rerun scripts/model_hf_fixture.py"
    assert data["new_tokens"] == N
    if os.environ.get("WORKBENCH_HF_LIVE") == "1":
        try:
            live = fx.hf_greedy(prompts, N)
        except ImportError as e:
            pytest.skip(f"transformers is not installed ({e}): pip install transformers accelerate")
        return [(tokens, *logits.topk(fx.TOP, dim=-1)[::-1]) for tokens, logits in live]
    return [(c["tokens"], torch.tensor(c["top_ids"]), torch.tensor(c["top_logits"])) for c in data["cases"]]


def test_tokenizer_matches_transformers_gguf_tokenizer(smol):
    _, tok = smol
    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]  # scripts/model_tokenizer_fixture.py
    for case in cases:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["text"]


def test_config_read_from_the_gguf(smol):
    model, _ = smol
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.rope_theta, c.vocab_size) == (30, 576, 9, 3, 64, 100000.0, 49152)


def test_greedy_tokens_equal_contiguous_and_transformers(ours, hf, prompts):
    paged, contiguous, cache = ours
    worst = 0.0
    for i, (hf_tokens, top_ids, top_logits) in enumerate(hf):
        assert paged.tokens[(i, 0)] == contiguous.tokens[(i, 0)], f"prompt {i}: paged != contiguous"
        assert paged.tokens[(i, 0)] == hf_tokens, f"prompt {i}: paged != transformers"
        ours_logits = torch.stack(paged.logits[(i, 0)])
        assert torch.equal(ours_logits.topk(top_ids.shape[1], dim=-1).indices[:, 0], top_ids[:, 0])
        worst = max(worst, float((ours_logits.gather(1, top_ids) - top_logits).abs().max()))
        assert float((torch.stack(contiguous.logits[(i, 0)]) - ours_logits).abs().max()) < 1e-3
    print(f"max |logit difference| vs transformers' top logits over {len(hf)} prompts x {N} steps: {worst:.2e}")
    assert worst < 1e-3  # fp32 both; only the summation orders differ (seen: ~6e-5)
    assert paged.prefix_hit_tokens[1] >= 16  # the shared system prompt's full block was reused...
    assert paged.prefix_hit_tokens[0] == 0 and cache.manager.pool.hits >= 1  # ...and counted by the allocator


def test_kernel_path_equals_torch_ops_on_the_real_model(smol):
    """The Triton write and paged decode kernels (interpreter) on all 30 layers, a few tokens."""
    model, tok = smol
    short = tok.encode("def fibonacci(n):")
    ref = Runner(model, PagedKV(cache_for(model, num_pages=4))).generate([short], 3, keep_logits=True)
    dev = workbench.device()  # the kernels read where the cache is: a GPU when compiled
    on_dev = model if dev.type == "cpu" else load_smollm2(device=dev)[0]
    g = Runner(on_dev, PagedKV(cache_for(on_dev, ops="kernels", num_pages=4))).generate([short], 3, keep_logits=True)
    assert g.tokens == ref.tokens
    diff = (torch.stack(g.logits[(0, 0)]) - torch.stack(ref.logits[(0, 0)])).abs().max()
    assert float(diff) < 1e-3


def test_forked_samples_and_prefix_caching_off_give_the_same_greedy_text(smol, ours, prompts):
    model, _ = smol
    paged, _, _ = ours
    cache = cache_for(model, prefix_caching=False)
    g = Runner(model, PagedKV(cache)).generate(prompts[:2], 3, n=2, free=False)
    assert g.prefix_hit_tokens == {0: 0, 1: 0} and cache.manager.pool.hits == 0
    for i in range(2):
        assert g.tokens[(i, 0)] == g.tokens[(i, 1)] == paged.tokens[(i, 0)][:3]
        t0, t1 = cache.manager.block_table((i, 0)), cache.manager.block_table((i, 1))
        assert t0[:-1] == t1[:-1] and t0[-1] != t1[-1]  # full blocks shared, the last one copied on write


def test_generate_cli_prints_text_and_cache_numbers(capsys):
    from workbench.__main__ import main

    assert main(["generate", "--prompt", "Say hi.", "--max-new-tokens", "2", "--ops", "torch"]) == 0
    out = capsys.readouterr().out
    assert "blocks in use" in out and "[prompt 0, sample 0]" in out
    assert main(["generate", "--kv-dtype", "int9", "--max-new-tokens", "2"]) == 2
