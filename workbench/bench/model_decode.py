"""GPU: decode tokens/s of SmolLM2-135M's shape through the paged cache (our runner eagerly, and one CUDA graph
per step) against Hugging Face transformers' own ``generate`` with its static cache (compiled) on the same
weights, at several batch sizes, with where our step's time goes (cache kernels vs the rest vs the host).

Weights are random (values do not change the timing; the model file is too big to carry to the GPU machine),
fp16, 512-token prompts, 256 new tokens greedy. ``--check``: our graph step's logits against transformers'
forward on the same weights, teacher-forced on our tokens. ``--gguf FILE``: the same check with the real weights
(tokens compared too). Sections ``cascade`` and ``quest`` (:mod:`workbench.bench.model_decode_paths`), in the same
run and file: 8 forked samples of a 4096-token prompt through plain decode vs the shared-prefix cascade, and a
32768-token prompt (batch 1 and 4) with the full cache vs Quest at 64 and 128 pages (tokens/s, how each step
attended, greedy agreement). ``--smoke``: those two sections on tiny shapes on a CPU.

    python -m workbench bench model_decode [--batches 1,16,64] [--new-tokens 256] [--sections decode,cascade,quest]
                                           [--out data/results]
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

import workbench
from workbench.bench import harness, model_decode_paths
from workbench.bench.command import SMOKE_HELP, BenchParser
from workbench.cache import PagedKVCache
from workbench.core.argtypes import positive_int
from workbench.model import SMOLLM2_135M, Llama, PagedKV, Runner, random_weights
from workbench.model.gguf_weights import read_gguf
from workbench.model.graph import GraphDecoder
from workbench.model.tokenizer import Tokenizer
from workbench.results import provenance, run_files

PROMPT = 512
SECTIONS = ("decode", *model_decode_paths.SECTIONS)


def _sync() -> None:
    torch.cuda.synchronize()


def _model(cfg, weights):
    return Llama(cfg, weights, dtype=torch.float16, device="cuda")


def _cache(cfg, batch: int, max_len: int, block: int = 16):
    pages = batch * -(-max_len // block) + 8
    return PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, pages, page_tokens=block,
                        kv_dtype="fp16", device="cuda", prefix_caching=False)


def _prompts(cfg, batch: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, cfg.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(batch)]


def ours(model, batch: int, new_tokens: int, eager_steps: int, compile: bool = False) -> dict:
    """Per-step times of our runner eagerly and of the CUDA-graph step, and the graph step's breakdown."""
    cfg = model.config
    max_len = PROMPT + new_tokens + 1
    row: dict = {"batch": batch}
    prompts = _prompts(cfg, batch)
    ids = list(range(batch))
    # eager: the runner as a user calls it (a DecodeStep per step, checks per layer)
    cache = _cache(cfg, batch, max_len)
    runner = Runner(model, PagedKV(cache))
    toks = [int(runner.prefill(i, p)[0].argmax()) for i, p in zip(ids, prompts, strict=True)]
    for _ in range(2):
        toks = runner.step(ids, toks).argmax(-1).tolist()
    _sync()
    t = time.perf_counter()
    for _ in range(eager_steps):
        toks = runner.step(ids, toks).argmax(-1).tolist()
    _sync()
    row["eager_ms"] = 1e3 * (time.perf_counter() - t) / eager_steps
    del runner, cache
    # graph: prefill, capture, then every step host bookkeeping + replay + argmax to the host
    cache = _cache(cfg, batch, max_len)
    runner = Runner(model, PagedKV(cache))
    toks = [int(runner.prefill(i, p)[0].argmax()) for i, p in zip(ids, prompts, strict=True)]
    dec = GraphDecoder(model, cache, batch, max_len, compile=compile)
    t0 = time.perf_counter()
    toks = dec.step(ids, toks).argmax(-1).tolist()  # captures
    row["capture_s"] = time.perf_counter() - t0
    steps = new_tokens - 1
    host = 0.0
    _sync()
    t = time.perf_counter()
    for _ in range(steps - 1):
        h = time.perf_counter()
        with cache.begin_step(ids, toks) as step:
            dec.load(step)
            host += time.perf_counter() - h
            dec.graph.replay()  # asynchronous: the commit below runs on the host while the GPU works
            h = time.perf_counter()
        host += time.perf_counter() - h
        toks = dec.logits.argmax(-1).tolist()  # the one sync per step: the next tokens
    _sync()
    row["graph_ms"] = 1e3 * (time.perf_counter() - t) / (steps - 1)
    row["host_ms"] = 1e3 * host / (steps - 1)  # begin_step + copies + commit, on the CPU
    row["replay_ms"] = harness.time_us(dec.graph.replay) / 1e3  # the GPU's share alone
    attn = torch.cuda.CUDAGraph()
    dec.attention_only()
    with torch.cuda.graph(attn):
        dec.attention_only()
    row["attention_ms"] = harness.time_us(attn.replay) / 1e3  # 30 x (write_kv + paged decode)
    row["attention_share"] = row["attention_ms"] / row["replay_ms"]
    row["context_end"] = cache.manager.num_tokens(0)
    kv_bytes = cfg.kv_bytes_per_token * batch * (PROMPT + new_tokens / 2)
    weights = sum(t.numel() * 2 for t in _weights_of(model))
    row["floor_ms"] = (weights + kv_bytes) / (harness.copy_bandwidth_gbps(1 << 30) * 1e9 / 2) * 1e3
    row["tokens_per_s_graph"] = batch * 1e3 / row["graph_ms"]
    return row


def _weights_of(model):
    yield model.embed
    if model.lm_head is not model.embed:
        yield model.lm_head
    for L in model.layers:
        yield from L.values()


def hf_generate(cfg, weights, batch: int, new_tokens: int) -> dict:
    """transformers' ``generate`` (greedy) with its static cache, compiled by generate itself, same weights."""
    import transformers  # here: an optional (dev) dependency, needed only for the peer's rows (--no-hf skips them)

    m = _hf_model(cfg, weights)
    m.generation_config.cache_implementation = "static"
    prompts = torch.tensor(_prompts(cfg, batch), device="cuda")
    mask = torch.ones_like(prompts)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=2, eos_token_id=None)

    def run(n):
        _sync()
        t = time.perf_counter()
        m.generate(prompts, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync()
        return time.perf_counter() - t

    t0 = time.perf_counter()
    run(new_tokens)  # compiles
    run(new_tokens)
    warm = time.perf_counter() - t0
    full, one = run(new_tokens), run(1)
    return {"batch": batch, "hf_static_ms": 1e3 * (full - one) / (new_tokens - 1), "hf_warmup_s": warm,
            "transformers": transformers.__version__}


def _hf_model(cfg, weights):
    from transformers import LlamaConfig, LlamaForCausalLM  # here: optional, as in hf_generate

    hc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads, rope_theta=cfg.rope_theta,
                     rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                     tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    m = LlamaForCausalLM(hc)
    sd = {"model.embed_tokens.weight": weights["embed"], "model.norm.weight": weights["norm"]}
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj", "input_norm": "input_layernorm",
             "post_norm": "post_attention_layernorm"}
    for i in range(cfg.num_hidden_layers):
        for ours_name, hf_name in names.items():
            sd[f"model.layers.{i}.{hf_name}.weight"] = weights[f"layers.{i}.{ours_name}"]
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"weights did not map onto transformers' names: {missing[:3]} {unexpected[:3]}")
    m.tie_weights()
    return m.to("cuda", torch.float16).eval()


def check(model, weights, tokenizer=None, new_tokens: int = 32) -> dict:
    """Our graph step (greedy) against transformers' forward on the same weights, teacher-forced on our tokens."""
    cfg = model.config
    prompts = ([tokenizer.chat("Write a short story about a robot who learns to paint."),
                tokenizer.chat("Explain why the sky is blue.")] if tokenizer else _prompts(cfg, 2)[:2])
    prompts = [p[:PROMPT] for p in prompts]
    n = min(map(len, prompts))
    prompts = [p[:n] for p in prompts]  # one length: transformers' forward without padding
    cache = _cache(cfg, 2, n + new_tokens + 1)
    runner = Runner(model, PagedKV(cache))
    first = [runner.prefill(i, p)[0] for i, p in enumerate(prompts)]
    toks = [int(f.argmax()) for f in first]
    seqs = [[t] for t in toks]
    logits = [torch.stack(first)]
    dec = GraphDecoder(model, cache, 2, n + new_tokens + 1)
    for _ in range(new_tokens - 1):
        out = dec.step([0, 1], toks).clone()
        logits.append(out)
        toks = out.argmax(-1).tolist()
        for s, t in zip(seqs, toks, strict=True):
            s.append(t)
    ours_logits = torch.stack(logits, 1).float()  # [2, new_tokens, vocab]
    m = _hf_model(cfg, weights)
    full = torch.tensor([p + s[:-1] for p, s in zip(prompts, seqs, strict=True)], device="cuda")
    with torch.no_grad():
        ref = m(full).logits[:, n - 1:].float()  # [2, new_tokens, vocab]
    diff = (ours_logits - ref).abs()
    top2 = ref.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05  # steps where fp16 rounding cannot flip the argmax
    agree = (ours_logits.argmax(-1) == ref.argmax(-1))
    row = {"check": "real" if tokenizer else "random", "max_abs_logit_diff": float(diff.max()),
           "mean_abs_logit_diff": float(diff.mean()), "logit_scale": float(ref.abs().max()),
           "argmax_agree": float(agree.float().mean()), "argmax_agree_clear": float(agree[clear].float().mean()),
           "steps": new_tokens}
    if tokenizer:
        row["text"] = tokenizer.decode(seqs[0])
        row["tokens_equal_hf_greedy"] = bool(agree.all())
    return row


def main(argv: list[str] | None = None) -> int:
    ap = BenchParser("model_decode", __doc__, gpu=True, smoke=SMOKE_HELP + ": sections cascade and quest only")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=positive_int, default=256)
    ap.add_argument("--eager-steps", type=positive_int, default=32)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--compile", action="store_true", help="also time the graph step with Llama.compile()")
    ap.add_argument("--check", action="store_true", help="graph step vs transformers' forward (random weights)")
    ap.add_argument("--gguf", default=None, help="also check with the real weights of this GGUF file")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma separated, of " + ", ".join(SECTIONS) + " (decode: our runner vs transformers' "
                         "generate; cascade, quest: the runner through the shared-prefix cascade and Quest)")
    model_decode_paths.add_arguments(ap)
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    if set(sections) - set(SECTIONS):
        ap.error(f"argument --sections: {sorted(set(sections) - set(SECTIONS))} not among {', '.join(SECTIONS)}")
    paths = [s for s in model_decode_paths.SECTIONS if s in sections]
    if paths and not args.smoke:
        try:
            model_decode_paths.check_options(paths, args.samples, args.shared_prompt, args.long_prompt,
                                             args.quest_batches, args.quest_budgets, args.new_tokens)
        except ValueError as e:
            ap.error(f"arguments of sections {','.join(paths)} (--new-tokens, --samples, --quest-budgets): {e}")
    out = ap.start(args)
    if out is None:
        return 2
    meta, rows = provenance.machine_meta(), []
    extra = {"weights": "random (timing does not depend on values), fp16", "prompt": PROMPT,
             "new_tokens": args.new_tokens, "sections": sections}
    if args.smoke:
        cfg = SMOLLM2_135M.with_layers(2)
        rows = model_decode_paths.smoke_rows(Llama(cfg, random_weights(cfg, seed=0), device=workbench.device()))
        path = run_files.write_results("model-decode", rows, meta, out, extra={"mode": "smoke", "weights": "random, "
                                                                               "fp32, 2 layers"})
        print(f"wrote {path}")
        return 0
    cfg = SMOLLM2_135M
    need = model_decode_paths.positions_needed(paths, args.shared_prompt, args.long_prompt, args.new_tokens)
    if need > cfg.max_position_embeddings:  # the 32k prompt: RoPE past the trained 8192 (random weights: timing only)
        cfg = dataclasses.replace(cfg, max_position_embeddings=need)
        extra["rope_positions"] = need
    weights = {k: v.half() for k, v in random_weights(cfg, seed=0).items()}
    model = _model(cfg, weights)
    if args.check or args.gguf:
        rows.append({"section": "check", **check(model, weights)})
        print(rows[-1], file=sys.stderr)
    if args.gguf:
        g = read_gguf(args.gguf, use_cache=False)
        real = {k: v.half() for k, v in g.weights.items()}
        rows.append({"section": "check", **check(_model(g.config, real), real, Tokenizer.from_gguf(g))})
        print(rows[-1], file=sys.stderr)
    for b in (int(x) for x in args.batches.split(",")) if "decode" in sections else ():
        row = {"section": "decode", **ours(model, b, args.new_tokens, args.eager_steps)}
        if args.compile:
            fused = ours(_model(cfg, weights), b, args.new_tokens, 2, compile=True)
            row.update({f"compiled_{k}": v for k, v in fused.items() if k not in ("batch", "eager_ms", "floor_ms",
                                                                                   "context_end")})
        if not args.no_hf:
            row.update(hf_generate(cfg, weights, b, args.new_tokens))
            row["speedup_vs_hf_static"] = row["hf_static_ms"] / row["graph_ms"]
            if args.compile:
                row["compiled_speedup_vs_hf_static"] = row["hf_static_ms"] / row["compiled_graph_ms"]
        rows.append(row)
        _print(row)
        torch.cuda.empty_cache()
    if rows:  # checkpoint: the same run rewrites its own file
        run_files.write_results("model-decode", rows, meta, out, extra=extra)
    if paths:
        extra.update(samples=args.samples, shared_prompt=args.shared_prompt, long_prompt=args.long_prompt)
        for row in model_decode_paths.run(model, "fp16", sections=paths, samples=args.samples,
                                          shared_prompt=args.shared_prompt, long_prompt=args.long_prompt,
                                          batches=args.quest_batches, budgets=args.quest_budgets,
                                          new_tokens=args.new_tokens):
            rows.append(row)
            _print(row)
            run_files.write_results("model-decode", rows, meta, out, extra=extra)
    path = run_files.write_results("model-decode", rows, meta, out, extra=extra)
    print(f"wrote {path}")
    return 0


def _print(row: dict) -> None:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, file=sys.stderr)
